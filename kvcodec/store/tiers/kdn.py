"""Client tier of the KDN service (``kvc serve``): ``kvc+http://[:TOKEN@]host:port``.

With this tier every existing store client (``kvc ask``, blend, the HF
loader, the vLLM connector, ``kvc store``) talks to a shared ``kvc serve``
instead of a local directory or Redis: ``Store.open("kvc+http://host:8470")``.
The wire protocol is in ``spec/kdn-v1.md``; the server is :mod:`kvcodec.service`.

Authentication: a bearer token, taken from the URL's password
(``kvc+http://:TOKEN@host:port``; redacted in logs and stats) or else from
the ``KVC_TOKEN`` environment variable.  The server maps the token to a
tenant and the namespaces it may use; a key in another namespace is refused
(HTTP 403), which this tier reports as a :class:`KvcStoreError` on writes and
as a counted miss on reads.

Integrity: the server sends the payload's CRC32C (``X-Kvc-Crc32c``) and this
tier checks it, so a payload damaged in transit or in a proxy is a miss, not
a wrong answer.  The server itself verifies every ``.kvc`` on put and checks
that its token ids hash to the key it is stored under.

Availability: a refused connection or timeout marks the service down for
``retry_interval`` seconds (one warning per outage); meanwhile reads are
misses and writes raise :class:`KvcStoreError`, exactly like the Redis tier.

Query options: ``timeout`` (seconds, default 10: connect and read), ``put_timeout``
(seconds, default 300: the server decodes every chunk of a put before
answering; also the total deadline of a get), ``max_entry`` (default 1G: the
largest entry body a get accepts), ``retry_interval`` (seconds, default 1).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Iterator, Mapping
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcQuotaError, KvcStoreError, json_loads
from kvcodec.kdn_protocol import CONTAINS, CONTENT_TYPE, ENTRIES, H_CRC, H_CREATED, H_META, MAX_CONTAINS, MAX_META_HEADER, WHOAMI
from kvcodec.store.keys import StoreKey
from kvcodec.store.options import parse_number, parse_size, redact, url_port
from kvcodec.store.ranged import HttpLimits, HttpRangeReader, http_request
from kvcodec.store.outage import OutageGuard
from kvcodec.store.tiers.base import MAX_TIER_META, Entry, EntryInfo, Tier, as_bytes, check_meta, crc32c, log

TOKEN_ENV = "KVC_TOKEN"
MAX_REPLY = 64 << 20    # bytes read from a JSON answer (a listing of many entries)


def entry_path(key: StoreKey) -> str:
    return f"{ENTRIES}/{quote(key.to_str(), safe='')}"


class KdnTier(Tier):
    """A ``kvc serve`` instance as a store tier (see the module docstring)."""

    kind = "kdn"
    schemes = ("kvc+http", "kvc+https")
    supports_ranges = True
    remote = True
    guard: OutageGuard

    def __init__(self, url: str, *, name: str | None = None, token: str | None = None) -> None:
        p = urlsplit(url)
        scheme = p.scheme.lower()
        if scheme not in ("kvc+http", "kvc+https"):
            raise KvcInputError(f"not a kvc+http(s) URL: {redact(url)!r}")
        if not p.hostname:
            raise KvcInputError(f"kvc+http URL needs a host: {redact(url)!r}")
        q = dict(parse_qsl(p.query))
        try:
            self.timeout = parse_number(q.pop("timeout", "10"), "timeout", positive=True)
            self.put_timeout = parse_number(q.pop("put_timeout", "300"), "put_timeout", positive=True)
            self.max_entry = parse_size(q.pop("max_entry", "1G"))
            self.retry_interval = parse_number(q.pop("retry_interval", "1"), "retry_interval")
        except ValueError as e:
            raise KvcInputError(f"bad kvc+http option: {e}") from None
        if q:
            raise KvcInputError(f"unknown kvc+http options {sorted(q)}")
        if self.max_entry <= 0:  # every entry over the cap: a store that misses everything, silently
            raise KvcInputError("kvc+http max_entry must be positive")
        if p.path not in ("", "/"):
            raise KvcInputError(f"kvc+http URL takes no path: {p.path!r}")
        self.token = token or p.password or os.environ.get(TOKEN_ENV) or None
        port = url_port(p, "kvc+http")
        host = p.hostname if ":" not in p.hostname else f"[{p.hostname}]"
        netloc = f"{host}:{port}" if port else host
        self.base = urlunsplit((scheme[4:], netloc, "", "", ""))
        super().__init__(name or "kdn", f"{scheme}://{netloc}")
        self.guard = OutageGuard(f"kdn {self.url}", self.retry_interval)
        self.limits = HttpLimits(connect=min(self.timeout, 5.0), read=self.timeout,
                                 total=max(self.timeout, self.put_timeout))

    # -- transport ----------------------------------------------------------------
    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        h = {"Accept-Encoding": "identity"}
        if self.token:
            h["Authorization"] = f"Bearer {self.token}"
        h.update(extra or {})
        return h

    def _request(self, method: str, path: str, body: bytes | None = None,
                 headers: Mapping[str, str] | None = None, timeout: float | None = None
                 ) -> tuple[int, Any, bytes]:
        """``(status, headers, body)``; 4xx answers are returned, transport failures raise.

        Through :func:`~kvcodec.store.ranged.http_request`, as the entry reads are: its total deadline bounds a
        server that trickles its answer (urllib's timeout bounds each read only, so a listing sent a byte at a
        time held ``ls`` for as long as the server liked)."""
        self.guard.check(method)
        limits = self.limits if timeout is None else HttpLimits(
            connect=self.limits.connect, read=timeout, total=max(timeout, self.limits.total))
        try:
            r = http_request(self.base + path, method=method, headers=self._headers(headers), limits=limits,
                             max_body=MAX_REPLY, body_statuses=tuple(range(200, 600)), body=body)
        except KvcFormatError as e:  # the answer was cut short
            raise self.guard.failed(str(e)) from None
        except KvcStoreError as e:
            if any(w in str(e) for w in ("deadline", "connect", "transfer", "timeout")):
                raise self.guard.failed(str(e)) from None
            raise
        if r.status >= 500:  # 507: the tenant's quota (KvcQuotaError: permanent, unlike an outage)
            raise (KvcQuotaError if r.status == 507 else KvcStoreError)(
                f"kdn {self.url}: {method} {path}: HTTP {r.status} {_reason(r.body)}")
        self.guard.ok()
        return r.status, r.headers, r.body

    def _refused(self, what: str, status: int, body: bytes) -> KvcStoreError:
        return KvcStoreError(f"kdn {self.url}: {what} refused: HTTP {status} {_reason(body)}")

    # -- Tier interface ----------------------------------------------------------
    def _fetch(self, method: str, key: StoreKey) -> Any:
        """A bounded GET/HEAD of an entry (connect/read/total deadlines, body at most ``max_entry``)."""
        self.guard.check(method)
        try:
            r = http_request(self.base + entry_path(key), method=method, headers=self._headers(),
                             limits=self.limits, max_body=self.max_entry, body_statuses=(200,))
        except KvcStoreError as e:
            if "deadline" in str(e) or "connect" in str(e) or "transfer" in str(e):
                raise self.guard.failed(str(e)) from None
            raise
        if r.status >= 500:
            raise KvcStoreError(f"kdn {self.url}: {method} {key}: HTTP {r.status}")
        self.guard.ok()
        return r

    def get_entry(self, key: StoreKey) -> Entry | None:
        try:
            r = self._fetch("GET", key)
        except KvcError as e:
            if self.guard.up:
                log.warning("store: %s", e)
            self.counters.add(errors=1, misses=1)
            return None
        if r.status == 404:
            self.counters.add(misses=1)
            return None
        if r.status != 200:
            log.warning("store: kdn %s: get %s refused: HTTP %d", self.url, key, r.status)
            self.counters.add(errors=1, misses=1)
            return None
        body = r.body
        want = r.headers.get(H_CRC)
        if want is None or f"{crc32c(body):08x}" != want.strip().lower():
            log.warning("store: kdn %s: payload of %s fails its checksum (%s); a miss", self.url, key, want)
            self.counters.add(corrupt=1, misses=1)
            return None
        meta, created = _meta_of(r.headers)
        self.counters.add(hits=1)
        return Entry(key, body, meta, created)

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None,
            created: float | None = None) -> None:
        data = as_bytes(data)
        m = json.dumps(check_meta(meta, MAX_TIER_META), sort_keys=True, separators=(",", ":"))
        if len(m) > MAX_META_HEADER:
            raise KvcInputError(f"metadata of {len(m)} bytes is too large for the kdn service (max {MAX_META_HEADER})")
        try:
            status, _, body = self._request("PUT", entry_path(key), data, {
                "Content-Type": CONTENT_TYPE, H_META: m, H_CRC: f"{crc32c(data):08x}"}, timeout=self.put_timeout)
        except KvcStoreError:
            self.counters.add(put_errors=1)
            raise
        if status not in (200, 201, 204):
            self.counters.add(put_errors=1)
            raise self._refused(f"put {key}", status, body)
        self.counters.add(puts=1)

    def contains(self, key: StoreKey) -> bool:
        return self.contains_many([key])[0]

    def contains_many(self, keys: Iterable[StoreKey]) -> list[bool]:
        keys = list(keys)
        out: list[bool] = []
        for i in range(0, len(keys), MAX_CONTAINS):
            part = keys[i:i + MAX_CONTAINS]
            try:
                status, _, body = self._request(
                    "POST", CONTAINS, json.dumps({"keys": [k.to_str() for k in part]}).encode(),
                    {"Content-Type": "application/json"})
                if status != 200:
                    raise self._refused("contains", status, body)
                found = _loads(body, "contains answer")["found"]
                # JSON booleans only: bool() made the string "false" (or 1, or {}) a hit, so a lookup chose an
                # entry the server never said it had
                if not isinstance(found, list) or len(found) != len(part) or \
                        not all(isinstance(f, bool) for f in found):
                    raise KvcStoreError(f"kdn {self.url}: malformed contains answer (want a list of "
                                        f"{len(part)} JSON booleans)")
            except (KvcStoreError, KeyError, TypeError) as e:
                if not isinstance(e, KvcStoreError) or "unreachable" not in str(e):
                    log.warning("store: kdn %s: contains failed: %s", self.url, e)
                self.counters.add(errors=1)
                found = [False] * len(part)
            out.extend(f is True for f in found)
        return out

    def delete(self, key: StoreKey) -> bool:
        status, _, body = self._request("DELETE", entry_path(key))
        if status == 404:
            return False
        if status not in (200, 204):
            raise self._refused(f"delete {key}", status, body)
        return True

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        status, _, body = self._request("GET", f"{ENTRIES}?meta={int(with_meta)}")
        if status != 200:
            raise self._refused("ls", status, body)
        try:
            rows = _loads(body, "listing")["entries"]
            if not isinstance(rows, list):
                raise TypeError("entries is not a list")
            infos = [self._row(r, with_meta) for r in rows]
        except (ValueError, KeyError, TypeError, KvcInputError, KvcStoreError) as e:
            raise KvcStoreError(f"kdn {self.url}: malformed listing: {e}") from None
        yield from infos

    def _row(self, r: Any, with_meta: bool) -> EntryInfo:
        """One listing row, checked (a size of 1e999 escaped as OverflowError, -5, true or 1.5 were taken as sizes,
        a NaN or a string as an mtime, a list as a meta): ValueError / TypeError otherwise."""
        import math

        size, mtime, meta = r["size"], r.get("mtime"), r.get("meta") if with_meta else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise ValueError(f"size {size!r:.40} is not an integer >= 0")
        if mtime is not None and (not isinstance(mtime, (int, float)) or isinstance(mtime, bool)
                                  or not math.isfinite(mtime)):
            raise ValueError(f"mtime {mtime!r:.40} is not a finite number")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError("meta is not a JSON object")
        return EntryInfo(StoreKey.from_str(r["key"]), size, self.name, meta, mtime)

    def range_entry(self, key: StoreKey) -> tuple[HttpRangeReader, dict[str, Any]] | None:
        """``(range reader over the payload, meta)``: a HEAD, then ``Range`` + ``If-Range`` reads; None on 404."""
        r = self._fetch("HEAD", key)
        if r.status == 404:
            return None
        if r.status != 200:
            raise KvcStoreError(f"kdn {self.url}: head {key} refused: HTTP {r.status}")
        meta, _ = _meta_of(r.headers)
        return HttpRangeReader(self.base + entry_path(key), headers=self._headers(), limits=self.limits), meta

    def whoami(self) -> dict[str, Any]:
        """The tenant and namespaces the server maps this tier's token to."""
        status, _, body = self._request("GET", WHOAMI)
        if status != 200:
            raise self._refused("whoami", status, body)
        out = _loads(body, f"kdn {self.url}: whoami answer")
        if not isinstance(out, dict):
            raise KvcStoreError(f"kdn {self.url}: whoami answer is not a JSON object")
        return out


def _loads(body: bytes | str, what: str) -> Any:
    """JSON a server sent, or one :class:`KvcStoreError` line: malformed, or nested thousands deep (the decoder's
    RecursionError escaped from get, ls, contains and whoami as a traceback: a hostile server crashed its client)."""
    try:
        return json_loads(body)
    except ValueError as e:
        raise KvcStoreError(f"{what} is not JSON: {type(e).__name__}") from None


def _meta_of(headers: Any) -> tuple[dict[str, Any], float | None]:
    """An entry's metadata and creation time from its headers; malformed ones are none (the seal in the meta is
    then missing, so the Store refuses the entry)."""
    import math

    try:
        meta = _loads(headers.get(H_META) or "{}", "meta")
        created = float(headers.get(H_CREATED) or 0) or None
    except (KvcStoreError, ValueError):
        return {}, None
    if created is not None and not math.isfinite(created):
        created = None
    return (meta if isinstance(meta, dict) else {}), created


def _reason(body: bytes) -> str:
    """The server's one-line error message from a JSON error body (or the raw start of it)."""
    try:
        msg = _loads(body, "error").get("error")
        if isinstance(msg, str):
            return msg
    except (KvcStoreError, AttributeError):
        pass
    return body[:200].decode("utf-8", "replace").strip()
