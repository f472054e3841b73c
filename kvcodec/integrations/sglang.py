"""kvcodec as an SGLang HiCache storage backend: HiCache's L3 pages stored as `.kvc` entries of a kvcodec store.

Loaded by SGLang's ``dynamic`` backend (``sglang/srt/mem_cache/storage/backend_factory.py``)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvcodec",
            "module_path": "kvcodec.integrations.sglang", "class_name": "KvcodecHiCacheStorage",
            "store_url": "/var/cache/kvc", "namespace": "default", "model": "MODEL_DIR"}'

Options (the same extra-config dict): ``store_url`` (any kvcodec store URL: directory, ``redis://``, ``s3://``,
``kvc+http://``...), ``namespace``, ``key_file`` (the store's tenant key), ``model`` (the kvcodec model, a shipped name
or the HF directory SGLang serves; default: SGLang's ``model_name``), ``preset`` (a lossless preset:
``lossless`` default, ``zstd``, ``fp16``, ``raw``), ``verify``.

What it implements of ``HiCacheStorage``: ``get``, ``batch_get``, ``set``, ``batch_set``, ``exists`` and
``batch_exists`` (the page-copy interface: HiCache hands each page as one flat tensor of the host pool's
dtype). The zero-copy ``*_v1`` / ``*_v2`` calls are not implemented (SGLang then uses the page-copy ones).

Why lossless only, and why no MLA or split heads: a flat page's element order is the host pool's (layer-first or
page-first, K and V planes), which only a GPU run of SGLang shows. A lossless preset round-trips any order bit for
bit, so pages are encoded as ``[2, layers, tokens, heads*head_dim]`` whatever they hold; a lossy preset would
quantize in the wrong basis if the order differed, so it is refused at configuration until the GPU check
(benchmarks/gpu_check.py, its SGLang step) has confirmed the order. An MLA page or a tensor-parallel shard of heads
does not fit the model's fingerprint shape and is refused at configuration too.

Importing this module needs no SGLang: the class derives from SGLang's ``HiCacheStorage`` when SGLang is
installed, else from ``object`` (the tests run it against SGLang's own ABC where SGLang installs).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Any, Mapping

import torch

import kvcodec
from kvcodec.core.dtypes import tensor_dtype
from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcModelMismatchError
from kvcodec.integrations.buffers import check_buffer

try:  # pragma: no cover - depends on the venv
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage as _Base
except ImportError:  # SGLang is GPU-gated; the backend is importable (and testable) without it
    _Base = object  # type: ignore[assignment,misc]

log = logging.getLogger("kvcodec.integrations.sglang")
LOSSLESS = ("lossless", "zstd", "fp16", "raw")
_OPTIONS = frozenset({"backend_name", "module_path", "class_name", "store_url", "namespace", "key_file", "model",
                      "preset", "verify", "memory_bytes"})


class KvcodecHiCacheStorage(_Base):  # type: ignore[misc,valid-type]
    """SGLang ``HiCacheStorage`` over a kvcodec :class:`~kvcodec.store.Store`: one `.kvc` entry per page."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        from kvcodec.models.fingerprint import fingerprint_dir
        from kvcodec.models.load import resolve_model_dir
        from kvcodec.store import Store, TenantKey
        from kvcodec.store.keys import codec_key

        extra = getattr(storage_config, "extra_config", None) or {}
        if not isinstance(extra, Mapping):  # a JSON string left unparsed: dict() escaped as ValueError
            raise KvcInputError(f"kvcodec HiCache backend: the extra config must be an object, got {type(extra).__name__}")
        extra = dict(extra)
        unknown = set(extra) - _OPTIONS
        if unknown:
            raise KvcInputError(f"kvcodec HiCache backend: unknown option(s) {sorted(unknown)} (known: {sorted(_OPTIONS)})")
        if getattr(storage_config, "is_mla_model", False):
            raise KvcInputError("kvcodec HiCache backend: MLA models are not supported (their pages hold one latent plane)")
        tp = {f: _count(storage_config, f, d) for f, d in (("tp_size", 1), ("pp_size", 1), ("tp_rank", 0), ("pp_rank", 0))}
        if tp["tp_size"] > 1 or tp["pp_size"] > 1:
            raise KvcInputError("kvcodec HiCache backend: tensor/pipeline-parallel shards are not supported (tp_size and "
                                "pp_size must be 1: a shard's page holds part of the model's heads or layers)")
        self.preset = str(extra.get("preset", "lossless"))
        if self.preset not in LOSSLESS:
            raise KvcInputError(f"kvcodec HiCache backend: preset must be lossless ({', '.join(LOSSLESS)}), got "
                                f"{self.preset!r}: a flat page's element order is unconfirmed on CPU")
        self.verify = str(extra.get("verify", "file"))
        if self.verify not in ("file", "off"):
            raise KvcInputError("kvcodec HiCache backend: verify must be \"file\" or \"off\"")
        url = extra.get("store_url")
        if not isinstance(url, str) or not url:
            raise KvcInputError("kvcodec HiCache backend: store_url is required in the extra config")
        model = extra.get("model") or getattr(storage_config, "model_name", None)
        if not isinstance(model, str) or not model:
            raise KvcInputError("kvcodec HiCache backend: give model (a shipped model name or the served HF directory)")
        self.fp = fingerprint_dir(resolve_model_dir(model))
        if len(set(self.fp.head_dims)) != 1:
            raise KvcInputError(f"kvcodec HiCache backend: model {model} has layers of different head sizes")
        from kvcodec.store.keys import check_id

        self.namespace = check_id("namespace", extra.get("namespace", "default"))  # a null or a number too, now
        self.codec = codec_key(self.preset)
        key = TenantKey.load(extra["key_file"]) if extra.get("key_file") else None
        self.store = Store.open(url, key=key, memory_bytes=extra.get("memory_bytes"))
        self.rank = f"tp{tp['tp_rank']}-pp{tp['pp_rank']}"

    # -- keys and pages ---------------------------------------------------------------------------------------
    def _key(self, key: str) -> Any:
        from kvcodec.store import StoreKey

        d = hashlib.sha256(f"sglang-hicache\0{self.fp.id}\0{self.rank}\0".encode() + _key_bytes(key)).hexdigest()
        return StoreKey(_store_id(self.fp.architecture), self.codec, self.namespace, 0, d)

    def _page(self, flat: torch.Tensor) -> tuple[int, int, int]:
        """(layers, tokens, width) of a flat page of this model, or one KvcInputError line."""
        fp = self.fp
        width = fp.num_kv_heads * fp.head_dims[0]
        per_token = 2 * fp.num_layers * width
        n = int(flat.numel())
        if n == 0 or n % per_token:
            raise KvcInputError(f"kvcodec HiCache backend: a page of {n} elements is not whole tokens of this model "
                                f"({per_token} per token)")
        return fp.num_layers, n // per_token, width

    def _encode(self, key: str, value: torch.Tensor) -> bytes:
        from kvcodec.core.kvcache import KVCache

        import numpy as np

        lay = self._page(check_buffer(value, "kvcodec HiCache backend: the page to store", write=False))
        fp = self.fp
        h, d = fp.num_kv_heads, fp.head_dims[0]
        t = value.detach().to("cpu").contiguous().reshape(2, lay[0], lay[1], lay[2])
        ks = [t[0, i].reshape(lay[1], h, d).transpose(0, 1).contiguous() for i in range(lay[0])]
        vs = [t[1, i].reshape(lay[1], h, d).transpose(0, 1).contiguous() for i in range(lay[0])]
        cache = KVCache(ks, vs, np.zeros(lay[1], dtype=np.int64), fp, None,
                        {"source": "sglang", "page_key": hashlib.sha256(_key_bytes(key)).hexdigest(), "rank": self.rank})
        enc = kvcodec.encode(cache, None, preset=self.preset, verify=self.verify)
        assert enc.data is not None
        return enc.data

    def _decode(self, key: str, data: bytes, out: torch.Tensor) -> None:
        lay = self._page(check_buffer(out, "kvcodec HiCache backend: the target page"))
        try:
            view = out.view(2, lay[0], lay[1], lay[2])
        except RuntimeError:  # strides no view of the page's planes fits: one line, not a traceback out of get
            raise KvcInputError(f"kvcodec HiCache backend: the target page (strides {tuple(out.stride())}) cannot be "
                                "viewed as its K and V planes") from None
        # the page bounds what the entry may declare (its values as float32, as the reader counts them): the
        # reader's ratio to the file's size refused a lossless page of zeros (a miss for ever)
        with kvcodec.open(data, max_decoded_bytes=int(out.numel()) * 4, max_decoded_ratio=0) as r:
            if not self.fp.same_model(r.fingerprint):
                raise KvcModelMismatchError(f"page written for model {r.fingerprint.id}, this model is {self.fp.id}")
            meta = r.header.meta if isinstance(r.header.meta, dict) else {}
            if meta.get("source") != "sglang" or meta.get("page_key") != hashlib.sha256(_key_bytes(key)).hexdigest() \
                    or meta.get("rank") != self.rank:
                raise KvcFormatError("entry was written for another page")
            if int(r.header.num_tokens) != lay[1] or int(r.header.num_layers) != lay[0]:
                raise KvcFormatError(f"entry holds {r.header.num_tokens} tokens, the page {lay[1]}")
            if r.header.dtype != tensor_dtype(out):  # another pool's dtype: cast, bf16 past 65504 was inf in fp16
                raise KvcFormatError(f"entry holds {r.header.dtype} values, the page is {tensor_dtype(out)}")
            for i, k, v in r.iter_layers():
                view[0, i].copy_(k.transpose(0, 1).reshape(lay[1], lay[2]))
                view[1, i].copy_(v.transpose(0, 1).reshape(lay[1], lay[2]))

    # -- HiCacheStorage ---------------------------------------------------------------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        """Fill ``target_location`` (a flat page) from the store; None on a miss or an unusable entry."""
        if target_location is None:
            log.warning("kvcodec HiCache backend: get without a target page is not supported")
            return None
        try:
            data = self.store.get(self._key(key))
            if data is None:
                return None
            self._decode(key, data, target_location)
            return target_location
        except KvcError as e:
            log.warning("kvcodec HiCache backend: page %s is a miss: %s", str(key)[:16], e)
            return None

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> list[torch.Tensor | None]:
        keys = _keys(keys)
        locs = _pages(target_locations, len(keys), "target_locations")
        if len(locs) != len(keys):  # zip() cut the answer short: SGLang reads one result per key
            log.warning("kvcodec HiCache backend: batch_get of %d keys with %d target pages", len(keys), len(locs))
            return [None] * len(keys)
        return [self.get(k, t) for k, t in zip(keys, locs)]

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        """Store one flat page; False (logged) on anything the store or the codec refuses."""
        page = value if value is not None else target_location
        if not isinstance(page, torch.Tensor):
            return False
        try:
            sk = self._key(key)
            if self.store.contains(sk):
                return True
            return bool(self.store.put(sk, self._encode(key, page), {"sglang": "page"}).ok)
        except KvcError as e:
            log.warning("kvcodec HiCache backend: page %s not stored: %s", str(key)[:16], e)
            return False

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None, target_sizes: Any = None) -> bool:
        keys = _keys(keys)
        vals = values if values is not None else target_locations
        if vals is None:
            return False
        vals = _pages(vals, len(keys), "values")
        if len(vals) != len(keys):
            return False
        return all([self.set(k, v) for k, v in zip(keys, vals)])  # every page is tried, as HiCacheFile does not

    def exists(self, key: str) -> bool:
        try:
            return bool(self.store.contains(self._key(key)))
        except KvcError:
            return False

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """The number of leading pages found (SGLang's prefix semantics), in one store round trip."""
        keys = _keys(keys)
        try:
            found = self.store.contains_many([self._key(k) for k in keys])
        except KvcError:
            return 0
        for i, f in enumerate(found):
            if not f:
                return i
        return len(keys)

    def clear(self) -> None:
        return None  # a shared store is never wiped by one engine

    def get_stats(self) -> dict[str, Any]:
        return {"hits": self.store.hits, "misses": self.store.misses, "store": self.store.url}

    def close(self) -> None:
        self.store.close()


def _count(cfg: Any, field: str, default: int) -> int:
    """A shard count or rank of SGLang's storage config: an integer >= 0 (int('x') escaped as ValueError; a rank
    like '0/..' went into every key's digest)."""
    v = getattr(cfg, field, default)
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise KvcInputError(f"kvcodec HiCache backend: {field} must be an integer >= 0, got {v!r}")
    return v


def _keys(keys: Any) -> list[Any]:
    """A batch's keys: a list or tuple (a str was iterated as one-character keys, one answer per character; None
    escaped as TypeError)."""
    if not isinstance(keys, (list, tuple)):
        raise KvcInputError(f"kvcodec HiCache backend: a batch's keys must be a list, got {type(keys).__name__}")
    return list(keys)


def _pages(pages: Any, n: int, what: str) -> list[Any]:
    """A batch's pages: a list, a tuple, a tensor of one page per row (its rows: views, written in place), or None
    (no page for any key). A tensor's truth value escaped as RuntimeError, a generator's len() as TypeError."""
    if pages is None:
        return [None] * n
    if isinstance(pages, torch.Tensor) and pages.dim() >= 1:
        return list(pages.unbind(0))
    if not isinstance(pages, (list, tuple)):
        raise KvcInputError(f"kvcodec HiCache backend: {what} must be a list of pages, got {type(pages).__name__}")
    return list(pages)


def _key_bytes(key: Any) -> bytes:
    """A page key's bytes, or one KvcInputError line: SGLang's keys are hex strings, but a bytes or None key (an
    AttributeError) or a lone surrogate (a UnicodeEncodeError) escaped every call as a traceback before."""
    if not isinstance(key, str):
        raise KvcInputError(f"kvcodec HiCache backend: a page key must be a string, got {type(key).__name__}")
    return key.encode("utf-8", "surrogatepass")


def _store_id(name: str) -> str:
    import re

    s = re.sub(r"[^A-Za-z0-9._+=-]", "-", name).lstrip("._+=-")[:100]
    return s or "model"
