"""Model fingerprints: a cache must never load into a different model.

Two models with the same shapes accept each other's KV silently and produce
garbage, and a fine-tuned model has exactly the shapes of its base. So every
capture and `.kvc` file carries a record of the model it came from, and
version 2 of that record identifies the weights *exactly*:

* ``weights_sha256``: sha256 over every tensor of the checkpoint's
  safetensors files, in canonical (name) order, each as a length-prefixed
  record ``[name, dtype, shape, nbytes]`` followed by its raw bytes as stored.
  Streaming (bounded memory: one read buffer), independent of sharding and of
  the order tensors sit in the files. One changed element anywhere changes it.
* ``config_sha256``: sha256 of the config fields that change what the model
  computes (:data:`CONFIG_FIELDS`: head layout, RoPE incl. scaling and
  per-layer-type parameters, sliding windows / layer types, biases, norms).
* ``tokenizer_sha256``: vocabulary (by id), BPE merges and special tokens.
* ``rope``: canonical JSON of the RoPE parameters (the codec's RoPE stage reads it).

Hashing ~0.5 GB takes seconds, so the weights digest (and the tokenizer
digest, which needs a 1.5 MB JSON parse) is cached per model directory under
``cache_root()/fingerprints/``, keyed by the identity of the files it was
computed from (path, size, mtime_ns, ctime_ns, inode, device) and
authenticated with an HMAC whose key is a per-machine secret file
(``fingerprint.key``, mode 0600). An entry whose MAC or file identity does not
match is ignored and recomputed; a key file with unsafe permissions disables
the cache (every open re-hashes) instead of trusting it.

The compute dtype is recorded but is *not* part of identity (an fp32 and a
bf16 load of the same directory are the same model). Models that exist only
in memory (no directory) are hashed from their state dict under a separate
domain: their id never equals a directory's.

Version-1 fingerprints (a hash of a few K/V projections) cannot tell a
fine-tuned model from its base: files carrying one still parse and decode
standalone, but every check against a model refuses them (spec/kvc-v1.md §4.1).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets
import stat
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping


from kvcodec.errors import KvcModelNotFoundError, is_int, json_loads
from kvcodec.core.fingerprint import HEX64, ModelFingerprint
from kvcodec.digest import json_sha256
from kvcodec.models.layout import ModelLayout, canonical_rope, text_config
from kvcodec.paths import cache_root

__all__ = ["CONFIG_FIELDS", "CONFIG_FLAGS", "TOKENIZER_FILES", "cache_config", "canonical_rope", "checkpoint_tensors",
           "fingerprint_dir", "fingerprint_model", "read_config", "tokenizer_sha256", "weight_files", "weights_identity",
           "weights_sha256"]

# Config fields (of the text config) that change the model's computation; absent/None ones are omitted.
CONFIG_FIELDS = (
    "model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_size",
    "intermediate_size", "vocab_size", "hidden_act", "hidden_activation", "rms_norm_eps", "layer_norm_eps",
    "layer_norm_epsilon", "attention_bias", "mlp_bias", "qkv_bias", "sliding_window", "sliding_window_pattern",
    "layer_types", "use_sliding_window", "max_window_layers", "attention_chunk_size", "no_rope_layers",
    "partial_rotary_factor", "max_position_embeddings", "original_max_position_embeddings", "rope_local_base_freq",
    "attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar", "tie_word_embeddings",
    "use_qk_norm", "qk_layernorm", "attention_multiplier", "residual_multiplier", "embedding_multiplier",
    "logits_scaling", "scale_embedding", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim",
    "v_head_dim", "n_layer", "n_head", "n_embd", "n_inner", "n_positions", "activation_function", "num_kv_heads",
    "multi_query", "new_decoder_architecture", "parallel_attn", "alibi",
)

# Config fields that change the computation but were added after fingerprints existed: each counts only when set to
# other than its default (one for every family, or per model_type: a family not named keeps it out), so no model that
# leaves it at the default changes fingerprint id. Each makes other K/V from the same weights, whose caches the model
# accepted before: use_bidirectional_attention (Gemma 3: every token attends to every other), scale_attn_weights and
# scale_attn_by_inverse_layer_idx (GPT-2's score scaling), use_parallel_residual (GPT-NeoX, StableLM: attention and
# MLP side by side or in sequence), do_layer_norm_before (OPT: pre- or post-norm).
CONFIG_FLAGS: dict[str, Any] = {
    "use_bidirectional_attention": False, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "use_parallel_residual": {"gpt_neox": True, "stablelm": False}, "do_layer_norm_before": {"opt": True},
}

# A mixture of experts' routing: how many experts a token takes, whether their weights are renormalised, and their
# scale change every later layer's K/V from the same weights, and MoE configs always write them, so each counts
# only where it differs from its family's default. The defaults are pinned here, as transformers 5.19's config
# classes set them (read once from AutoConfig.for_model(model_type)), never read from the installed transformers:
# a later release changing a default must not change a fingerprint id. A family not named keeps the field out.
_TOPK: dict[str, int] = {
    "afmoe": 6, "axk1": 8, "axk2": 8, "cohere2_moe": 2, "deepseek_v3": 8, "deepseek_v32": 8, "deepseek_v4": 6,
    "doge": 64, "ernie4_5_moe": 6, "ernie4_5_vl_moe": 6, "ernie4_5_vl_moe_text": 6, "exaone_moe": 8, "flex_olmo": 5,
    "glm4_moe": 8, "glm4_moe_lite": 4, "glm4v_moe": 8, "glm4v_moe_text": 8, "glm5_next": 8, "glm5_next_text": 8,
    "glm_moe_dsa": 8, "gpt_oss": 4, "granitemoe": 2, "granitemoe_swa": 2, "granitemoehybrid": 2,
    "granitemoeshared": 2, "hunyuan_v1_moe": 1, "hy_v3": 8, "hy_v4": 8, "inkling_mm_model": 6, "inkling_text": 6,
    "jamba": 2, "jetmoe": 2, "kimi_k25": 8, "kimi_linear": 8, "laguna": 8, "lfm2_moe": 4, "llama4": 1,
    "llama4_text": 1, "longcat_flash": 12, "mellum": 8, "mimo_v2_flash": 8, "minimax": 2, "minimax_m2": 8,
    "minimax_m3_vl": 4, "minimax_m3_vl_text": 4, "mistral4": 4, "mixtral": 2, "nemotron_h": 2, "nemotron_h_omni": 2,
    "olmoe": 8, "phimoe": 2, "qwen2_moe": 4, "qwen3_5_moe": 8, "qwen3_5_moe_text": 8, "qwen3_moe": 8,
    "qwen3_next": 10, "qwen3_omni_moe": 8, "qwen3_omni_moe_talker_text": 8, "qwen3_omni_moe_text": 8,
    "qwen3_omni_moe_thinker": 8, "qwen3_vl_moe": 4, "qwen3_vl_moe_text": 4, "qwen4_exp": 10, "qwen4_exp_text": 10,
    "solar_open": 8, "step3p5": 8, "step3p7": 8, "zaya": 1,
}
_NORM_TOPK: dict[str, bool] = {
    "axk1": True, "axk2": True, "cohere2_moe": True, "deepseek_v2": False, "deepseek_v3": True, "deepseek_v32": True,
    "deepseek_v4": True, "doge": False, "dots1": False, "exaone_moe": True, "flex_olmo": False, "glm4_moe": True,
    "glm4_moe_lite": True, "glm4v_moe": True, "glm4v_moe_text": True, "glm5_next": True, "glm5_next_text": True,
    "glm_moe_dsa": True, "hy_v4": True, "kimi_k25": True, "kimi_linear": True, "lfm2_moe": True, "mellum": True,
    "mimo_v2_flash": True, "mistral4": True, "nemotron_h": True, "nemotron_h_omni": True, "olmoe": False,
    "qwen2_moe": False, "qwen3_moe": False, "qwen3_next": True, "qwen3_omni_moe": True,
    "qwen3_omni_moe_talker_text": False, "qwen3_omni_moe_text": True, "qwen3_omni_moe_thinker": True,
    "qwen4_exp": True, "qwen4_exp_text": True, "solar_open": True,
}
_SCALING: dict[str, float] = {
    "axk1": 2.5, "axk2": 2.5, "deepseek_ocr2": 1.0, "deepseek_ocr2_text": 1.0, "deepseek_v2": 1.0, "deepseek_v3": 2.5,
    "deepseek_v32": 2.5, "deepseek_v4": 1.5, "dots1": 1.0, "exaone_moe": 2.5, "glm4_moe": 1.0, "glm4_moe_lite": 1.8,
    "glm4v_moe": 1.0, "glm4v_moe_text": 1.0, "glm5_next": 2.5, "glm5_next_text": 2.5, "glm_moe_dsa": 2.5,
    "hy_v4": 2.827, "kimi_k25": 2.5, "kimi_linear": 2.446, "lfm2_moe": 1.0, "longcat_flash": 6.0,
    "mimo_v2_flash": 1.0, "minimax_m3_vl": 2.0, "minimax_m3_vl_text": 2.0, "mistral4": 1.0, "nemotron_h": 1.0,
    "nemotron_h_omni": 1.0, "solar_open": 1.0,
}
CONFIG_FLAGS.update({"num_experts_per_tok": _TOPK, "norm_topk_prob": _NORM_TOPK, "routed_scaling_factor": _SCALING,
                     "moe_topk": {"aria": 2, "aria_text": 2, "hunyuan_v1_moe": 1, "longcat_flash": 12}})
# Group-limited routing (experts chosen from the best n_group groups' topk_group), and fields only a few families have
# (pinned as transformers 5.19's config classes set them, as above): OLMo's clamp of Q/K/V, norm epsilons under names
# CONFIG_FIELDS does not list (StarCoder2, Nemotron), BLOOM's residual after the norm, Llama 4's query temperature on
# its NoPE layers. Each makes other K/V from the same weights (found by the unseen-family sweep).
_GROUPS = ("axk1", "axk2", "deepseek_ocr2", "deepseek_ocr2_text", "deepseek_v2", "deepseek_v3", "deepseek_v32", "dots1",
           "exaone_moe", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm4v_moe_text", "glm5_next", "glm5_next_text",
           "glm_moe_dsa", "hy_v4", "kimi_k25", "kimi_linear", "mimo_v2_flash", "mistral4", "nemotron_h",
           "nemotron_h_omni", "solar_open")
_N_GROUP = {"axk1": 8, "deepseek_v3": 8, "deepseek_v32": 8, "kimi_k25": 8}
_TOPK_GROUP = {"axk1": 4, "deepseek_v3": 4, "deepseek_v32": 4, "kimi_k25": 4}
_NONE_GROUP = ("axk2", "deepseek_ocr2", "deepseek_ocr2_text", "deepseek_v2")
CONFIG_FLAGS.update({
    "n_group": {m: None if m in _NONE_GROUP else _N_GROUP.get(m, 1) for m in _GROUPS if m != "kimi_linear"},
    "topk_group": {m: None if m in _NONE_GROUP else _TOPK_GROUP.get(m, 1) for m in _GROUPS},
    "topk_method": {"deepseek_ocr2": "greedy", "deepseek_ocr2_text": "greedy", "deepseek_v2": "greedy"},
    "scoring_func": {"deepseek_v4": "sqrtsoftplus"},
    "clip_qkv": {"olmo": None, "olmoe": None},
    "norm_epsilon": {"starcoder2": 1e-05},
    "norm_eps": {"nemotron": 1e-05},
    "apply_residual_connection_post_layernorm": {"bloom": False},
    "attn_temperature_tuning": {"llama4": True, "llama4_text": True},
    "floor_scale": {"llama4": 8192, "llama4_text": 8192},
    "attn_scale": {"llama4": 0.1, "llama4_text": 0.1},
})

_MAX_JSON_FILE = 64 << 20  # config.json / index.json / cache entries larger than this are refused
_WEIGHTS_DOMAIN = b"kvcodec-weights-v2\0"
_MEMORY_DOMAIN = b"kvcodec-weights-in-memory-v2\0"


# --------------------------------------------------------------------------- config and tokenizer
def cache_config(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`CONFIG_FIELDS` of a config dict (raw config.json or ``config.to_dict()``), the
    :data:`CONFIG_FLAGS` set to other than their default, plus canonical RoPE."""
    c = text_config(cfg)
    out = {k: c[k] for k in CONFIG_FIELDS if c.get(k) is not None}
    for k, default in CONFIG_FLAGS.items():
        if isinstance(default, dict):  # per family: a family without a default keeps the field out
            default = default.get(c.get("model_type"), c.get(k))
        if c.get(k) not in (None, default):
            out[k] = c[k]
    out["rope"] = canonical_rope(cfg)
    return out


def tokenizer_sha256(tokenizer: Any) -> str:
    """sha256 of the vocabulary (by id), the BPE merges and the special tokens.

    Only content that survives a tokenizers/transformers upgrade is hashed
    (merges are normalised to ``"a b"``), so the vLLM connector's venv and
    kvcodec's agree on the same directory.
    """
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    merges: list[str] = []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        model = json_loads(backend.to_str()).get("model") or {}
        merges = [" ".join(m) if isinstance(m, list) else str(m) for m in model.get("merges") or []]
    blob = json.dumps({"vocab": vocab, "special": special, "merges": merges}, ensure_ascii=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def _make(cfg: Mapping[str, Any], tokenizer_digest: str, weights: str, dtype: str) -> ModelFingerprint:
    layout = ModelLayout.from_config(cfg)
    return ModelFingerprint(
        architecture=layout.family,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dims=tuple([layout.head_dim] * layout.num_layers),
        rope=layout.rope,
        tokenizer_sha256=tokenizer_digest,
        weights_sha256=weights,
        dtype=dtype,
        config_sha256=json_sha256(cache_config(cfg)),
    )


# --------------------------------------------------------------------------- safetensors, streamed
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
                "U16": 2, "U32": 4, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1}
_MAX_ST_HEADER = 100 << 20  # the safetensors format's own limit
_READ_BYTES = 4 << 20
_NOTICE_BYTES = 2 << 30
_SAFE_INDEX = "model.safetensors.index.json"
_PICKLE_GLOBS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offsets in ``file``
    end: int


def _read_json(path: Path, what: str) -> Any:
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_JSON_FILE:
            raise KvcModelNotFoundError(f"{path}: {what} is not a regular file of at most 64 MiB")
        with open(path, "rb") as f:
            return json_loads(f.read(_MAX_JSON_FILE + 1))
    except (OSError, ValueError) as exc:
        raise KvcModelNotFoundError(f"{path}: unreadable {what} ({exc})") from None


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of an HF model directory (per its index, else ``*.safetensors``).

    Pickle checkpoints are refused: kvcodec never unpickles.
    """
    idx = model_dir / _SAFE_INDEX
    if idx.exists():
        wm = _read_json(idx, "safetensors index")
        wm = wm.get("weight_map") if isinstance(wm, dict) else None
        if not isinstance(wm, dict) or not wm or not all(isinstance(v, str) for v in wm.values()):
            raise KvcModelNotFoundError(f"{idx}: no weight_map")
        names = sorted(set(wm.values()))
        if any(n != Path(n).name or n in (".", "..") or not n.endswith(".safetensors") for n in names):
            raise KvcModelNotFoundError(f"{idx}: weight files must be plain *.safetensors names in the directory")
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        pickles = [p.name for g in _PICKLE_GLOBS for p in model_dir.glob(g)]
        why = f" (found {pickles[0]}: pickle checkpoints are refused, convert it to safetensors)" if pickles else ""
        raise KvcModelNotFoundError(f"{model_dir} holds no .safetensors weights{why}")
    for p in files:
        try:
            ok = stat.S_ISREG(os.stat(p).st_mode)
        except OSError:
            ok = False
        if not ok:
            raise KvcModelNotFoundError(f"{p}: weight file missing or not a regular file")
    return files


def _tensors_of(path: Path, f: Any, size: int) -> list[_Tensor]:
    """Parse and bound-check one safetensors header (sizes checked against the real file size)."""
    def bad(why: str) -> KvcModelNotFoundError:
        return KvcModelNotFoundError(f"{path}: truncated or corrupt safetensors file ({why})")

    head = f.read(8)
    if len(head) != 8:
        raise bad("shorter than its 8-byte header length")
    n = int.from_bytes(head, "little")
    if n > _MAX_ST_HEADER or 8 + n > size:
        raise bad(f"header length {n} does not fit the {size}-byte file")
    try:
        hdr = json_loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"header is not JSON: {exc}") from None
    if not isinstance(hdr, dict):
        raise bad("header is not a JSON object")
    base, data_len = 8 + n, size - 8 - n
    out = []
    for name, t in hdr.items():
        if name == "__metadata__":
            continue
        if not isinstance(t, dict):
            raise bad(f"tensor {name!r:.60} entry is not an object")
        dt, shape, offs = t.get("dtype"), t.get("shape"), t.get("data_offsets")
        if dt not in _ST_ITEMSIZE or not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
            raise bad(f"tensor {name!r:.60} has an unsupported dtype or shape")
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs) and 0 <= offs[0] <= offs[1] <= data_len):
            raise bad(f"tensor {name!r:.60} lies outside the file")
        if offs[1] - offs[0] != math.prod(shape) * _ST_ITEMSIZE[dt]:
            raise bad(f"tensor {name!r:.60} size disagrees with its shape")
        out.append(_Tensor(name, dt, tuple(shape), path, base + offs[0], base + offs[1]))
    return out


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[tuple[int, ...], int, str]]:
    """Per tensor of the directory's safetensors files: (shape, bytes, safetensors dtype), from their bound-checked
    headers only."""
    out: dict[str, tuple[tuple[int, ...], int, str]] = {}
    try:
        for p in weight_files(Path(model_dir)):
            with open(p, "rb") as f:
                for t in _tensors_of(p, f, os.fstat(f.fileno()).st_size):
                    out[t.name] = (t.shape, t.end - t.start, t.dtype)
    except OSError as exc:
        raise KvcModelNotFoundError(f"cannot read model weights: {exc}") from None
    return out


def _stat_key(files: list[Path]) -> list[list[Any]]:
    """What identifies the weight files' contents without reading them (ctime changes on any write or utime)."""
    out = []
    for p in files:
        st = os.stat(p)
        out.append([str(p), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev])
    return out


def _hash_files(files: list[Path]) -> str:
    """The streamed weights digest (see module doc); memory = one read buffer + the headers."""
    handles = {}
    try:
        tensors: dict[str, _Tensor] = {}
        for p in files:
            f = handles[p] = open(p, "rb")
            for t in _tensors_of(p, f, os.fstat(f.fileno()).st_size):
                if t.name in tensors:
                    raise KvcModelNotFoundError(f"{p}: tensor {t.name!r:.60} appears in two weight files")
                tensors[t.name] = t
        if not tensors:
            raise KvcModelNotFoundError(f"{files[0].parent}: the safetensors files hold no tensors")
        total = sum(t.end - t.start for t in tensors.values())
        if total > _NOTICE_BYTES:  # minutes on a big model: say why the first load is slow
            print(f"kvc: fingerprinting {total / 1e9:.1f} GB of weights in {files[0].parent} "
                  "(once; cached afterwards) ...", file=sys.stderr, flush=True)
        h = hashlib.sha256(_WEIGHTS_DOMAIN)
        buf = memoryview(bytearray(_READ_BYTES))
        for name in sorted(tensors):
            t = tensors[name]
            rec = json.dumps([t.name, t.dtype, list(t.shape), t.end - t.start], ensure_ascii=True).encode()
            h.update(len(rec).to_bytes(8, "little") + rec)
            f = handles[t.file]
            f.seek(t.start)
            left = t.end - t.start
            while left:
                k = f.readinto(buf[: min(left, _READ_BYTES)])
                if not k:
                    raise KvcModelNotFoundError(f"{t.file}: truncated while reading tensor {name!r:.60}")
                h.update(buf[:k])
                left -= k
        return h.hexdigest()
    except OSError as exc:
        raise KvcModelNotFoundError(f"cannot read model weights: {exc}") from None
    finally:
        for f in handles.values():
            f.close()


# --------------------------------------------------------------------------- the authenticated cache
_KEY_FILE = "fingerprint.key"
_CACHE_SCHEME = "kvcodec-fingerprint-cache-v2"
_memo: dict[str, tuple[list[list[Any]], str]] = {}
_memo_lock = threading.Lock()
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        print(f"kvc: warning: {msg}", file=sys.stderr)


def _secret() -> bytes | None:
    """The per-machine HMAC key (created 0600 on first use); None (cache disabled) if it cannot be trusted."""
    path = cache_root() / _KEY_FILE
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{_KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, secrets.token_bytes(32))
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, path)  # atomic and never clobbers a key another process made first
            except FileExistsError:
                pass
            finally:
                os.unlink(tmp)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)  # NONBLOCK: a FIFO there hung every load
        try:
            st = os.fstat(fd)
            key = os.read(fd, 64) if stat.S_ISREG(st.st_mode) else b""
        finally:
            os.close(fd)
    except OSError as exc:
        _warn_once(f"fingerprint cache disabled: cannot use key file {path} ({exc})")
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or len(key) != 32:
        _warn_once(f"fingerprint cache disabled: key file {path} is not a private 32-byte file of this user (mode 0600)")
        return None
    return key


def _mac(key: bytes, entry: Mapping[str, Any]) -> str:
    body = json.dumps({k: v for k, v in entry.items() if k != "mac"}, sort_keys=True, ensure_ascii=True).encode()
    return hmac.new(key, body, hashlib.sha256).hexdigest()


def _cache_path(kind: str, model_dir: Path) -> Path:
    name = hashlib.sha256(f"{kind}\0{model_dir}".encode("utf-8", "surrogateescape")).hexdigest()[:32]
    return cache_root() / "fingerprints" / f"{name}.json"


def _cached(kind: str, model_dir: Path, key: list[list[Any]], secret: bytes) -> str | None:
    path = _cache_path(kind, model_dir)
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
            return None
        entry = json_loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or not isinstance(entry.get("mac"), str):
        return None
    if not hmac.compare_digest(entry["mac"], _mac(secret, entry)):
        return None
    if entry.get("scheme") != _CACHE_SCHEME or entry.get("kind") != kind or entry.get("dir") != str(model_dir) \
            or entry.get("files") != key:
        return None
    digest = entry.get("sha256")
    return digest if isinstance(digest, str) and HEX64.match(digest) else None


def _store(kind: str, model_dir: Path, key: list[list[Any]], digest: str, secret: bytes) -> None:
    entry: dict[str, Any] = {"scheme": _CACHE_SCHEME, "kind": kind, "dir": str(model_dir), "files": key, "sha256": digest}
    entry["mac"] = _mac(secret, entry)
    path = _cache_path(kind, model_dir)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(entry, f, sort_keys=True)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only cache dir costs speed, never correctness
        _warn_once(f"cannot write the fingerprint cache ({exc})")


def _digest(kind: str, model_dir: Path, files: list[Path], compute: Any, use_cache: bool = True) -> str:
    """``compute()`` of ``files``, cached by their identity: in-process memo, then the HMAC'd entry on disk."""
    key = _stat_key(files)
    memo_key = f"{kind}\0{model_dir}"
    if use_cache:
        with _memo_lock:
            hit = _memo.get(memo_key)
        if hit is not None and hit[0] == key:
            return hit[1]
    secret = _secret() if use_cache else None
    digest = _cached(kind, model_dir, key, secret) if secret is not None else None
    if digest is None:
        digest = compute()
        if _stat_key(files) != key:
            raise KvcModelNotFoundError(f"{model_dir}: the model files changed while they were being hashed; try again")
        if secret is not None:
            _store(kind, model_dir, key, digest, secret)
    if use_cache:
        with _memo_lock:
            _memo[memo_key] = (key, digest)
    return digest


def weights_identity(model_dir: str | Path) -> list[list[Any]]:
    """The stat identity of a directory's weight files (load_model compares it before and after loading)."""
    d = Path(model_dir).resolve()
    return _stat_key(weight_files(d))


def weights_sha256(model_dir: str | Path, use_cache: bool = True) -> str:
    """The weights digest of an HF model directory: cached (memo, then the HMAC'd file), else streamed.

    Refuses (KvcModelNotFoundError) pickle-only directories, truncated or
    corrupt safetensors, and weights that change while being hashed.
    """
    d = Path(model_dir).resolve()
    files = weight_files(d)
    return _digest("weights", d, files, lambda: _hash_files(files), use_cache)


# Files a tokenizer is loaded from; their identity keys the cached tokenizer digest.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja")


def _dir_tokenizer_sha256(d: Path, tokenizer: Any) -> str:
    """The tokenizer digest of a directory, cached by its tokenizer files (loading it only on a miss)."""
    files = [d / n for n in TOKENIZER_FILES if (d / n).is_file()]

    def compute() -> str:
        tok = tokenizer
        if tok is None:
            from transformers import AutoTokenizer

            try:
                tok = AutoTokenizer.from_pretrained(d, local_files_only=True, trust_remote_code=False)
            except (OSError, ValueError) as exc:
                raise KvcModelNotFoundError(f"cannot load the tokenizer of {d}: {exc}") from None
        return tokenizer_sha256(tok)

    if not files:
        return compute()
    return _digest("tokenizer", d, files, compute)


# --------------------------------------------------------------------------- entry points
def read_config(model_dir: str | Path) -> dict[str, Any]:
    """An HF model directory's raw config.json (bounded read): what its fingerprint and layout read."""
    d = Path(model_dir).resolve()
    cfg = _read_json(d / "config.json", "config.json")
    if not isinstance(cfg, dict):
        raise KvcModelNotFoundError(f"{d}/config.json is not a JSON object")
    return cfg


def fingerprint_dir(model_dir: str | Path, tokenizer: Any = None, dtype: str = "float32") -> ModelFingerprint:
    """The fingerprint of an HF model directory: raw config.json, its tokenizer and its safetensors files.

    ``tokenizer``: the directory's tokenizer if the caller has loaded it
    already (used only when the tokenizer digest is not cached); else it is
    loaded from the directory when needed. This is the only way a directory
    is fingerprinted (LoadedModel, the vLLM connector).
    """
    d = Path(model_dir).resolve()
    return _make(read_config(d), _dir_tokenizer_sha256(d, tokenizer), weights_sha256(d), dtype)


def _module_weights_sha256(model: Any) -> str:
    """Digest of a model that exists only in memory: its state dict, one tensor at a time."""
    import torch

    codes = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64",
             torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
    h = hashlib.sha256(_MEMORY_DOMAIN)
    sd = model.state_dict()
    for name in sorted(sd):
        t = sd[name].detach().cpu().contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b""
        rec = json.dumps([name, codes.get(t.dtype, str(t.dtype)), list(t.shape), len(raw)]).encode()
        h.update(len(rec).to_bytes(8, "little") + rec)
        h.update(raw)
    return h.hexdigest()


def fingerprint_model(model: Any, tokenizer: Any) -> ModelFingerprint:
    """The fingerprint of a model that exists only in memory (no directory): hashed from its state dict."""
    cfg = model.config.to_dict()
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return _make(cfg, tokenizer_sha256(tokenizer), _module_weights_sha256(model), dtype)
