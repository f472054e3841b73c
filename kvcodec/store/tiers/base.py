"""Tier interface, the entry envelope shared by persistent tiers, and the LRU tier.

Every tier speaks the same small interface (:class:`Tier`): ``get_entry`` /
``get`` / ``put`` / ``contains`` / ``contains_many`` / ``delete`` / ``ls`` /
``stats`` / ``gc`` / ``close``, plus ``range_entry`` when it declares
``supports_ranges``.  Entries are opaque bytes plus a small JSON metadata dict.

Persistent tiers (directory, Redis, HTTP) store an *envelope*::

    off  size  field
    0    4     magic b"KVSE"
    4    1     version = 1
    5    1     flags   = 0 (non-zero: unsupported, refused)
    6    2     reserved = 0
    8    4     header_len  u32le  (<= 1 MiB)
    12   8     data_len    u64le
    20   4     crc32c      u32le over bytes [0, 20) + header + data
    24   H     header: UTF-8 JSON {"key": "<StoreKey.to_str()>", "meta": {...}, "created": <unix s>}
    24+H D     data (the opaque payload, e.g. a .kvc file)

The key inside the header is compared with the requested key on every read,
so a file copied to the wrong name is a miss, not a wrong answer -- and a plain
miss: a read never moves or deletes an entry whose header names another key
(:class:`KeyMismatch`), because that entry may be someone else's.

Tiers store *physical* keys and sealed metadata handed down by the
:class:`~kvcodec.store.Store`; isolation and authentication live above this
interface (``tenant.py``).  What a tier must do is in spec/store-keys.md §9.
"""

from __future__ import annotations

import json
import logging
import struct
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Protocol
from urllib.parse import parse_qsl, urlsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError, json_loads
from kvcodec.store.keys import StoreKey
from kvcodec.store.options import DEFAULT_MEMORY_BYTES, TierDefaults, parse_size
from kvcodec.store.outage import OutageGuard
from kvcodec.store.ranged import RangeReader

log = logging.getLogger("kvcodec.store")

MAGIC = b"KVSE"
ENVELOPE_VERSION = 1
FIXED = struct.Struct("<4sBBHIQI")  # magic, version, flags, reserved, header_len, data_len, crc
FIXED_SIZE = FIXED.size  # 24
MAX_HEADER = 1 << 20
DEFAULT_MAX_ENTRY = 1 << 30     # largest object a remote tier reads (URL option max_bytes): kvc serve's --max-body
HEAD_FIRST = 1 << 20            # remote objects larger than this are read head first (Tier._check_head)
HEAD_READ = 64 << 10            # bytes of such an object read first: the fixed part and (nearly always) the header
OVERSIZE_WARN_EVERY = 60.0      # seconds between two warnings about oversized objects on one tier
#: ``head_ok(meta, payload_length)`` given to ``Tier.get_entry`` by the Store: raises KvcFormatError when the
#: entry an envelope header describes must not be read (its seal does not verify for the asked key, or seals
#: another length), so a tier that reads large objects head first refuses a forgery before its payload
HeadCheck = Callable[[Mapping[str, Any], int], None]


class HeadChecking(Protocol):
    """What a tier declaring ``checks_heads`` offers: ``get_entry`` with the Store's ``head_ok`` (Redis, S3)."""

    def get_entry(self, key: StoreKey, head_ok: HeadCheck | None = None) -> Entry | None: ...

MAX_META = 64 * 1024          # user metadata (checked by the Store)
MAX_TIER_META = MAX_HEADER - 4096  # what a tier accepts: user metadata + the seal


class KeyMismatch(KvcFormatError):
    """An intact envelope that holds another key than the one asked for: a miss, never quarantined."""

try:  # C implementation ships with google-crc32c (a kvcodec dependency)
    import google_crc32c as _crc

    def crc32c_extend(crc: int, data: bytes | memoryview) -> int:
        return _crc.extend(crc, bytes(data) if isinstance(data, memoryview) else data)
except ImportError:  # pragma: no cover - fallback, slow but correct
    _T = []
    for _i in range(256):
        _c = _i
        for _ in range(8):
            _c = (_c >> 1) ^ (0x82F63B78 if _c & 1 else 0)
        _T.append(_c)

    def crc32c_extend(crc: int, data: bytes | memoryview) -> int:
        c = crc ^ 0xFFFFFFFF
        for b in bytes(data):
            c = _T[(c ^ b) & 0xFF] ^ (c >> 8)
        return c ^ 0xFFFFFFFF


def crc32c(data: bytes) -> int:
    return crc32c_extend(0, data)


# -- data classes -------------------------------------------------------------

@dataclass
class Entry:
    key: StoreKey
    data: bytes
    meta: dict[str, Any]
    created: float | None = None


@dataclass
class EntryInfo:
    """One row of ``ls``: the key, payload size in bytes and (if read) its metadata."""

    key: StoreKey
    size: int
    tier: str
    meta: dict[str, Any] | None = None
    mtime: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"key": self.key.to_str(), "size": self.size, "tier": self.tier,
                "meta": self.meta, "mtime": self.mtime}


@dataclass
class TierCounters:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_errors: int = 0
    errors: int = 0
    corrupt: int = 0
    evictions: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **kw: int) -> None:
        with self.lock:
            for k, v in kw.items():
                setattr(self, k, getattr(self, k) + v)

    def as_dict(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in
                ("hits", "misses", "puts", "put_errors", "errors", "corrupt", "evictions")}


def check_meta(meta: Mapping[str, Any] | None, limit: int = MAX_META) -> dict[str, Any]:
    """Validate that ``meta`` is a small JSON-serialisable dict; return a copy."""
    if meta is None:
        return {}
    if not isinstance(meta, Mapping):
        raise KvcInputError(f"store metadata must be a dict, got {type(meta).__name__}")
    try:
        s = json.dumps(dict(meta), sort_keys=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise KvcInputError(f"store metadata is not plain JSON: {type(e).__name__}: {e}") from None
    if len(s) > limit:
        raise KvcInputError(f"store metadata too large: {len(s)} bytes > {limit}")
    todo: list[Any] = [meta]  # bounded: every node took at least a character of s
    while todo:
        v = todo.pop()
        if isinstance(v, Mapping):
            bad = [k for k in v if not isinstance(k, str)]
            if bad:  # JSON writes 1 as "1" and None as "null": what came back was not what was put
                raise KvcInputError(f"store metadata keys must be strings, got {type(bad[0]).__name__} "
                                    f"{ascii(bad[0])[:40]}")
            todo.extend(v.values())
        elif isinstance(v, (list, tuple)):
            todo.extend(v)
    return json.loads(s)


def as_bytes(data: Any) -> bytes:
    if isinstance(data, bytes):
        return data
    if isinstance(data, (bytearray, memoryview)):
        return bytes(data)
    raise KvcInputError(f"store data must be bytes, got {type(data).__name__}")


# -- envelope -------------------------------------------------------------------

def encode_envelope_parts(key: StoreKey, data: bytes, meta: dict[str, Any],
                          created: float | None = None) -> tuple[bytes, bytes]:
    """``(prefix, data)``: the envelope is ``prefix + data`` (kept apart to avoid a copy)."""
    header = json.dumps({"key": key.to_str(), "meta": meta,
                         "created": round(time.time() if created is None else created, 3)},
                        sort_keys=True, separators=(",", ":")).encode()
    if len(header) > MAX_HEADER:
        raise KvcInputError("store entry header too large")
    head0 = FIXED.pack(MAGIC, ENVELOPE_VERSION, 0, 0, len(header), len(data), 0)[:20]
    crc = crc32c_extend(crc32c_extend(crc32c(head0), header), data)
    return head0 + struct.pack("<I", crc) + header, data


def encode_envelope(key: StoreKey, data: bytes, meta: dict[str, Any], created: float | None = None) -> bytes:
    prefix, data = encode_envelope_parts(key, data, meta, created)
    return prefix + data


def parse_fixed(buf: bytes, what: str = "entry") -> tuple[int, int, int]:
    """``(header_len, data_len, crc)`` from the first 24 bytes; raises KvcFormatError."""
    if len(buf) < FIXED_SIZE:
        raise KvcFormatError(f"{what}: truncated envelope ({len(buf)} bytes)")
    magic, ver, flags, _res, hl, dl, crc = FIXED.unpack_from(buf, 0)
    if magic != MAGIC:
        raise KvcFormatError(f"{what}: bad magic {magic!r} (not a kvcodec store entry)")
    if ver != ENVELOPE_VERSION:
        raise KvcFormatError(f"{what}: unsupported envelope version {ver}")
    if flags != 0:
        raise KvcFormatError(f"{what}: unsupported envelope flags 0x{flags:02x}")
    if hl > MAX_HEADER:
        raise KvcFormatError(f"{what}: header length {hl} exceeds {MAX_HEADER}")
    return hl, dl, crc


def parse_header(hbytes: bytes, what: str = "entry") -> dict[str, Any]:
    try:
        h = json_loads(hbytes.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise KvcFormatError(f"{what}: header is not JSON: {type(e).__name__}: {e}") from None
    if not isinstance(h, dict) or not isinstance(h.get("key"), str) or not isinstance(h.get("meta", {}), dict):
        raise KvcFormatError(f"{what}: header lacks key/meta")
    return h


def decode_envelope_parts(prefix: bytes, data: bytes, key: StoreKey | None = None,
                          what: str = "entry", total: int | None = None) -> Entry:
    """Check an envelope given as ``prefix`` (fixed part + header) and ``data``.

    ``total``: the object's size when known (file size), checked against the
    announced lengths.  Raises :class:`KvcFormatError` on any damage.
    """
    hl, dl, crc = parse_fixed(prefix[:FIXED_SIZE], what)
    want = FIXED_SIZE + hl + dl
    got = len(prefix) + len(data) if total is None else total
    if len(prefix) != FIXED_SIZE + hl or len(data) != dl or got != want:
        raise KvcFormatError(f"{what}: size {got} != {want} announced (truncated or padded)")
    c = crc32c_extend(crc32c_extend(crc32c(prefix[:20]), prefix[FIXED_SIZE:]), data)
    if c != crc:
        raise KvcFormatError(f"{what}: checksum mismatch (crc32c {c:08x} != {crc:08x})")
    h = parse_header(prefix[FIXED_SIZE:], what)
    try:
        k = StoreKey.from_str(h["key"])
    except KvcInputError as e:
        raise KvcFormatError(f"{what}: bad key in header: {e}") from None
    if key is not None and k != key:
        raise KeyMismatch(f"{what}: holds key {k.to_str()}, expected {key.to_str()}")
    created = h.get("created")
    ok = isinstance(created, (int, float)) and not isinstance(created, bool) and abs(created) < 1e12
    return Entry(k, data, h.get("meta", {}), float(created) if ok else None)


def decode_envelope(buf: bytes | memoryview, key: StoreKey | None = None, what: str = "entry") -> Entry:
    """Check and unpack a whole envelope.  Raises :class:`KvcFormatError` on any damage."""
    buf = bytes(buf)
    hl, dl, _ = parse_fixed(buf[:FIXED_SIZE], what)
    if len(buf) != FIXED_SIZE + hl + dl:
        raise KvcFormatError(f"{what}: size {len(buf)} != {FIXED_SIZE + hl + dl} announced "
                             "(truncated or padded)")
    return decode_envelope_parts(buf[:FIXED_SIZE + hl], buf[FIXED_SIZE + hl:], key, what)


# -- tier interface -------------------------------------------------------------------

class Tier:
    """Base class of all tiers: what a tier can do is declared, not discovered.

    ``schemes``: the URL schemes that open this tier (``Store.open("redis://...")``;
    the table is :mod:`kvcodec.store.tiers.registry`).  The capability flags
    say what the :class:`~kvcodec.store.Store` may ask of it, like zarr's
    ``Store.supports_*``:

    * ``supports_writes``: ``put`` stores entries (else it raises ``KvcStoreError``);
    * ``supports_deletes``: ``delete`` removes them (else it raises ``KvcStoreError``);
    * ``supports_listing``: ``ls`` yields every entry held (else nothing);
    * ``supports_ranges``: ``range_entry`` serves piecewise reads of a payload;
    * ``persistent``: survives the process (the LRU is the only tier that does not);
    * ``remote``: over the network, so it can be down; such a tier keeps an
      :class:`~kvcodec.store.outage.OutageGuard` as ``guard`` (or does its own
      bookkeeping and leaves ``guard`` None).

    Failures of a remote tier raise :class:`KvcStoreError` from ``put``/``delete``;
    reads turn failures into misses (and count them in ``stats()['errors']``).
    A new tier subclasses this, declares the above, and passes
    :class:`kvcodec.testing.store.TierTests` (spec/store-keys.md §9).
    """

    kind = "tier"
    schemes: tuple[str, ...] = ()
    supports_writes = True
    supports_deletes = True
    supports_listing = True
    supports_ranges = False
    checks_heads = False  # get_entry honours ``head_ok`` (reads large objects head first): the Store passes it
    persistent = True
    remote = False
    guard: OutageGuard | None = None

    def __init__(self, name: str, url: str) -> None:
        self.name = name
        self.url = url
        self.counters = TierCounters()

    @classmethod
    def from_url(cls, url: str, defaults: TierDefaults) -> "Tier":
        """The tier a store URL part names (``Store.open``); ``defaults`` holds Store.open's keywords."""
        return cls(url)  # type: ignore[call-arg]  # the URL-taking constructor of every remote tier

    # required
    def get_entry(self, key: StoreKey) -> Entry | None:  # pragma: no cover
        raise NotImplementedError

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:  # pragma: no cover
        raise NotImplementedError

    def put_for(self, owner: str | None, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
                created: float | None = None) -> None:
        """``put`` on behalf of tenant ``owner`` (its key id), for a tier that bounds each tenant's bytes."""
        self.put(key, data, meta, created)

    def contains(self, key: StoreKey) -> bool:  # pragma: no cover
        raise NotImplementedError

    def delete(self, key: StoreKey) -> bool:  # pragma: no cover
        raise NotImplementedError

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:  # pragma: no cover
        raise NotImplementedError

    def ls_judged(self, with_meta: bool, mine: Callable[[EntryInfo], bool | None]) -> Iterator[EntryInfo]:
        """``ls``, where a tier that keeps partitions (a key's namespace, a tenant's tag) apart reads no further
        in a partition once ``mine`` said False of an entry of it (True or None: read on). Why: every entry of a
        partition is its owner's, so one header tells a Store whether the partition is its tenant's; a tenant's
        listing then costs a header per other tenant's partition, not every other tenant's entries. Default:
        ``ls`` (``mine`` unused; the Store skips other partitions' entries all the same)."""
        return self.ls(with_meta)

    # with supports_ranges
    def range_entry(self, key: StoreKey) -> tuple[RangeReader, dict[str, Any]] | None:
        """``(RangeReader over the payload, header meta)`` or None when absent or holding another key.

        Only tiers that declare ``supports_ranges`` implement it; the Store wraps the reader in an
        AuthRangeReader.  Other tiers are range-read through a verified whole get.
        """
        raise NotImplementedError(f"{type(self).__name__} does not serve ranges (supports_ranges is False)")

    def get(self, key: StoreKey) -> bytes | None:
        e = self.get_entry(key)
        return None if e is None else e.data

    def _entry_or_drop(self, buf: bytes | None, key: StoreKey, what: str, delete: Callable[[], Any]) -> Entry | None:
        """A remote tier's raw value for ``key`` as an entry, or a counted miss.

        The one policy every remote tier applies to what it read: no value is a
        miss; an intact envelope of *another* key is a miss and never deleted (it
        may be someone's); a corrupt one is deleted (best effort, ``delete``) so the
        next ask prefills and replaces it.
        """
        if buf is None:
            self.counters.add(misses=1)
            return None
        try:
            e = decode_envelope(buf, key, what=what)
        except KeyMismatch as err:
            self.counters.add(misses=1)
            log.warning("store: %s; treated as a miss", err)
            return None
        except KvcFormatError as err:
            self.counters.add(corrupt=1, misses=1)
            log.warning("store: %s; deleting it", err)
            try:
                delete()
            except KvcStoreError:
                pass
            return None
        self.counters.add(hits=1)
        return e

    def _check_head(self, head: bytes, size: int, key: StoreKey, what: str, more: Callable[[int], bytes],
                    head_ok: HeadCheck | None = None, on_refused: Callable[[bool], None] | None = None) -> bytes | None:
        """An object of ``size`` bytes over :data:`HEAD_FIRST`, judged by its envelope's fixed part and header
        before its payload is read.

        Why: whoever can write a shared tier can plant large values under the names readers ask for; an intact
        envelope of *another* key must be kept (it may be someone's), and a forgery under the asked key is
        refused only by its seal, so without this every read of either would move the whole value before
        refusing it.  ``head`` holds the object's first bytes (at least the fixed part); ``more(n)`` reads the
        next ``n`` (the rest of a header longer than ``head``).  ``head_ok``: the Store's seal check.  Returns
        the bytes read so far (fixed part and whole header at least) when the payload should be read, or None:
        a counted miss -- another key's envelope (kept), one whose announced size is not the object's, or
        whose seal ``head_ok`` refuses (corrupt, kept: the caller's full read would refuse it too).
        ``on_refused(by_seal)``: called when the object is refused, so a tier can remember that version of it;
        ``by_seal`` when it was ``head_ok`` that refused it (a verdict only for readers that check seals: one
        reading without ``head_ok`` would take the object).
        """
        sealed = False
        try:
            hl, dl, _ = parse_fixed(head[:FIXED_SIZE], what)
            if FIXED_SIZE + hl + dl != size:
                raise KvcFormatError(f"{what}: size {size} != {FIXED_SIZE + hl + dl} announced (truncated or padded)")
            if FIXED_SIZE + hl > len(head):
                head += more(FIXED_SIZE + hl - len(head))
            h = parse_header(head[FIXED_SIZE:FIXED_SIZE + hl], what)
            if h["key"] != key.to_str():
                raise KeyMismatch(f"{what}: holds key {str(h['key'])[:200]}, expected {key.to_str()}")
            if head_ok is not None:
                sealed = True
                meta = h.get("meta", {})
                head_ok(meta if isinstance(meta, dict) else {}, dl)
        except KeyMismatch as err:
            self.counters.add(misses=1)
            self._warn_rarely(f"{err}; treated as a miss, payload not read")
            if on_refused is not None:
                on_refused(False)
            return None
        except KvcFormatError as err:
            self.counters.add(corrupt=1, misses=1)
            self._warn_rarely(f"{err}; treated as a miss, payload not read")
            if on_refused is not None:
                on_refused(sealed)
            return None
        return head

    def _capped_envelope(self, key: StoreKey, data: Any, meta: Mapping[str, Any] | None, created: float | None,
                         limit: int, what: str) -> bytes:
        """The envelope a put stores, refused (and counted) when it is over the tier's ``max_bytes`` ``limit``:
        what a remote tier would refuse to read back must never be written."""
        env = encode_envelope(key, as_bytes(data), check_meta(meta, MAX_TIER_META), created)
        if len(env) > limit:
            self.counters.add(put_errors=1)
            raise KvcStoreError(f"{what}: entry of {len(env):,} bytes exceeds the tier's max_bytes {limit:,}")
        return env

    def _too_large(self, size: int, limit: int, what: str) -> None:
        """An object over the tier's ``max_bytes``, found by its size before reading it: a counted miss, kept.

        Warned about at most once a minute per tier (whoever can write the tier can plant many)."""
        self.counters.add(corrupt=1, misses=1)
        self._warn_rarely(f"{what}: object of {size:,} bytes exceeds the tier's max_bytes {limit:,}; not read, "
                          "treated as a miss")

    def _warn_rarely(self, msg: str) -> None:
        """A warning about what a writer of the tier may have planted: at most one a minute per tier, the
        others counted in the next (whoever can write the tier can plant many)."""
        now = time.monotonic()
        with self.counters.lock:
            last, n = getattr(self, "_planted_warned", (-1e9, 0))
            self._planted_warned = (last, n + 1)
            if now - last < OVERSIZE_WARN_EVERY:
                return
            self._planted_warned = (now, 0)
        more = f" ({n} more since the last warning)" if n else ""
        log.warning("store: %s%s", msg, more)

    def contains_many(self, keys: Iterable[StoreKey]) -> list[bool]:
        return [self.contains(k) for k in keys]

    def gc(self, grace_s: float = 3600.0) -> dict[str, int]:
        return {}

    def usage(self) -> tuple[int, int]:
        """``(entries, bytes)`` currently held (may scan)."""
        n = b = 0
        for info in self.ls():
            n += 1
            b += info.size
        return n, b

    def share_tenants(self, tenants: int) -> int | None:
        """Give ``tenants`` a byte bound each where the tier set none and one could fill it under the others
        (the directory tier's disk); the bound, or None (none needed: a server bounds its own memory)."""
        return None

    def available(self) -> bool:
        """False while the tier's server is known to be down (its guard's view)."""
        return self.guard is None or self.guard.up

    def stats(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name, "kind": self.kind, "url": self.url,
                             "writable": self.supports_writes, "persistent": self.persistent}
        try:
            d["entries"], d["bytes"] = self.usage() if self.supports_listing else (None, None)
        except KvcStoreError as e:
            d["entries"], d["bytes"] = None, None
            d["error"] = str(e)
        d["available"] = self.available()
        d.update(self.counters.as_dict())
        if self.guard is not None:
            d["outages"] = self.guard.outages
            d["last_error"] = self.guard.last_error
        return d

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.url}>"


class MemoryTier(Tier):
    """In-process LRU of entries with a byte-size cap (counts payload bytes).

    An entry larger than the cap is not kept (``put`` returns without error;
    ``Store.put`` reports it as skipped).  Thread-safe.
    """

    kind = "memory"
    schemes = ("mem",)
    persistent = False

    def __init__(self, max_bytes: int = DEFAULT_MEMORY_BYTES, name: str = "memory") -> None:
        super().__init__(name, f"mem://?max_bytes={int(max_bytes)}")
        if max_bytes < 0:
            raise KvcInputError("memory tier max_bytes must be >= 0")
        self.max_bytes = int(max_bytes)
        self._d: OrderedDict[StoreKey, Entry] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, defaults: TierDefaults) -> "MemoryTier":
        """``mem://[?max_bytes=256M]``: the size of the Store's in-process LRU (default ``defaults.memory_bytes``)."""
        p = urlsplit(url)
        if p.netloc or p.path not in ("", "/"):  # mem://512M was an LRU of the default size, silently
            raise KvcInputError(f"mem:// takes no host or path, only ?max_bytes=SIZE; got {ascii(url[:80])}")
        q = dict(parse_qsl(p.query))
        size = parse_size(q.pop("max_bytes")) if "max_bytes" in q else defaults.memory_bytes
        if q:
            raise KvcInputError(f"unknown mem:// options {sorted(q)}")
        return cls(size)

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def get_entry(self, key: StoreKey) -> Entry | None:
        with self._lock:
            e = self._d.get(key)
            if e is not None:
                self._d.move_to_end(key)
        self.counters.add(**({"hits": 1} if e is not None else {"misses": 1}))
        return e

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        data = as_bytes(data)
        meta = check_meta(meta, MAX_TIER_META)
        if not self.fits(len(data)):
            return
        e = Entry(key, data, meta, time.time() if created is None else created)
        evicted = 0
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self._bytes -= len(old.data)
            self._d[key] = e
            self._bytes += len(data)
            while self._bytes > self.max_bytes and self._d:
                _, ev = self._d.popitem(last=False)
                self._bytes -= len(ev.data)
                evicted += 1
        self.counters.add(puts=1, evictions=evicted)

    def contains(self, key: StoreKey) -> bool:
        with self._lock:
            return key in self._d

    def delete(self, key: StoreKey) -> bool:
        with self._lock:
            e = self._d.pop(key, None)
            if e is not None:
                self._bytes -= len(e.data)
        return e is not None

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        with self._lock:
            items = list(self._d.items())
        for k, e in items:
            yield EntryInfo(k, len(e.data), self.name, dict(e.meta) if with_meta else None, e.created)

    def usage(self) -> tuple[int, int]:
        with self._lock:
            return len(self._d), self._bytes

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self._bytes = 0

    def stats(self) -> dict[str, Any]:
        d = super().stats()
        d["max_bytes"] = self.max_bytes
        return d
