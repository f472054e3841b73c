"""The tiered store: ``Store.open(url)``, then ``put`` / ``get`` / ``ls`` / ``rm`` / ``stats`` / ``gc``.

URL grammar (comma-separated tier list, searched in order, an in-process LRU
always in front)::

    mem://[?max_bytes=256M]             only the in-process LRU (sets its size)
    /abs/dir | rel/dir | file:///abs/dir[?max_bytes=10G&fsync=0]
    redis://[:password@]host:port/db[?timeout=2&prefix=kvc:&ttl=S&retry_interval=1]
    rediss://...                        Redis over TLS
    http(s)://host/base/                read-only published directory store
    kvc+http(s)://[:TOKEN@]host:port    a shared ``kvc serve`` (token also from $KVC_TOKEN)
    redis+cluster://[:password@]host:port[?...]   a Redis Cluster (any node; the rest is discovered)
    s3://bucket/prefix?endpoint_url=...  an S3-compatible object store (boto3)

e.g. ``"/var/cache/kvc,redis://127.0.0.1:6379/0"``.

``get`` searches tiers in order and back-fills the faster tiers in front of
the one that hit.  ``put`` writes through to every writable tier and returns
a :class:`PutResult` naming what happened in each one; it raises
:class:`KvcStoreError` only when no persistent tier took the entry (an
entry is never silently kept only in RAM when the user asked for storage).
"""

from __future__ import annotations

import logging
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import KvcInputError, KvcStoreError
from .keys import DEFAULT_CHUNK, StoreKey, longest_prefix
from .ranged import BytesRangeReader, RangeReader
from .tiers import Entry, EntryInfo, MemoryTier, Tier, as_bytes, check_meta

log = logging.getLogger("kvcodec.store")

DEFAULT_MEMORY_BYTES = 256 << 20
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.I)


def parse_size(s: str | int) -> int:
    """``"512M"``, ``"10GiB"``, ``"1.5g"``, ``"1000"`` -> bytes (binary multiples)."""
    if isinstance(s, int):
        return s
    m = _SIZE_RE.match(str(s))
    if not m:
        raise KvcInputError(f"bad size {s!r}: use e.g. 1000, 512M, 10G")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def _redact(url: str) -> str:
    if "@" in url and "://" in url:
        from .redis_tier import redact

        return redact(url)
    return url


def _flag(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise KvcInputError(f"bad boolean option {v!r}")


@dataclass
class PutResult:
    """Outcome of ``Store.put`` per tier: ``"ok"``, ``"skipped: ..."`` or ``"error: ..."``."""

    key: StoreKey
    tiers: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when no tier reported an error."""
        return not self.failed

    @property
    def failed(self) -> dict[str, str]:
        return {k: v for k, v in self.tiers.items() if v.startswith("error")}

    @property
    def stored_in(self) -> list[str]:
        return [k for k, v in self.tiers.items() if v == "ok"]

    def __bool__(self) -> bool:
        return self.ok


class Store:
    def __init__(self, tiers: list[Tier], url: str = "") -> None:
        if not tiers or not isinstance(tiers[0], MemoryTier):
            tiers = [MemoryTier(DEFAULT_MEMORY_BYTES)] + list(tiers)
        names: set[str] = set()
        for t in tiers:
            base, i = t.name, 2
            while t.name in names:
                t.name = f"{base}{i}"
                i += 1
            names.add(t.name)
        self.tiers = tiers
        self.url = url
        self.memory: MemoryTier = tiers[0]  # type: ignore[assignment]
        self.hits = 0
        self.misses = 0
        self.put_failures = 0
        self._lock = threading.Lock()

    # -- construction ----------------------------------------------------------
    @classmethod
    def open(cls, url: str | os.PathLike[str], *, memory_bytes: int | str | None = None,
             fsync: bool | None = None, max_bytes: int | str | None = None) -> "Store":
        """Open a store from a URL or comma-separated tier list (see module doc).

        ``memory_bytes`` sizes the front LRU; ``fsync``/``max_bytes`` are
        defaults for directory tiers whose URL does not set them.
        """
        s = os.fspath(url).strip()
        if not s:
            raise KvcInputError("empty store URL")
        mem_bytes = parse_size(memory_bytes) if memory_bytes is not None else DEFAULT_MEMORY_BYTES
        tiers: list[Tier] = []
        for part in (p.strip() for p in s.split(",")):
            if not part:
                raise KvcInputError(f"empty tier in store URL {s!r}")
            low = part.lower()
            if low.startswith("mem://"):
                q = dict(parse_qsl(urlsplit(part).query))
                if "max_bytes" in q:
                    mem_bytes = parse_size(q.pop("max_bytes"))
                if q:
                    raise KvcInputError(f"unknown mem:// options {sorted(q)}")
            elif low.startswith(("redis://", "rediss://", "unix://")):
                from .redis_tier import RedisTier

                tiers.append(RedisTier(part))
            elif low.startswith(("kvc+http://", "kvc+https://")):
                from .kdn import KdnTier

                tiers.append(KdnTier(part))
            elif low.startswith(("redis+cluster://", "rediss+cluster://")):
                from .redis_cluster import RedisClusterTier

                tiers.append(RedisClusterTier(part))
            elif low.startswith("s3://"):
                from .s3 import S3Tier

                tiers.append(S3Tier(part))
            elif low.startswith(("http://", "https://")):
                from .http import HttpTier

                tiers.append(HttpTier(part))
            elif low.startswith("file://") or "://" not in part:
                tiers.append(cls._dir_tier(part, fsync, max_bytes))
            else:
                raise KvcInputError(
                    f"unsupported store tier {part!r}: use a directory, file://, mem://, "
                    "redis://, rediss://, redis+cluster://, s3://, kvc+http(s):// or http(s)://")
        return cls([MemoryTier(mem_bytes)] + tiers, url=",".join(_redact(p.strip()) for p in s.split(",")))

    @staticmethod
    def _dir_tier(part: str, fsync: bool | None, max_bytes: int | str | None) -> Tier:
        from .directory import DirectoryTier

        opts: dict[str, str] = {}
        if part.lower().startswith("file://"):
            p = urlsplit(part)
            if p.netloc not in ("", "localhost"):
                raise KvcInputError(f"file URL with a remote host is not supported: {part!r}")
            path = unquote(p.path)
            opts = dict(parse_qsl(p.query))
        else:
            path = os.path.expanduser(part)
        kw: dict[str, Any] = {}
        mb = opts.pop("max_bytes", None)
        kw["max_bytes"] = parse_size(mb) if mb is not None else (
            parse_size(max_bytes) if max_bytes is not None else None)
        fs = opts.pop("fsync", None)
        kw["fsync"] = _flag(fs) if fs is not None else (True if fsync is None else fsync)
        if opts:
            raise KvcInputError(f"unknown directory store options {sorted(opts)}")
        if not path:
            raise KvcInputError("empty directory path in store URL")
        return DirectoryTier(path, **kw)

    # -- core ------------------------------------------------------------------------
    def get_entry(self, key: StoreKey) -> Entry | None:
        """Entry (data + meta) from the first tier holding it; back-fills faster tiers."""
        self._check_key(key)
        for i, t in enumerate(self.tiers):
            e = t.get_entry(key)
            if e is None:
                continue
            for front in self.tiers[:i]:
                if not front.writable:
                    continue
                if isinstance(front, MemoryTier) and not front.fits(len(e.data)):
                    continue
                try:
                    front.put(key, e.data, e.meta, created=e.created)  # type: ignore[call-arg]
                except KvcStoreError as err:
                    log.debug("store: back-fill of %s into %s failed: %s", key, front.name, err)
            with self._lock:
                self.hits += 1
            return e
        with self._lock:
            self.misses += 1
        return None

    def get(self, key: StoreKey) -> bytes | None:
        """The bytes stored under ``key``, or ``None``."""
        e = self.get_entry(key)
        return None if e is None else e.data

    def get_meta(self, key: StoreKey) -> dict[str, Any] | None:
        e = self.get_entry(key)
        return None if e is None else e.meta

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None) -> PutResult:
        """Write through to every writable tier; see :class:`PutResult`."""
        self._check_key(key)
        data = as_bytes(data)
        meta = check_meta(meta)
        res = PutResult(key)
        for t in self.tiers:
            if not t.writable:
                res.tiers[t.name] = "skipped: read-only"
                continue
            if isinstance(t, MemoryTier) and not t.fits(len(data)):
                res.tiers[t.name] = "skipped: larger than the memory tier"
                continue
            try:
                t.put(key, data, meta)
                res.tiers[t.name] = "ok"
            except KvcStoreError as e:
                res.tiers[t.name] = f"error: {e}"
        persistent = [t.name for t in self.tiers if t.writable and t.persistent]
        if res.failed:
            with self._lock:
                self.put_failures += 1
        if persistent and not any(res.tiers[n] == "ok" for n in persistent):
            self.memory.delete(key)
            raise KvcStoreError(
                f"store put of {key} failed in every persistent tier: "
                + "; ".join(f"{n}: {res.tiers[n]}" for n in persistent))
        return res

    def contains(self, key: StoreKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[StoreKey]) -> list[bool]:
        keys = list(keys)
        found = [False] * len(keys)
        for t in self.tiers:
            todo = [i for i, f in enumerate(found) if not f]
            if not todo:
                break
            for i, ok in zip(todo, t.contains_many([keys[i] for i in todo])):
                if ok:
                    found[i] = True
        return found

    def longest_prefix(self, token_ids: Any, *, model: str, codec: str, namespace: str = "default",
                       chunk: int = DEFAULT_CHUNK, min_tokens: int = 1) -> tuple[StoreKey | None, int]:
        """``(key, n_tokens)`` of the longest cached prefix (see :func:`keys.longest_prefix`)."""
        return longest_prefix(self, token_ids, model=model, codec=codec, namespace=namespace,
                              chunk=chunk, min_tokens=min_tokens)

    def reader(self, key: StoreKey) -> RangeReader | None:
        """A range reader over the payload of ``key`` without loading it whole.

        Uses the first tier that can serve ranges (directory: pread, http:
        Range requests); falls back to a full ``get``.  Range readers skip
        the whole-entry checksum, so the payload format must carry its own.
        """
        self._check_key(key)
        for t in self.tiers:
            if isinstance(t, MemoryTier):
                e = t.get_entry(key)
                if e is not None:
                    return BytesRangeReader(e.data, name=str(key))
                continue
            rd = getattr(t, "reader", None)
            if rd is not None:
                try:
                    r = rd(key)
                except KvcStoreError as err:
                    log.warning("store: %s cannot serve ranges for %s: %s", t.name, key, err)
                    continue
                if r is not None:
                    return r
            elif t.contains(key):
                data = self.get(key)
                if data is not None:
                    return BytesRangeReader(data, name=str(key))
        return None

    def rm(self, key: StoreKey) -> bool:
        """Delete ``key`` from every writable tier.  True if any tier held it.

        Raises :class:`KvcStoreError` if some tier could not be reached (a
        surviving copy would come back through back-fill).
        """
        self._check_key(key)
        removed = False
        errors = []
        for t in self.tiers:
            if not t.writable:
                continue
            try:
                removed = t.delete(key) or removed
            except KvcStoreError as e:
                errors.append(f"{t.name}: {e}")
        if errors:
            raise KvcStoreError(f"store rm of {key} incomplete: " + "; ".join(errors))
        return removed

    def ls(self, *, with_meta: bool = False, model: str | None = None, codec: str | None = None,
           namespace: str | None = None) -> list[EntryInfo]:
        """Entries of all listable tiers, merged by key (``tier`` = comma-joined tier names)."""
        merged: dict[StoreKey, EntryInfo] = {}
        for t in self.tiers:
            if not t.can_list:
                continue
            was_up = t.available()
            try:
                for info in t.ls(with_meta=with_meta):
                    k = info.key
                    if (model and k.model != model) or (codec and k.codec != codec) or \
                            (namespace and k.namespace != namespace):
                        continue
                    if k in merged:
                        merged[k].tier += "," + info.tier
                    else:
                        merged[k] = info
            except KvcStoreError as e:  # an outage already warned about is not repeated
                (log.warning if was_up and t.available() else log.info)(
                    "store: cannot list %s: %s", t.name, e)
        return sorted(merged.values(), key=lambda i: i.key)

    def stats(self) -> dict[str, Any]:
        return {"url": self.url, "hits": self.hits, "misses": self.misses,
                "put_failures": self.put_failures, "tiers": [t.stats() for t in self.tiers]}

    def gc(self, grace_s: float = 3600.0) -> dict[str, Any]:
        """Per-tier maintenance: leftover temp files, corrupt entries, size caps."""
        out: dict[str, Any] = {}
        for t in self.tiers:
            try:
                out[t.name] = t.gc(grace_s=grace_s)
            except KvcStoreError as e:
                out[t.name] = {"error": str(e)}
        return out

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KvcInputError(f"no tier named {name!r} (have {[t.name for t in self.tiers]})")

    @staticmethod
    def _check_key(key: Any) -> None:
        if not isinstance(key, StoreKey):
            raise KvcInputError(f"store keys are StoreKey objects, got {type(key).__name__} "
                                "(use StoreKey.from_str for strings)")

    def close(self) -> None:
        for t in self.tiers:
            t.close()

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Store({self.url!r}, tiers={[t.name for t in self.tiers]})"
