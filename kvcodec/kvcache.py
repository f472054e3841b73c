"""The in-memory KV cache and its raw on-disk forms (HDF5, safetensors).

A :class:`KVCache` holds, per layer, keys and values shaped
``(kv_heads, tokens, head_dim)`` (batch 1, post-RoPE, as the model stored
them), the token ids of the context they encode, the model fingerprint, and
optionally the original positions of the stored tokens (pruned caches keep
fewer tokens than the context had).

HDF5 layout written by ``kvc capture`` and ``kvc decode`` (format version 1)::

    /                attrs: format="kvcodec-capture", format_version=1,
                            fingerprint=<JSON>, meta=<JSON>, dtype=<name>
    /token_ids       int32 [n_context]
    /positions       int64 [tokens] or [layers, kv_heads, tokens]  (optional)
    /layers/<i>/key  [kv_heads, tokens, head_dim]  float16|float32 (bfloat16 as uint16)
    /layers/<i>/value
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .atomic import atomic_path, atomic_write_bytes, io_error_in  # noqa: F401  (atomic_write_bytes: kvc store get -o)
from .errors import KvcFormatError, KvcInputError
from .fingerprint import ModelFingerprint

H5_FORMAT = "kvcodec-capture"
H5_VERSION = 1
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}



def token_ids_sha256(ids: Any) -> str:
    """sha256 hex of token ids as little-endian int64: the context hash of the .kvc header (spec/kvc-v1.md),
    of pruning records and of capture caches."""
    import hashlib

    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()

@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: np.ndarray
    fingerprint: ModelFingerprint
    positions: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.token_ids = np.asarray(self.token_ids, dtype=np.int64).reshape(-1)
        self.validate()

    # -- shape facts -------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Tokens stored in the tensors (fewer than the context if pruned)."""
        return int(self.keys[0].shape[1])

    @property
    def num_context_tokens(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def next_position(self) -> int:
        """Position id of the first token after the cached context."""
        return self.num_context_tokens

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    @property
    def num_elements(self) -> int:
        return sum(k.numel() + v.numel() for k, v in zip(self.keys, self.values))

    @property
    def nbytes_fp16(self) -> int:
        return self.num_elements * 2

    def validate(self) -> None:
        fp = self.fingerprint
        if len(self.keys) != fp.num_layers or len(self.values) != fp.num_layers:
            raise KvcFormatError(f"cache has {len(self.keys)} key / {len(self.values)} value layers, model has {fp.num_layers}")
        t = int(self.keys[0].shape[1]) if self.keys and self.keys[0].dim() == 3 else -1
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            want = (fp.num_kv_heads, t, fp.head_dims[i])
            for name, x in (("key", k), ("value", v)):
                if tuple(x.shape) != want:
                    raise KvcFormatError(f"layer {i} {name} has shape {tuple(x.shape)}, expected {want}")
                if x.dtype not in _DTYPES.values():
                    raise KvcFormatError(f"layer {i} {name} has unsupported dtype {x.dtype}")
        if t <= 0:
            raise KvcFormatError("cache holds no tokens")
        if self.positions is None and t != self.num_context_tokens:
            raise KvcFormatError(f"cache holds {t} tokens but has {self.num_context_tokens} token ids and no positions")
        if self.positions is not None:
            p = np.asarray(self.positions)
            if p.shape not in ((t,), (fp.num_layers, fp.num_kv_heads, t)):
                raise KvcFormatError(f"positions have shape {p.shape}, expected ({t},) or ({fp.num_layers}, {fp.num_kv_heads}, {t})")
            if p.size and (p.min() < 0 or p.max() >= self.num_context_tokens):
                raise KvcFormatError("positions point outside the context")

    # -- engines -----------------------------------------------------------
    def to_dynamic_cache(self, dtype: torch.dtype | None = None) -> Any:
        """A fresh transformers ``DynamicCache`` (batch 1) holding copies of the tensors."""
        from transformers import DynamicCache

        cast = (lambda x: x.to(dtype)) if dtype is not None else (lambda x: x)
        return DynamicCache([(cast(k).unsqueeze(0).clone(), cast(v).unsqueeze(0).clone()) for k, v in zip(self.keys, self.values)])

    def for_model(self, lm: Any) -> Any:
        """A DynamicCache for ``lm`` (a LoadedModel), refusing a cache of another model."""
        lm.fingerprint.check_compatible(self.fingerprint)
        return self.to_dynamic_cache(dtype=next(lm.model.parameters()).dtype)

    def to(self, dtype: torch.dtype) -> "KVCache":
        return KVCache(
            [k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values],
            self.token_ids, self.fingerprint, self.positions, dict(self.meta),
        )


# -- HDF5 ------------------------------------------------------------------
def save_h5(cache: KVCache, path: str | os.PathLike) -> None:
    """Write ``cache`` as an HDF5 capture, atomically (:mod:`kvcodec.atomic`)."""
    import h5py

    with atomic_path(path) as tmp, h5py.File(tmp, "w") as f:
        f.attrs["format"] = H5_FORMAT
        f.attrs["format_version"] = H5_VERSION
        f.attrs["fingerprint"] = json.dumps(cache.fingerprint.to_json(), sort_keys=True)
        f.attrs["meta"] = json.dumps(cache.meta, sort_keys=True)
        dtype_name = str(cache.dtype).removeprefix("torch.")
        f.attrs["dtype"] = dtype_name
        f.create_dataset("token_ids", data=cache.token_ids.astype(np.int32))
        if cache.positions is not None:
            f.create_dataset("positions", data=np.asarray(cache.positions, dtype=np.int64))
        grp = f.create_group("layers")
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            g = grp.create_group(str(i))
            g.create_dataset("key", data=_to_numpy(k))
            g.create_dataset("value", data=_to_numpy(v))


def _to_numpy(x: torch.Tensor) -> np.ndarray:
    x = x.detach().cpu().contiguous()
    return x.view(torch.uint16).numpy() if x.dtype == torch.bfloat16 else x.numpy()


def _from_numpy(a: np.ndarray, dtype_name: str) -> torch.Tensor:
    if dtype_name == "bfloat16":
        if a.dtype != np.uint16:
            raise KvcFormatError("bfloat16 tensors must be stored as uint16")
        return torch.from_numpy(a.copy()).view(torch.bfloat16)
    if str(a.dtype) != dtype_name:
        raise KvcFormatError(f"tensor dtype {a.dtype} differs from the file's dtype {dtype_name}")
    return torch.from_numpy(a.copy())


def load_h5(path: str | os.PathLike) -> KVCache:
    """Read a capture; every structural problem is a KvcFormatError."""
    import h5py

    path = Path(path)
    if not path.is_file():
        raise KvcInputError(f"no such file: {path}")
    try:
        f = h5py.File(path, "r")
    except OSError as exc:
        raise KvcFormatError(f"{path}: not a readable HDF5 file ({exc})") from None
    try:
        with f:
            if f.attrs.get("format") != H5_FORMAT:
                raise KvcFormatError(f"{path}: not a kvcodec capture (format attribute missing)")
            if int(f.attrs.get("format_version", -1)) != H5_VERSION:
                raise KvcFormatError(f"{path}: unsupported capture version {f.attrs.get('format_version')}")
            fp = ModelFingerprint.from_json(json.loads(f.attrs["fingerprint"]))
            meta = json.loads(f.attrs.get("meta", "{}"))
            dtype_name = str(f.attrs.get("dtype", ""))
            if dtype_name not in _DTYPES:
                raise KvcFormatError(f"{path}: unsupported dtype {dtype_name!r}")
            token_ids = _read_ds(f, "token_ids", max_elems=1 << 24)
            positions = _read_ds(f, "positions", max_elems=1 << 32) if "positions" in f else None
            if "layers" not in f or len(f["layers"]) != fp.num_layers:
                raise KvcFormatError(f"{path}: expected {fp.num_layers} layer groups")
            keys, values = [], []
            for i in range(fp.num_layers):
                g = f["layers"].get(str(i))
                if g is None or "key" not in g or "value" not in g:
                    raise KvcFormatError(f"{path}: layer {i} is missing its key or value dataset")
                keys.append(_from_numpy(_read_ds(g, "key", 1 << 32), dtype_name))
                values.append(_from_numpy(_read_ds(g, "value", 1 << 32), dtype_name))
            return KVCache(keys, values, token_ids, fp, positions, meta)
    except (KeyError, ValueError, TypeError, json.JSONDecodeError) as exc:
        raise KvcFormatError(f"{path}: malformed capture ({exc})") from None


def _read_ds(group: Any, name: str, max_elems: int) -> np.ndarray:
    ds = group[name]
    if not hasattr(ds, "shape") or ds.size > max_elems:
        raise KvcFormatError(f"dataset {name!r} is missing or too large")
    return ds[()]


# -- safetensors -----------------------------------------------------------
def save_safetensors(cache: KVCache, path: str | os.PathLike) -> None:
    """Write ``cache`` as a safetensors capture, atomically (:mod:`kvcodec.atomic`)."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    tensors = {"token_ids": torch.from_numpy(cache.token_ids.astype(np.int32))}
    if cache.positions is not None:
        tensors["positions"] = torch.from_numpy(np.asarray(cache.positions, dtype=np.int64))
    for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
        tensors[f"layers.{i}.key"] = k.contiguous()
        tensors[f"layers.{i}.value"] = v.contiguous()
    meta = {"format": H5_FORMAT, "fingerprint": json.dumps(cache.fingerprint.to_json()), "meta": json.dumps(cache.meta)}
    with atomic_path(path) as tmp:
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except SafetensorError as exc:  # its I/O errors (disk full, ...) are not OSErrors
            raise io_error_in(exc, f"cannot write {path}") from None


def load_safetensors(path: str | os.PathLike) -> KVCache:
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise KvcInputError(f"no such file: {path}")
    try:
        with safe_open(str(path), framework="pt") as f:
            md = f.metadata() or {}
            if md.get("format") != H5_FORMAT:
                raise KvcFormatError(f"{path}: not a kvcodec capture")
            fp = ModelFingerprint.from_json(json.loads(md["fingerprint"]))
            names = set(f.keys())
            keys = [f.get_tensor(f"layers.{i}.key") for i in range(fp.num_layers)]
            values = [f.get_tensor(f"layers.{i}.value") for i in range(fp.num_layers)]
            positions = f.get_tensor("positions").numpy() if "positions" in names else None
            return KVCache(keys, values, f.get_tensor("token_ids").numpy(), fp, positions, json.loads(md.get("meta", "{}")))
    except KvcFormatError:
        raise
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise KvcFormatError(f"{path}: malformed safetensors capture ({exc})") from None


def load_capture(path: str | os.PathLike) -> KVCache:
    """Load a raw capture by extension (.h5/.hdf5 or .safetensors)."""
    p = Path(path)
    return load_safetensors(p) if p.suffix == ".safetensors" else load_h5(p)


def save_capture(cache: KVCache, path: str | os.PathLike) -> None:
    """Write a raw capture by extension (.safetensors, else HDF5)."""
    p = Path(path)
    (save_safetensors if p.suffix == ".safetensors" else save_h5)(cache, p)
