"""What a model directory must satisfy before transformers reads it: bounded side files and a config that fits its weights.

Why before transformers: it trusts the directory. It reads config.json, the tokenizer files and the
generation config whole (a 2 GB file given by mistake is 2 GB of memory), it blocks for ever opening a
FIFO, and it builds the model the config describes and then fills every weight the checkpoint lacks with
random values (a config.json that says 4,000 layers over a 2-layer checkpoint loads, silently, as a
random model; one whose sizes describe terabytes allocates them). Each of these is refused here in one
:class:`KvcModelNotFoundError` line, and the load that follows is checked for weights it left random.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from kvcodec.errors import KvcModelNotFoundError, is_int
from kvcodec.models.fingerprint import TOKENIZER_FILES, checkpoint_tensors
from kvcodec.models.layout import ModelLayout, canonical_rope, text_config

__all__ = ["check_config", "check_loaded", "check_side_files", "check_skeleton", "check_vocabulary"]

# Files transformers may read besides the weights, with the size past which a file is refused. A real
# tokenizer.json is at most a few tens of MB (262k-token vocabularies: ~35 MB); the JSON configs are KBs.
_MAX_JSON = 64 << 20
_MAX_TOKENIZER = 512 << 20
SIDE_FILES: dict[str, int] = {
    "config.json": _MAX_JSON, "generation_config.json": _MAX_JSON, "chat_template.json": _MAX_JSON,
    **{n: _MAX_TOKENIZER if n in ("tokenizer.json", "tokenizer.model", "spiece.model", "vocab.json", "merges.txt",
                                  "vocab.txt") else _MAX_JSON for n in TOKENIZER_FILES},
}


_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0")


def check_side_files(path: Path) -> None:
    """Every file transformers may open besides the weights is a regular file of bounded size (or absent).

    Symbolic links are followed (a Hugging Face cache snapshot is links into its blobs); what they name
    must still be a regular file: a FIFO would block the load for ever, /dev/zero read without end.
    """
    for name, limit in SIDE_FILES.items():
        p = Path(path) / name
        try:
            st = os.stat(p)
        except FileNotFoundError:  # absent, or a dangling link: transformers skips it too
            continue
        except OSError as exc:
            raise KvcModelNotFoundError(f"{p}: cannot read ({exc.strerror})") from None
        if not stat.S_ISREG(st.st_mode):
            raise KvcModelNotFoundError(f"{p}: not a regular file")
        if st.st_size > limit:
            raise KvcModelNotFoundError(f"{p}: {st.st_size:,} bytes, more than the {limit >> 20} MiB a model's "
                                        f"{name} can be")


def _rope_thetas(r: Mapping[str, Any]) -> list[Any]:
    out = [r["rope_theta"]] if "rope_theta" in r else []
    return out + [v["rope_theta"] for v in r.values() if isinstance(v, dict) and "rope_theta" in v]


def check_config(cfg: Mapping[str, Any]) -> ModelLayout:
    """The config's head layout (:meth:`ModelLayout.from_config`: sizes in range), MoE top-k and RoPE bases, checked;
    multi-head latent attention refused.

    A RoPE base that is not a finite number > 0 makes every rotated key NaN: the model loads and runs and
    everything computed from it (captures, its calibration) is NaN.
    """
    layout = ModelLayout.from_config(cfg)
    c = text_config(cfg)
    k = c.get("num_experts_per_tok")
    n = next((c[x] for x in ("num_local_experts", "num_experts", "n_routed_experts") if isinstance(c.get(x), int)), None)
    if isinstance(k, int) and isinstance(n, int) and not 0 < k <= n:  # the router's top-k: a RuntimeError mid-forward
        raise KvcModelNotFoundError(f"model config routes each token to {k} of its {n} experts")
    lora = c.get("kv_lora_rank")
    if is_int(lora, 1):
        # multi-head latent attention (DeepSeek-V2/V3, MiniCPM3, ...): transformers caches one compressed latent and
        # one shared RoPE key per token, not the per-head K/V the config's heads describe; the first capture failed
        # on a shape kvcodec had no reason to expect ("layer 0 key has shape (1, 120, 32), expected (4, 120, 16)")
        raise KvcModelNotFoundError(f"model config uses multi-head latent attention (kv_lora_rank {lora}): its cache "
                                    "holds a compressed latent per token, not per-head keys and values; kvcodec does "
                                    "not support it")
    rope = canonical_rope(cfg)
    for prf in [c.get("partial_rotary_factor"), rope.get("partial_rotary_factor")] + [
            v.get("partial_rotary_factor") for v in rope.values() if isinstance(v, dict)]:
        if prf is not None and (isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1):
            # the share of each head that rotates: 3 or 0 loaded, and kvcodec's RoPE reading (the codec's stage,
            # CacheBlend's re-rotation) then disagreed with the model's
            raise KvcModelNotFoundError(f"model config has partial_rotary_factor {prf!r}; it must be a number in (0, 1]")
    for theta in _rope_thetas(rope):
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 0:
            raise KvcModelNotFoundError(f"model config has RoPE base rope_theta {theta!r}; it must be a finite "
                                        "number > 0")
    return layout


def check_skeleton(path: Path, cfg: Mapping[str, Any], skeleton: Any) -> None:
    """Refuse a config whose model the checkpoint cannot fill, before a byte of it is allocated.

    ``skeleton``: the model the config describes, built on the meta device (shapes, no storage). A
    parameter the checkpoint holds under the same name must have the same shape, and the checkpoint must
    hold at least as many values as the model has parameters (tied parameters counted once): otherwise
    transformers would allocate the difference and fill it with random values. A quantized checkpoint
    packs several parameters per stored value, so there only one bit per parameter is required.
    """
    tensors = checkpoint_tensors(path)
    quantized = "quantization_config" in cfg or "quantization_config" in text_config(cfg)
    need = 0
    for name, p in skeleton.named_parameters():
        shape = tuple(int(d) for d in p.shape)
        need += math.prod(shape)
        have = tensors.get(name)
        if have is not None and have[0] != shape:
            raise KvcModelNotFoundError(f"{path}: config.json disagrees with the weights: it makes {name} "
                                        f"{list(shape)}, the checkpoint holds {list(have[0])}")
        if have is not None and not quantized and p.is_floating_point() and have[2] not in _FLOAT_DTYPES:
            # integers where the model has floats: transformers converted each stored integer to a float value
            raise KvcModelNotFoundError(f"{path}: the checkpoint stores {name} as {have[2]}, not as floating point")
    values = sum(math.prod(t[0]) for t in tensors.values())
    nbytes = sum(t[1] for t in tensors.values())
    if need > (8 * nbytes if quantized else values):
        raise KvcModelNotFoundError(
            f"{path}: config.json describes a model of {need:,} parameters but the weights hold {values:,} values "
            "(the rest would be random)")


def check_loaded(path: Path, info: Any) -> None:
    """Refuse a load that left weights at random (transformers' loading info: missing keys)."""
    missing = sorted(info.get("missing_keys") or ()) if isinstance(info, Mapping) else []
    if missing:
        raise KvcModelNotFoundError(f"{path}: {len(missing)} weight(s) the config needs are not in the checkpoint "
                                    f"(e.g. {missing[0]!r:.80}); they would be random")


def check_vocabulary(path: Path, model: Any, tokenizer: Any) -> None:
    """Refuse a tokenizer whose own vocabulary (added tokens aside) has more ids than the model embeds.

    Why: such a tokenizer (another model's, copied in) gives ids past the embedding for ordinary text, and the
    prefill of ``kvc ask`` then escaped as torch's IndexError. Added tokens past the embedding are left alone:
    real checkpoints carry a pad token added without resizing the embedding, and ordinary text never gives it.
    """
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    rows = getattr(emb, "num_embeddings", None)
    base = getattr(tokenizer, "vocab_size", None)
    if isinstance(rows, int) and isinstance(base, int) and base > rows:
        raise KvcModelNotFoundError(f"{path}: the tokenizer has {base:,} tokens but the model embeds {rows:,} (a "
                                    "tokenizer from another model?)")
