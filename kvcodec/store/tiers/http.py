"""Read-only HTTP(S) tier: a directory store published on a web server or CDN.

``http(s)://host/base/`` is expected to serve a directory tier's tree, i.e.
``<base>/objects/<ns>/<d[:2]>/<d>.kve``; copying (rsync, ``aws s3 sync``) a
store directory to any static web server publishes it.  Entries are verified
(crc32c, key; the Store then checks the tenant seal) exactly as on disk; a
404 is a miss; other failures are misses that are counted and logged (once
per outage).  ``range_entry(key)`` gives a
:class:`~kvcodec.store.ranged.HttpRangeReader` over the payload only, for
piecewise reads of a large ``.kvc``.

Every request is bounded (:func:`~kvcodec.store.ranged.http_request`): a
connect timeout, a read timeout, a total deadline, and a body no larger than
the range asked for.  A whole entry is fetched only after its size is known
and at most ``max_bytes``.

Query options: ``timeout`` (read timeout, s, default 30), ``connect_timeout``
(default 5), ``deadline`` (whole request, default 300), ``max_bytes`` (largest
entry fetched whole, default 1G: kvc serve's ``--max-body``).
"""

from __future__ import annotations

import threading
from typing import Any, Iterator, Mapping
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store.tiers.directory import SUFFIX
from kvcodec.store.keys import StoreKey
from kvcodec.store.ranged import HttpLimits, HttpRangeReader, http_request
from kvcodec.store.tiers.base import (
    DEFAULT_MAX_ENTRY, FIXED_SIZE, Entry, EntryInfo, KeyMismatch, Tier, decode_envelope, log, parse_fixed, parse_header,
)


class HttpTier(Tier):
    kind = "http"
    schemes = ("http", "https")
    supports_writes = False
    supports_deletes = False
    supports_listing = False
    supports_ranges = True
    remote = True

    def __init__(self, url: str, *, name: str | None = None) -> None:
        from kvcodec.store.options import parse_size, url_port

        try:
            p = urlsplit(url)
        except ValueError as e:
            raise KvcInputError(f"bad http store URL {ascii(url)}: {e}") from None
        url_port(p, "http store")
        if p.scheme not in ("http", "https") or not p.hostname:
            raise KvcInputError(f"not an http(s) URL: {ascii(url)}")
        if "@" in p.netloc:  # never sent (no Authorization header), yet shown in every warning and in stats
            raise KvcInputError(f"an http store takes no credentials in its URL (they would not be sent): "
                                f"{ascii(p.scheme + '://***@' + p.netloc.rpartition('@')[2] + p.path)}")
        q = dict(parse_qsl(p.query))
        try:
            self.limits = HttpLimits(connect=_seconds(q.pop("connect_timeout", 5.0)),
                                     read=_seconds(q.pop("timeout", 30.0)),
                                     total=_seconds(q.pop("deadline", 300.0)))
        except ValueError as e:
            raise KvcInputError(f"bad http store option in {ascii(url)}: {e}") from None
        self.max_entry = parse_size(q.pop("max_bytes", DEFAULT_MAX_ENTRY))
        if self.max_entry <= 0:  # every object over the cap: a store that misses everything, silently
            raise KvcInputError("http store max_bytes must be positive")
        if q:
            raise KvcInputError(f"unknown http store options {sorted(q)}")
        path = p.path if p.path.endswith("/") else p.path + "/"
        self.base = urlunsplit((p.scheme, p.netloc, path, "", ""))
        super().__init__(name or "http", self.base)
        self._warned = False
        self._lock = threading.Lock()

    def object_url(self, key: StoreKey) -> str:
        d = key.digest
        return f"{self.base}objects/{key.namespace}/{d[:2]}/{d}{SUFFIX}"

    def _fail(self, msg: str) -> None:
        self.counters.add(errors=1)
        with self._lock:
            first, self._warned = not self._warned, True
        if first:
            log.warning("store: http source %s failing (%s); treating as misses", self.base, msg)

    def _ok(self) -> None:
        if self._warned:
            with self._lock:
                self._warned = False
            log.warning("store: http source %s reachable again", self.base)

    def _open(self, url: str) -> HttpRangeReader | None:
        """A ranged reader over the whole object, ``None`` on 404/410."""
        try:
            return HttpRangeReader(url, limits=self.limits)
        except KvcStoreError as e:
            if "HTTP 404" in str(e) or "HTTP 410" in str(e):
                return None
            raise

    def get_entry(self, key: StoreKey) -> Entry | None:
        url = self.object_url(key)
        try:
            rr = self._open(url)
            if rr is not None:
                if rr.size > self.max_entry:
                    raise KvcFormatError(f"{url}: object of {rr.size:,} bytes exceeds the tier's "
                                         f"max_bytes {self.max_entry:,}")
                body = rr.read_all()
        except KvcStoreError as e:
            self._fail(str(e))
            self.counters.add(misses=1)
            return None
        except KvcFormatError as err:
            log.warning("store: %s", err)
            self.counters.add(corrupt=1, misses=1)
            return None
        self._ok()
        if rr is None:
            self.counters.add(misses=1)
            return None
        try:
            e = decode_envelope(body, key, what=url)
        except KeyMismatch as err:
            log.warning("store: %s; treated as a miss", err)
            self.counters.add(misses=1)
            return None
        except KvcFormatError as err:
            log.warning("store: %s", err)
            self.counters.add(corrupt=1, misses=1)
            return None
        self.counters.add(hits=1)
        return e

    def contains(self, key: StoreKey) -> bool:
        try:
            r = http_request(self.object_url(key), method="HEAD", limits=self.limits)
        except KvcStoreError as e:
            self._fail(str(e))
            return False
        self._ok()
        return r.status == 200

    def range_entry(self, key: StoreKey) -> tuple[HttpRangeReader, dict[str, Any]] | None:
        """``(reader over the payload, header meta)``; ``None`` on 404 or when it holds another key."""
        url = self.object_url(key)
        rr = self._open(url)
        if rr is None:
            return None
        hl, dl, _ = parse_fixed(rr.read(0, FIXED_SIZE), url)
        h = parse_header(rr.read(FIXED_SIZE, hl), url)
        if h["key"] != key.to_str():
            return None
        if FIXED_SIZE + hl + dl != rr.size:
            raise KvcFormatError(f"{url}: object is {rr.size} bytes, envelope says {FIXED_SIZE + hl + dl}")
        return HttpRangeReader(url, limits=self.limits, base=FIXED_SIZE + hl, length=dl), h.get("meta", {})

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        raise KvcStoreError(f"{self.base} is a read-only http source")

    def delete(self, key: StoreKey) -> bool:
        raise KvcStoreError(f"{self.base} is a read-only http source")

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        return iter(())


def _seconds(v: Any) -> float:
    s = str(v).strip()
    if not s.isascii():
        raise ValueError(f"{ascii(s)} is not a number in ASCII digits")
    return float(s)
