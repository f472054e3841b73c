"""Read-only HTTP(S) tier: a directory store published on a web server or CDN.

``http(s)://host/base/`` is expected to serve a directory tier's tree, i.e.
``<base>/objects/<d[:2]>/<d>.kve``; copying (rsync, ``aws s3 sync``) a store
directory to any static web server publishes it.  Entries are verified
(crc32c, key) exactly as on disk; a 404 is a miss; other failures are misses
that are counted and logged (once per outage).  ``reader(key)`` gives a
:class:`~kvcodec.store.ranged.HttpRangeReader` over the payload only, for
piecewise reads of a large ``.kvc``.

Query options: ``timeout`` (seconds, default 30).
"""

from __future__ import annotations

import threading
import urllib.error
import urllib.request
from http.client import HTTPException
from typing import Any, Iterator, Mapping
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from ..errors import KvcFormatError, KvcInputError, KvcStoreError
from .directory import SUFFIX
from .keys import StoreKey
from .ranged import HttpRangeReader
from .tiers import FIXED_SIZE, Entry, EntryInfo, Tier, decode_envelope, log, parse_fixed, parse_header


class HttpTier(Tier):
    kind = "http"
    writable = False
    can_list = False

    def __init__(self, url: str, *, name: str | None = None) -> None:
        p = urlsplit(url)
        if p.scheme not in ("http", "https"):
            raise KvcInputError(f"not an http(s) URL: {url!r}")
        q = dict(parse_qsl(p.query))
        try:
            self.timeout = float(q.pop("timeout", 30.0))
        except ValueError as e:
            raise KvcInputError(f"bad http store option in {url!r}: {e}") from None
        path = p.path if p.path.endswith("/") else p.path + "/"
        self.base = urlunsplit((p.scheme, p.netloc, path, "", ""))
        super().__init__(name or "http", self.base)
        self._warned = False
        self._lock = threading.Lock()

    def object_url(self, key: StoreKey) -> str:
        d = key.digest
        return f"{self.base}objects/{d[:2]}/{d}{SUFFIX}"

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

    def _open(self, url: str, method: str) -> tuple[int, bytes]:
        req = urllib.request.Request(url, method=method, headers={"Accept-Encoding": "identity"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.status, (resp.read() if method == "GET" else b"")
        except urllib.error.HTTPError as e:
            if e.code in (404, 410):
                return e.code, b""
            raise KvcStoreError(f"{url}: HTTP {e.code} {e.reason}") from None
        except urllib.error.URLError as e:
            raise KvcStoreError(f"{url}: cannot connect: {e.reason}") from None
        except (HTTPException, OSError) as e:
            raise KvcStoreError(f"{url}: transfer failed: {type(e).__name__}: {e}") from None

    def get_entry(self, key: StoreKey) -> Entry | None:
        url = self.object_url(key)
        try:
            status, body = self._open(url, "GET")
        except KvcStoreError as e:
            self._fail(str(e))
            self.counters.add(misses=1)
            return None
        self._ok()
        if status != 200:
            self.counters.add(misses=1)
            return None
        try:
            e = decode_envelope(body, key, what=url)
        except KvcFormatError as err:
            log.warning("store: %s", err)
            self.counters.add(corrupt=1, misses=1)
            return None
        self.counters.add(hits=1)
        return e

    def contains(self, key: StoreKey) -> bool:
        try:
            status, _ = self._open(self.object_url(key), "HEAD")
        except KvcStoreError as e:
            self._fail(str(e))
            return False
        self._ok()
        return status == 200

    def reader(self, key: StoreKey) -> HttpRangeReader | None:
        """Range reader over the payload of ``key`` (``None`` on 404)."""
        url = self.object_url(key)
        try:
            rr = HttpRangeReader(url, timeout=self.timeout)
        except KvcStoreError as e:
            if "HTTP 404" in str(e) or "HTTP 410" in str(e):
                return None
            raise
        hl, dl, _ = parse_fixed(rr.read(0, FIXED_SIZE), url)
        h = parse_header(rr.read(FIXED_SIZE, hl), url)
        if h["key"] != key.to_str():
            raise KvcFormatError(f"{url}: holds key {h['key']}, expected {key.to_str()}")
        if FIXED_SIZE + hl + dl != rr.size:
            raise KvcFormatError(f"{url}: object is {rr.size} bytes, envelope says {FIXED_SIZE + hl + dl}")
        return HttpRangeReader(url, timeout=self.timeout, base=FIXED_SIZE + hl, length=dl)

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None) -> None:
        raise KvcStoreError(f"{self.base} is a read-only http source")

    def delete(self, key: StoreKey) -> bool:
        raise KvcStoreError(f"{self.base} is a read-only http source")

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        return iter(())
