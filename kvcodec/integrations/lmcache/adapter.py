"""An LMCache L2 adapter backed by a kvcodec store URL: several LMCache deployments share one store or KDN.

Loaded by LMCache's plugin adapter (``lmcache/v1/distributed/l2_adapters/plugin_l2_adapter.py``)::

    --l2-adapter '{"type": "plugin", "module_path": "kvcodec.integrations.lmcache.adapter",
                   "class_name": "KvcodecStoreL2Adapter",
                   "adapter_params": {"store_url": "/var/cache/kvc,redis://cache:6379/0",
                                      "namespace": "team-a", "preset": "lossless",
                                      "models": {"HuggingFaceTB/SmolLM2-135M": "smollm2"}}}'

``adapter_params``: ``store_url`` (any :class:`kvcodec.store.Store` URL: a directory, ``redis://``,
``redis+cluster://``, ``s3://``, ``kvc+http://`` (a shared ``kvc serve`` KDN), comma-separated tiers), ``namespace`` (the store keys'
namespace: tenancy as the store has it), ``key_file`` (the tenant key: entries are sealed with it and another
tenant's are refused; default: the store's own default key), ``preset`` / ``overrides`` / ``models`` / ``verify`` / ``rope_offset`` (as the serde,
:mod:`.serde`), ``max_workers`` (I/O and codec threads).

Why encode here and not only in the serde: given LMCache's KV chunks (no ``serde`` on this adapter), each chunk
is stored as a plain `.kvc` entry -- ``kvc store get`` then ``kvc info`` reads it -- and its bytes on the store
are the compressed bytes (LMCache's ``fs`` adapter needs padded objects, :mod:`.serde`). With a ``serde`` dict on
this adapter too, LMCache hands it the serde's bytes, which are stored as they are (``"pad": false`` there).

Loads check every entry (:func:`.chunks.check_entry`): another model's or chunk's entry, a forged or truncated
one, is a miss (its bit stays 0), never decoded into the cache. Locks are no-ops: a store entry is immutable.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Mapping

import torch
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.platform import create_event_notifier

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError
from kvcodec.integrations.buffers import check_buffer
from kvcodec.integrations.lmcache.chunks import key_digest
from kvcodec.integrations.lmcache.serde import KvcodecDeserializer, KvcodecSerializer, ModelResolver, parse_options
from kvcodec.store import Store, StoreKey, TenantKey
from kvcodec.store.keys import check_id, codec_key

log = logging.getLogger("kvcodec.integrations.lmcache")
_PARAMS = frozenset({"store_url", "namespace", "key_file", "preset", "overrides", "models", "verify", "max_workers",
                     "memory_bytes", "rope_offset"})


def store_model_id(model_name: str) -> str:
    """The store key's model field for an LMCache model name (``org/model`` -> ``org--model``): the store keys'
    characters are [A-Za-z0-9._+=-]; the digest binds the exact name anyway."""
    import hashlib
    import re

    s = re.sub(r"[^A-Za-z0-9._+=-]", "-", model_name).lstrip("._+=-")[:100]
    return s or "m-" + hashlib.sha256(model_name.encode()).hexdigest()[:16]


def _paired(keys: Any, objects: Any) -> None:
    """One object per key, or one KvcInputError line (the task then fails as a whole: a store reports failure, a
    load misses every key). Why: zip() cut the longer list short, so a store reported success for fewer chunks
    than asked and a load answered a bitmap shorter than its keys."""
    if len(keys) != len(objects):
        raise KvcInputError(f"kvcodec L2 adapter: {len(keys)} keys with {len(objects)} objects")


def _buffer_size(obj: Any, t: torch.Tensor) -> int:
    """Bytes of the buffer LMCache allocated for a serde's object (its layout's: the serde's estimate), not the used
    part a store narrows it to (``set_used_size``); a stand-in object without layouts: its tensor's."""
    try:
        return int(torch.Size(obj.get_shapes()[0]).numel())
    except (AttributeError, IndexError, TypeError, ValueError):
        return int(t.numel())


class KvcodecStoreL2Adapter(L2AdapterInterface):
    """LMCache ``L2AdapterInterface`` over a kvcodec :class:`~kvcodec.store.Store` (one per adapter)."""

    def __init__(self, params: dict[str, Any] | None = None, l1_memory_desc: Any = None) -> None:
        super().__init__()
        if params is not None and not isinstance(params, Mapping):  # dict() of a JSON string: a ValueError
            raise KvcInputError(f"kvcodec L2 adapter: adapter_params must be an object, got {type(params).__name__}")
        p = dict(params or {})
        extra = set(p) - _PARAMS
        if extra:
            raise KvcInputError(f"kvcodec L2 adapter: unknown adapter_params {sorted(extra)} (known: {sorted(_PARAMS)})")
        url = p.get("store_url")
        if not isinstance(url, str) or not url:
            raise KvcInputError("kvcodec L2 adapter: adapter_params.store_url is required (a kvcodec store URL)")
        self.namespace = check_id("namespace", p.get("namespace", "default"))  # a null or a number too, now
        opts = parse_options({k: p[k] for k in ("preset", "overrides", "models", "verify", "max_workers", "rope_offset")
                              if k in p})
        resolver = ModelResolver(opts["preset"], opts["models"], opts["overrides"])
        for name in resolver.models:  # at configuration: a missing model or calibration is one line now
            resolver.fingerprint(name)
            resolver.calibration(name)
        self._ser = KvcodecSerializer(resolver, pad=False, verify=opts["verify"], rope_offset=opts["rope_offset"])
        self._de = KvcodecDeserializer(resolver)
        self.codec = codec_key(resolver.info.name, resolver.overrides)  # another step is another codec (spec/store-keys.md §1)
        key = TenantKey.load(p["key_file"]) if p.get("key_file") else None
        self.store = Store.open(url, key=key, memory_bytes=p.get("memory_bytes"))
        self._pool = ThreadPoolExecutor(max_workers=opts["max_workers"], thread_name_prefix="kvcodec-l2")
        self._efd = {n: create_event_notifier() for n in ("store", "lookup", "load")}
        self._lock = threading.Lock()
        self._next = 0
        self._done: dict[str, dict[int, Any]] = {"store": {}, "lookup": {}, "load": {}}

    # -- keys -----------------------------------------------------------------------------------------------
    def store_key(self, key: Any) -> StoreKey:
        """The store entry of an LMCache ObjectKey: its model, this adapter's codec and namespace, a digest of
        every ObjectKey field (chunk hash, model, rank, group, salt)."""
        return StoreKey(store_model_id(str(key.model_name)), self.codec, self.namespace, 0, key_digest(key))

    # -- event fds --------------------------------------------------------------------------------------------
    def get_store_event_fd(self) -> int:
        return self._efd["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efd["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efd["load"].fileno()

    # -- tasks ----------------------------------------------------------------------------------------------
    def _submit(self, kind: str, fn: Callable[[], Any], fail: Callable[[], Any]) -> int:
        """Run ``fn`` on the pool; its result (``fail()`` should it raise) is popped once by the query call."""
        with self._lock:
            tid = self._next
            self._next += 1

        def run() -> None:
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 - a task's failure is reported to LMCache, never raised in its thread
                log.warning("kvcodec L2 adapter: %s task failed: %s", kind, e)
                res = fail()
            with self._lock:
                self._done[kind][tid] = res
            self._efd[kind].notify()

        self._pool.submit(run)
        return tid

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit("store", lambda: self._store(keys, objects), lambda: L2StoreResult(False, 0))

    def _store(self, keys: list[Any], objects: list[Any]) -> L2StoreResult:
        _paired(keys, objects)
        sizes, ok = [], True
        for k, obj in zip(keys, objects):
            t = obj.tensor
            try:
                if t is not None and t.dtype == torch.uint8 and t.dim() == 1:  # a serde's bytes: stored as they are
                    # with the size of the buffer the serde sized for them: the store key names this adapter's
                    # codec, not the serde's (see _load)
                    data, meta = bytes(obj.byte_array), {"lmcache": "bytes", "buffer": _buffer_size(obj, t)}
                else:
                    data, meta = self._ser.encode(t, k), {"lmcache": "kv"}
                res = self.store.put(self.store_key(k), data, meta)
            except KvcError as e:
                log.warning("kvcodec L2 adapter: not storing %s: %s", bytes(k.chunk_hash).hex()[:16], e)
                ok = False
                continue
            if not res.ok:
                log.warning("kvcodec L2 adapter: store put failed: %s", res.failed)
                ok = False
                continue
            sizes.append((k, len(data)))
        if sizes:
            self._notify_keys_stored([k for k, _ in sizes], [n for _, n in sizes])
        return L2StoreResult(ok, sum(n for _, n in sizes))

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: dict[int, Any]) -> int:
        return self._submit("lookup", lambda: self._bitmap(self.store.contains_many([self.store_key(k) for k in keys])),
                            lambda: self._bitmap([False] * len(keys)))

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        return self._pop("lookup", task_id)

    def submit_unlock(self, keys: list[Any]) -> None:
        return None  # entries are immutable; nothing is locked

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        return self._submit("load", lambda: self._load(keys, objects), lambda: self._bitmap([False] * len(keys)))

    def _load(self, keys: list[Any], objects: list[Any]) -> Any:
        _paired(keys, objects)
        hits = []
        for k, obj in zip(keys, objects):
            try:
                ent = self.store.get_entry(self.store_key(k))
                if ent is None:
                    hits.append(False)
                    continue
                data, kind = bytes(ent.data), (ent.meta or {}).get("lmcache")
                t = obj.tensor
                if kind == "bytes" and t is not None and t.dtype == torch.uint8 and t.dim() == 1:
                    # Why: two deployments with different serdes in front of this adapter (same preset, same
                    # namespace) share store keys; LMCache's fp8 serde decoded the kvcodec serde's object as fp8
                    # values (a hit, garbage). A serde sizes its buffer by its own estimate: another size is another
                    # serde (or layout). Entries from before this was recorded carry none and load as before.
                    sized, size = (ent.meta or {}).get("buffer"), _buffer_size(obj, t)
                    if sized is not None and sized != size:
                        raise KvcFormatError(f"entry was stored through another serde (a {sized}-byte buffer, this "
                                             f"one {size})")
                    if len(data) > t.numel():
                        raise KvcInputError(f"entry of {len(data)} bytes exceeds the buffer ({t.numel()})")
                    check_buffer(t, "kvcodec L2 adapter: the load buffer")  # a meta buffer: a hit, nothing written
                    t[:len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                elif kind == "kv" and t is not None and t.dtype != torch.uint8:
                    self._de.decode_into(data, t, k)
                else:
                    raise KvcInputError(f"entry kind {kind!r} does not fit a {getattr(t, 'dtype', None)} buffer")
                hits.append(True)
            except KvcError as e:
                log.warning("kvcodec L2 adapter: entry %s is a miss: %s", bytes(k.chunk_hash).hex()[:16], e)
                hits.append(False)
        found = [k for k, h in zip(keys, hits) if h]
        if found:
            self._notify_keys_accessed(found)
        return self._bitmap(hits)

    def query_load_result(self, task_id: int) -> Any:
        return self._pop("load", task_id)

    def _pop(self, kind: str, task_id: int) -> Any:
        with self._lock:
            return self._done[kind].pop(task_id, None)

    @staticmethod
    def _bitmap(hits: list[bool]) -> Any:
        bm = Bitmap(len(hits))
        for i, h in enumerate(hits):
            if h:
                bm.set(i)
        return bm

    def delete(self, keys: list[Any]) -> None:
        for k in keys:
            try:
                self.store.rm(self.store_key(k))
            except KvcError as e:
                log.warning("kvcodec L2 adapter: delete failed: %s", e)

    def report_status(self) -> dict:
        return {"is_healthy": True, "store": self.store.url, "namespace": self.namespace,
                "hits": self.store.hits, "misses": self.store.misses}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for e in self._efd.values():
            e.close()
        self.store.close()
