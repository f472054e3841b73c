"""The in-memory KV cache and its raw on-disk forms (HDF5, safetensors).

A :class:`KVCache` holds, per layer, keys and values shaped
``(kv_heads, tokens, head_dim)`` (batch 1, post-RoPE, as the model stored
them), the token ids of the context they encode, the model fingerprint, and
optionally the original positions of the stored tokens (pruned caches keep
fewer tokens than the context had).

Layers may hold different token counts (the *ragged* layout, spec/kvc-v1.md
§4.2): a sliding-window layer keeps only the last tokens the model can still
attend to. Layer ``i`` holds the *last* ``layer_tokens[i]`` of the
``num_tokens`` tokens (its stored token ``t`` is token ``num_tokens -
layer_tokens[i] + t`` of the sequence). Only unpruned caches are ragged.

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

from kvcodec.atomic import atomic_path, atomic_write_bytes, io_error_in  # noqa: F401  (atomic_write_bytes: kvc store get -o)
from kvcodec.errors import KvcFormatError, KvcInputError, json_loads
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.limits import SPARSE_FLOOR as _SPARSE_FLOOR, SPARSE_RATIO

H5_FORMAT = "kvcodec-capture"
H5_VERSION = 1
_DTYPES = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16}



@dataclass(frozen=True)
class AttentionScores:
    """Per (layer, token) mean ``a^2`` of a context's last ``window`` queries (all query heads), measured
    during the very prefill that produced a cache (:func:`kvcodec.models.capture.capture`).

    Why it rides on the cache: the encoder's token importance (tokenscale, rate control) needs these
    attention weights, and recomputing them after the fact is a second forward pass (a whole prefill
    for a model with sliding-window layers, whose cache dropped the keys those queries read). Observed
    during capture they cost a few percent of the prefill. ``window`` None: every query.
    """

    window: int | None
    scores: np.ndarray  # [layers, context tokens] float64


@dataclass
class KVCache:
    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    token_ids: np.ndarray
    fingerprint: ModelFingerprint
    positions: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # token importance observed at capture (AttentionScores); kept by the raw capture files (HDF5, safetensors:
    # `kvc capture` then `kvc encode` is one forward pass), never by a .kvc; dropped by every derived cache whose
    # tokens differ (prefix, pruning); an unpruned cache's only
    attention: AttentionScores | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        self.token_ids = as_token_ids(self.token_ids, "token ids", KvcFormatError)
        self.validate()

    # -- shape facts -------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        """Tokens of the sequence the tensors store: the context's (fewer if pruned). A sliding-window
        layer keeps only the last ``layer_tokens[i]`` of them."""
        return self.num_context_tokens if self.positions is None else int(self.keys[0].shape[1])

    @property
    def layer_tokens(self) -> tuple[int, ...]:
        """Tokens each layer stores (its last ones of the ``num_tokens``; fewer for sliding-window layers)."""
        return tuple(int(k.shape[1]) for k in self.keys)

    @property
    def ragged(self) -> bool:
        """True when some layer stores fewer tokens than ``num_tokens`` (spec/kvc-v1.md §4.2)."""
        return min(self.layer_tokens) != self.num_tokens

    def layer_offset(self, layer: int) -> int:
        """Index, among the ``num_tokens`` stored tokens, of layer ``layer``'s first stored token."""
        return self.num_tokens - int(self.keys[layer].shape[1])

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
        if not isinstance(fp, ModelFingerprint):  # None escaped as AttributeError
            raise KvcFormatError(f"the cache's fingerprint must be a ModelFingerprint, got {type(fp).__name__}")
        for name, xs in (("key", self.keys), ("value", self.values)):
            if not isinstance(xs, (list, tuple)):
                raise KvcFormatError(f"the cache's {name}s must be a list of tensors, got {type(xs).__name__}")
            for i, x in enumerate(xs):  # numpy arrays escaped as AttributeError, meta tensors as NotImplementedError
                if not isinstance(x, torch.Tensor) or x.device.type == "meta":
                    raise KvcFormatError(f"layer {i} {name} must be a torch.Tensor holding data, got "
                                         f"{'a meta tensor' if isinstance(x, torch.Tensor) else type(x).__name__}")
        if len(self.keys) != fp.num_layers or len(self.values) != fp.num_layers:
            raise KvcFormatError(f"cache has {len(self.keys)} key / {len(self.values)} value layers, model has {fp.num_layers}")
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            t = int(k.shape[1]) if k.dim() == 3 else -1
            want = (fp.num_kv_heads, t, fp.head_dims[i])
            for name, x in (("key", k), ("value", v)):
                if tuple(x.shape) != want:
                    raise KvcFormatError(f"layer {i} {name} has shape {tuple(x.shape)}, expected {want}")
                if x.dtype not in _DTYPES.values():
                    raise KvcFormatError(f"layer {i} {name} has unsupported dtype {x.dtype}")
            if t <= 0:
                raise KvcFormatError(f"layer {i} holds no tokens")
            if k.dtype != self.keys[0].dtype or v.dtype != self.keys[0].dtype:
                raise KvcFormatError(f"layer {i} has dtype {k.dtype}/{v.dtype}, layer 0 {self.keys[0].dtype}")
        t = self.num_tokens
        if self.positions is None and max(self.layer_tokens) > t:
            raise KvcFormatError(f"a layer holds {max(self.layer_tokens)} tokens but the cache has only "
                                 f"{self.num_context_tokens} token ids and no positions")
        if self.attention is not None:
            sc = self.attention.scores
            if self.positions is not None or not isinstance(sc, np.ndarray) or sc.shape != (fp.num_layers, self.num_context_tokens):
                raise KvcFormatError(f"attention scores of shape {getattr(sc, 'shape', None)} do not fit this cache "
                                     f"({fp.num_layers} layers x {self.num_context_tokens} context tokens, unpruned)")
        if self.positions is not None:
            if self.ragged:
                raise KvcFormatError("a pruned cache (with positions) must hold the same tokens in every layer")
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

    def prefix(self, n: int) -> "KVCache":
        """The cache of the first ``n`` context tokens of an unpruned cache without sliding-window layers.

        A causal model's KV prefix is the prefix's KV, so full layers are sliced. A ragged cache's
        sliding-window layers dropped tokens the prefix's own window keeps: its prefix needs the model
        (:func:`kvcodec.models.cachelayout.cache_prefix`).
        """
        if self.positions is not None or not 1 <= n <= self.num_tokens:
            raise KvcInputError(f"a prefix of {n} tokens needs an unpruned cache of at least that many")
        if self.ragged:
            raise KvcInputError("the prefix of a cache with sliding-window layers needs the model (their earlier tokens "
                                "were dropped)")
        return KVCache([k[:, :n].contiguous() for k in self.keys], [v[:, :n].contiguous() for v in self.values],
                       self.token_ids[:n], self.fingerprint, None, dict(self.meta))

    def to(self, dtype: torch.dtype) -> "KVCache":
        return KVCache(
            [k.to(dtype) for k in self.keys], [v.to(dtype) for v in self.values],
            self.token_ids, self.fingerprint, self.positions, dict(self.meta), self.attention,
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
        if cache.attention is not None:
            f.attrs["attention_window"] = _window_code(cache.attention.window)
            f.create_dataset("attention_scores", data=np.asarray(cache.attention.scores, dtype=np.float64))
        grp = f.create_group("layers")
        for i, (k, v) in enumerate(zip(cache.keys, cache.values)):
            g = grp.create_group(str(i))
            g.create_dataset("key", data=_to_numpy(k))
            g.create_dataset("value", data=_to_numpy(v))


def _window_code(window: int | None) -> int:
    """A capture file's ``attention_window``: the observed window, 0 for every query (None)."""
    return 0 if window is None else int(window)


def _attention_from(path: Path, window: Any, scores: np.ndarray | None) -> AttentionScores | None:
    """The token importance a capture file carries (optional: files before it, and pruned caches, have none).

    It only steers where the encoder spends bits, but a file is untrusted: anything but finite, non-negative
    float scores with a window code that is a non-negative integer is refused in one line."""
    if scores is None:
        return None
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or not 0 <= int(window) < 1 << 31:
        raise KvcFormatError(f"{path}: attention scores without a valid attention_window ({window!r:.40})")
    if scores.dtype.kind != "f":
        raise KvcFormatError(f"{path}: attention scores must be floats, got {scores.dtype}")
    scores = np.asarray(scores, dtype=np.float64)
    # a mean of squared attention weights lies in [0, 1] (the slack: float32 softmax rounding); 1e308 each passed
    # the finite check and overflowed every sum the importance takes (numpy warnings, inf/NaN importance)
    if not np.isfinite(scores).all() or (scores < 0).any() or (scores > 1 + 1e-3).any():
        raise KvcFormatError(f"{path}: attention scores must be finite and in [0, 1] (mean squared attention weights)")
    return AttentionScores(int(window) or None, scores)


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


# -- loading untrusted captures ----------------------------------------------
# A capture declares its tensors' shapes before any data; everything below checks
# those declarations (against the fingerprint, each other, the per-file limit
# and the bytes really stored) before a single tensor is allocated.
# A dataset / file may declare at most SPARSE_RATIO bytes per byte it really stores, once it declares more than
# _SPARSE_FLOOR (imported above): the one rule of kvcodec.limits.check_not_sparse, which .kvc sources apply too.


@dataclass(frozen=True)
class _Layout:
    """The validated declarations of a capture: what will be allocated, checked before it is."""

    fingerprint: ModelFingerprint
    dtype_name: str
    tokens: int
    n_context: int


def _fingerprint(text: Any, path: Path) -> ModelFingerprint:
    from kvcodec.core.fingerprint import FINGERPRINT_VERSION, check_fingerprint_json

    if isinstance(text, bytes):
        text = text.decode("utf-8", "strict")
    if not isinstance(text, str):
        raise KvcFormatError(f"{path}: fingerprint attribute is not a string")
    try:
        obj = json_loads(text)
    except ValueError as exc:
        raise KvcFormatError(f"{path}: fingerprint is not JSON ({str(exc)[:80]})") from None
    try:
        check_fingerprint_json(obj, FINGERPRINT_VERSION)
    except KvcFormatError as exc:
        raise KvcFormatError(f"{path}: {str(exc).removeprefix('header: ')}") from None
    return ModelFingerprint.from_json(obj)


def _check_layout(path: Path, fp: ModelFingerprint, dtype_name: str, shapes: dict[str, tuple[int, ...]],
                  itemsizes: dict[str, int], limit: int) -> _Layout:
    """Check every declared shape of a capture (names as in the safetensors layout) before reading data."""
    if dtype_name not in _DTYPES:
        raise KvcFormatError(f"{path}: unsupported dtype {dtype_name!r}")
    ids = shapes.get("token_ids")
    if ids is None or len(ids) != 1:
        raise KvcFormatError(f"{path}: token_ids must be a 1-D dataset")
    n_ctx = ids[0]
    k0 = shapes.get("layers.0.key")
    if k0 is None or len(k0) != 3:
        raise KvcFormatError(f"{path}: layer 0 key must be a (kv_heads, tokens, head_dim) dataset")
    pos = shapes.get("positions")
    T = k0[1] if pos is not None else n_ctx  # unpruned: a sliding-window layer may keep only its last tokens
    for i in range(fp.num_layers):
        k = shapes.get(f"layers.{i}.key")
        t_i = k[1] if k is not None and len(k) == 3 and 1 <= k[1] <= T and pos is None else T
        want = (fp.num_kv_heads, t_i, fp.head_dims[i])
        for kind in ("key", "value"):
            got = shapes.get(f"layers.{i}.{kind}")
            if got is None:
                raise KvcFormatError(f"{path}: layer {i} is missing its {kind} dataset")
            if tuple(got) != want:
                raise KvcFormatError(f"{path}: layer {i} {kind} has shape {tuple(got)}, expected {want}")
    if T <= 0:
        raise KvcFormatError(f"{path}: cache holds no tokens")
    att = shapes.get("attention_scores")
    if att is not None and (pos is not None or tuple(att) != (fp.num_layers, n_ctx)):
        raise KvcFormatError(f"{path}: attention scores have shape {tuple(att)}, expected ({fp.num_layers}, {n_ctx}) "
                             "on an unpruned capture")
    if pos is not None and tuple(pos) not in ((T,), (fp.num_layers, fp.num_kv_heads, T)):
        raise KvcFormatError(f"{path}: positions have shape {tuple(pos)}, expected ({T},) or "
                             f"({fp.num_layers}, {fp.num_kv_heads}, {T})")
    total = sum(int(np.prod(shp, dtype=object)) * itemsizes[name] for name, shp in shapes.items())
    if total > limit:
        from kvcodec.limits import MAX_DECODED_ENV

        raise KvcFormatError(f"{path}: capture declares {total:,} bytes of tensors, over the limit of {limit:,} "
                             f"(raise ${MAX_DECODED_ENV} to read it)")
    return _Layout(fp, dtype_name, T, n_ctx)


def _check_not_sparse(path: Path, declared: int, stored: int, what: str) -> None:
    if declared > _SPARSE_FLOOR and stored * SPARSE_RATIO < declared:
        raise KvcFormatError(f"{path}: {what} declares {declared:,} bytes but stores only {stored:,} "
                             f"(a sparse or bomb-like capture; at most {SPARSE_RATIO}x is accepted)")


def _cache_from(layout: _Layout, arrays: dict[str, np.ndarray], meta: Any, path: Path,
                attention_window: Any = None) -> KVCache:
    if not isinstance(meta, dict):
        raise KvcFormatError(f"{path}: meta must be a JSON object")
    ids = arrays["token_ids"]
    if ids.dtype.kind not in "iu":
        raise KvcFormatError(f"{path}: token_ids must be integers, got {ids.dtype}")
    pos = arrays.get("positions")
    if pos is not None and pos.dtype.kind not in "iu":
        raise KvcFormatError(f"{path}: positions must be integers, got {pos.dtype}")
    fp = layout.fingerprint
    keys = [_from_numpy(arrays[f"layers.{i}.key"], layout.dtype_name) for i in range(fp.num_layers)]
    values = [_from_numpy(arrays[f"layers.{i}.value"], layout.dtype_name) for i in range(fp.num_layers)]
    # the scores' shape was checked against the declared layout (_check_layout); the constructor validates once
    return KVCache(keys, values, ids, fp, pos, meta, _attention_from(path, attention_window, arrays.get("attention_scores")))


def load_h5(path: str | os.PathLike, max_decoded_bytes: int | None = None) -> KVCache:
    """Read a capture; every structural problem is a KvcFormatError, nothing is allocated before it is checked.

    The HDF5 library runs in a sandbox process (:mod:`kvcodec.h5sandbox`): on
    corrupt metadata it can crash, which must not take kvcodec down. Only
    regular files are opened; the declared shapes, the per-file limit and the
    ratio of declared to stored bytes are checked before any data is read.
    """
    from kvcodec.h5sandbox import H5Sandbox
    from kvcodec.limits import max_decoded_bytes as limit_of

    path = Path(path)
    limit = limit_of(max_decoded_bytes)
    with H5Sandbox(path) as h5:
        desc = h5.desc
        attrs = desc.get("attrs") or {}
        if attrs.get("format") != H5_FORMAT:
            raise KvcFormatError(f"{path}: not a kvcodec capture (format attribute missing)")
        if attrs.get("format_version") != H5_VERSION:
            raise KvcFormatError(f"{path}: unsupported capture version {attrs.get('format_version')!r:.40}")
        fp = _fingerprint(attrs.get("fingerprint"), path)
        try:
            meta = json_loads(attrs.get("meta") or "{}")
        except ValueError:
            raise KvcFormatError(f"{path}: meta attribute is not JSON") from None
        dtype_name = attrs.get("dtype")
        if not isinstance(dtype_name, str):
            raise KvcFormatError(f"{path}: dtype attribute is not a string")
        if desc.get("n_layers") != fp.num_layers:
            raise KvcFormatError(f"{path}: expected {fp.num_layers} layer groups")
        sets = desc.get("datasets") or {}
        dtypes: dict[str, np.dtype] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for name, d in sets.items():
            kinds = "iu" if name in ("token_ids", "positions") else "uf"
            if d.get("error") or d.get("dtype") is None or np.dtype(d["dtype"]).kind not in kinds:
                raise KvcFormatError(f"{path}: dataset {name!r} is not a {'integer' if kinds == 'iu' else 'float'} array")
            dtypes[name] = np.dtype(d["dtype"])
            shapes[name] = tuple(int(x) for x in d["shape"])
        layout = _check_layout(path, fp, dtype_name, shapes, {n: dt.itemsize for n, dt in dtypes.items()}, limit)
        for name, d in sets.items():
            declared = int(np.prod(shapes[name], dtype=object)) * dtypes[name].itemsize
            _check_not_sparse(path, declared, int(d.get("storage", 0)), f"dataset {name!r}")
        arrays = h5.fetch({name: (dtypes[name], shapes[name]) for name in sets})
    return _cache_from(layout, arrays, meta, path, attrs.get("attention_window"))


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
    if cache.attention is not None:
        tensors["attention_scores"] = torch.from_numpy(np.asarray(cache.attention.scores, dtype=np.float64))
        meta["attention_window"] = str(_window_code(cache.attention.window))
    with atomic_path(path) as tmp:
        mode = os.stat(tmp).st_mode & 0o777  # 0666 & ~umask, as atomic_path made it
        try:
            save_file(tensors, str(tmp), metadata=meta)
        except SafetensorError as exc:  # its I/O errors (disk full, ...) are not OSErrors
            raise io_error_in(exc, f"cannot write {path}") from None
        os.chmod(tmp, mode)  # safetensors re-creates the file 0600: a capture was unreadable to the group, unlike an .h5


_ST_DTYPES = {"F16": ("float16", 2), "F32": ("float32", 4), "BF16": ("bfloat16", 2), "I32": ("int32", 4),
              "I64": ("int64", 8), "U16": ("uint16", 2), "F64": ("float64", 8)}
_ST_MAX_HEADER = 100 << 20  # the safetensors format's own header limit


def load_safetensors(path: str | os.PathLike, max_decoded_bytes: int | None = None) -> KVCache:
    """Read a safetensors capture without memory-mapping it (a file shrinking under a map is a SIGBUS).

    The header (tensor names, dtypes, shapes, offsets) is checked against the
    fingerprint, the file's real size, the per-file limit and the bytes the
    file really occupies on disk before the data is read with positional reads;
    the ``safetensors`` library then builds the tensors from those bytes.
    """
    from safetensors.torch import load as st_load

    from kvcodec.errors import KvcError
    from kvcodec.limits import check_not_sparse, max_decoded_bytes as limit_of, open_regular

    path = Path(path)
    limit = limit_of(max_decoded_bytes)
    fd = open_regular(path, "a capture")
    try:
        st = os.fstat(fd)
        size = st.st_size
        head = _pread_exact(fd, 0, 8, path, size) if size >= 8 else b""
        if len(head) != 8:
            raise KvcFormatError(f"{path}: too short for a safetensors file")
        n = int.from_bytes(head, "little")
        if n > _ST_MAX_HEADER or 8 + n > size:
            raise KvcFormatError(f"{path}: safetensors header of {n} bytes does not fit in the {size}-byte file")
        try:
            hdr = json_loads(_pread_exact(fd, 8, n, path, size).decode("utf-8"))
        except ValueError as exc:
            raise KvcFormatError(f"{path}: safetensors header is not UTF-8 JSON ({str(exc)[:80]})") from None
        if not isinstance(hdr, dict):
            raise KvcFormatError(f"{path}: safetensors header is not an object")
        md = hdr.get("__metadata__") or {}
        if not isinstance(md, dict) or md.get("format") != H5_FORMAT:
            raise KvcFormatError(f"{path}: not a kvcodec capture")
        fp = _fingerprint(md.get("fingerprint"), path)
        shapes: dict[str, tuple[int, ...]] = {}
        itemsizes: dict[str, int] = {}
        kinds: dict[str, str] = {}
        for name, info in hdr.items():
            if name == "__metadata__":
                continue
            if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
                raise KvcFormatError(f"{path}: tensor {name!r:.60} has an unsupported dtype")
            shp = info.get("shape")
            if not isinstance(shp, list) or len(shp) > 4 or not all(type(d) is int and 0 <= d < 1 << 40 for d in shp):
                raise KvcFormatError(f"{path}: tensor {name!r:.60} has a bad shape")
            shapes[name] = tuple(shp)
            kinds[name], itemsizes[name] = _ST_DTYPES[info["dtype"]]
        dtype_name = kinds.get("layers.0.key", "")
        layout = _check_layout(path, fp, dtype_name, shapes, itemsizes, limit)
        check_not_sparse(st, str(path), "a capture")
        data = _pread_exact(fd, 0, size, path, size)
    finally:
        os.close(fd)
    try:
        tensors = st_load(data)  # validates offsets / sizes against the buffer itself
    except Exception as exc:  # safetensors raises its own error types for bad headers
        raise KvcFormatError(f"{path}: malformed safetensors capture ({str(exc)[:160]})") from None
    del data
    try:
        meta = json_loads(md.get("meta", "{}"))
    except (TypeError, ValueError):
        raise KvcFormatError(f"{path}: meta is not JSON") from None
    arrays: dict[str, np.ndarray] = {}
    for name, t in tensors.items():
        arrays[name] = t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    window = md.get("attention_window")
    if "attention_scores" in arrays:
        window = int(window) if isinstance(window, str) and window.isdigit() and len(window) <= 10 else window
    try:
        return _cache_from(layout, arrays, meta, path, window)
    except KvcError:
        raise
    except (KeyError, ValueError, TypeError) as exc:
        raise KvcFormatError(f"{path}: malformed safetensors capture ({str(exc)[:160]})") from None


def _pread_exact(fd: int, offset: int, length: int, path: Path, size: int) -> bytes:
    parts: list[bytes] = []
    got = 0
    while got < length:
        b = os.pread(fd, min(length - got, 1 << 30), offset + got)
        if not b:
            raise KvcFormatError(f"{path}: short read at offset {offset + got} (the file shrank below {size} bytes)")
        parts.append(b)
        got += len(b)
    return b"".join(parts)


def load_capture(path: str | os.PathLike) -> KVCache:
    """Load a raw capture by extension (.h5/.hdf5 or .safetensors)."""
    p = Path(path)
    return load_safetensors(p) if p.suffix.lower() == ".safetensors" else load_h5(p)


def as_token_ids(token_ids: Any, what: str = "token ids", error: type[Exception] = KvcInputError,
                 allow_empty: bool = True) -> np.ndarray:
    """``token_ids`` as a flat int64 array, or one ``error`` line: the one check of ids a caller hands in (a cache,
    a capture, a reader's expected ids). ``"abc"``, a dict and 2**70 escaped as ValueError / TypeError /
    OverflowError, floats (100.0) were truncated to ids, and uint64 ids past 2**63 wrapped to negative ones."""
    try:
        arr = np.asarray(token_ids)
    except (ValueError, TypeError, OverflowError):
        arr = None
    bad = arr is None or ((arr.size or not allow_empty) and arr.dtype.kind not in "iu")
    if not bad and arr is not None and arr.size and arr.dtype.kind == "u" and int(arr.max()) >= 1 << 63:
        bad = True
    if bad:
        raise error(f"{what} must be integers, got {type(token_ids).__name__}"
                    f"{'' if arr is None else ' of ' + str(arr.dtype)}")
    assert arr is not None
    return arr.astype(np.int64).reshape(-1)


CAPTURE_SUFFIXES = (".h5", ".hdf5", ".safetensors")


def capture_path(path: str | os.PathLike) -> Path:
    """``path`` as a capture's output, whose extension says its format: ``.h5`` / ``.hdf5`` (HDF5) or
    ``.safetensors``. Any other is one :class:`KvcInputError` line, checked before the work that writes it: an
    HDF5 file silently written under ``x.kvc`` or ``x.txt`` is read back as neither."""
    p = Path(path)
    if p.suffix.lower() not in CAPTURE_SUFFIXES:
        raise KvcInputError(f"a capture is written as {', '.join(CAPTURE_SUFFIXES)}; {str(p)!r} has none of these "
                            "extensions")
    return p


def save_capture(cache: KVCache, path: str | os.PathLike) -> None:
    """Write a raw capture in the format its extension names (:func:`capture_path`)."""
    p = capture_path(path)
    (save_safetensors if p.suffix.lower() == ".safetensors" else save_h5)(cache, p)
