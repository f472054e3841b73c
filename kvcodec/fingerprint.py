"""Model fingerprints: a cache must never load into a different model.

Two models with the same shapes accept each other's KV silently and produce
garbage, so every capture and `.kvc` file carries a small record of the model
it came from. Identity is decided by the architecture, shapes, RoPE settings,
a tokenizer hash and a hash of a few K/V projection weights; the compute
dtype is recorded but is *not* part of identity (an fp32 and a bf16 load of
the same checkpoint are the same model; the cache's own dtype is stored with
the tensors).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields
from typing import Any

from .errors import KvcFormatError, KvcModelMismatchError

FINGERPRINT_VERSION = 1


@dataclass(frozen=True)
class ModelFingerprint:
    architecture: str
    num_layers: int
    num_kv_heads: int
    head_dims: tuple[int, ...]
    rope: str  # canonical JSON of the RoPE parameters
    tokenizer_sha256: str
    weights_sha256: str
    dtype: str = "float32"
    version: int = FINGERPRINT_VERSION

    _IDENTITY = ("architecture", "num_layers", "num_kv_heads", "head_dims", "rope", "tokenizer_sha256", "weights_sha256", "version")

    @property
    def id(self) -> str:
        """Short stable hex id over the identity fields (used in store keys)."""
        ident = {k: getattr(self, k) for k in self._IDENTITY}
        return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:32]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["head_dims"] = list(self.head_dims)
        return d

    @classmethod
    def from_json(cls, obj: Any) -> "ModelFingerprint":
        if not isinstance(obj, dict):
            raise KvcFormatError("model fingerprint must be a JSON object")
        names = {f.name for f in fields(cls)}
        missing = names - set(obj) - {"dtype", "version"}
        if missing:
            raise KvcFormatError(f"model fingerprint lacks {sorted(missing)}")
        try:
            kw = {k: obj[k] for k in names if k in obj}
            kw["head_dims"] = tuple(int(x) for x in kw["head_dims"])
            fp = cls(**kw)
            ok = (
                isinstance(fp.architecture, str)
                and isinstance(fp.num_layers, int)
                and isinstance(fp.num_kv_heads, int)
                and 0 < fp.num_layers <= 4096
                and 0 < fp.num_kv_heads <= 4096
                and len(fp.head_dims) == fp.num_layers
                and all(0 < d <= 65536 for d in fp.head_dims)
                and all(isinstance(getattr(fp, k), str) for k in ("rope", "tokenizer_sha256", "weights_sha256", "dtype"))
            )
        except (TypeError, ValueError) as exc:
            raise KvcFormatError(f"bad model fingerprint: {exc}") from None
        if not ok:
            raise KvcFormatError("model fingerprint fields out of range")
        return fp

    def same_model(self, other: "ModelFingerprint") -> bool:
        return all(getattr(self, k) == getattr(other, k) for k in self._IDENTITY)

    def check_compatible(self, other: "ModelFingerprint", what: str = "cache") -> None:
        """Raise KvcModelMismatchError naming the first differing field."""
        for k in self._IDENTITY:
            a, b = getattr(self, k), getattr(other, k)
            if a != b:
                raise KvcModelMismatchError(
                    f"this {what} belongs to a different model ({k}: {_short(b)} in the {what}, {_short(a)} in the model)"
                )


def _short(v: Any) -> str:
    s = str(v)
    return s if len(s) <= 40 else s[:37] + "..."


def _hash_tokenizer(tokenizer: Any) -> str:
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = sorted(str(t) for t in getattr(tokenizer, "all_special_tokens", []))
    h = hashlib.sha256()
    h.update(json.dumps([vocab, special], ensure_ascii=False).encode())
    return h.hexdigest()


def _hash_weights(model: Any) -> str:
    """Hash the first and last layer's K/V projections (cast to fp32 bytes)."""
    import torch

    named = [(n, p) for n, p in model.named_parameters() if n.endswith(("k_proj.weight", "v_proj.weight"))]
    if not named:
        named = list(model.named_parameters())[:4]
    picked = named[:2] + named[-2:]
    h = hashlib.sha256()
    for name, p in picked:
        h.update(name.encode())
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def fingerprint_model(model: Any, tokenizer: Any) -> ModelFingerprint:
    """Compute the fingerprint of a loaded HF causal LM."""
    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n_layers = int(cfg.num_hidden_layers)
    n_heads = int(cfg.num_attention_heads)
    n_kv = int(getattr(cfg, "num_key_value_heads", None) or n_heads)
    head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads)
    rope = getattr(cfg, "rope_parameters", None) or {
        "rope_theta": getattr(cfg, "rope_theta", None),
        "rope_scaling": getattr(cfg, "rope_scaling", None),
    }
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    return ModelFingerprint(
        architecture=str(cfg.model_type),
        num_layers=n_layers,
        num_kv_heads=n_kv,
        head_dims=tuple([head_dim] * n_layers),
        rope=json.dumps(rope, sort_keys=True, default=str),
        tokenizer_sha256=_hash_tokenizer(tokenizer),
        weights_sha256=_hash_weights(model),
        dtype=dtype,
    )
