"""Random-access byte sources: local files and HTTP(S) objects read by ``Range``.

The ``.kvc`` reader only needs ``size`` and ``read(offset, length)``; it can
then read a header and the chunks it wants from a local file or from a plain
web server / CDN without downloading the whole object.

Guarantees of every :class:`RangeReader`:

* ``read(offset, length)`` returns exactly ``length`` bytes or raises;
* a range outside ``[0, size)`` or a source that delivers fewer bytes than
  asked (truncated file, short HTTP body) raises :class:`KvcFormatError`;
* transport failures (HTTP status >= 400, refused connection, timeout, a
  server ignoring ``Range``, an object that changed between requests) raise
  :class:`KvcStoreError` whose message names the status / cause;
* negative offsets or lengths raise :class:`KvcInputError`.

Every HTTP request (:func:`http_request`) has a connect timeout, a per-read
timeout and a total deadline enforced by a watchdog that shuts the socket
down (so a server trickling one byte at a time cannot hold a reader), and
a body cap: a ranged read accepts at most the bytes it asked for, and a
server that announces or sends more is refused.
"""

from __future__ import annotations

import os
import re
import socket
import stat
import threading
from dataclasses import dataclass
from email.message import Message
from http.client import HTTPConnection, HTTPException, HTTPSConnection, IncompleteRead
from typing import Any, Mapping
from urllib.parse import urlsplit

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.core.source import ByteSource
from kvcodec.limits import check_not_sparse

__all__ = ["RangeReader", "FileRangeReader", "HttpRangeReader", "BytesRangeReader", "open_range_reader",
           "HttpLimits", "http_request"]

_CONTENT_RANGE_RE = re.compile(r"\s*bytes\s+([0-9]{1,19})-([0-9]{1,19})/([0-9]{1,19}|\*)\s*", re.I | re.ASCII)


@dataclass(frozen=True)
class HttpLimits:
    """Time limits of one HTTP request, in seconds.

    ``connect``: TCP (+TLS) connect; ``read``: longest silence between two
    received pieces; ``total``: the whole request, headers and body included.
    """

    connect: float = 5.0
    read: float = 30.0
    total: float = 300.0

    def __post_init__(self) -> None:
        for k in ("connect", "read", "total"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise KvcInputError(f"http {k} timeout must be in (0, 86400] seconds, got {v!r}")


@dataclass
class HttpResponse:
    status: int
    headers: Message
    body: bytes


_BODY_STATUSES = (200, 206)


def http_request(url: str, *, method: str = "GET", headers: Mapping[str, str] | None = None,
                 limits: HttpLimits = HttpLimits(), max_body: int = 0,
                 body_statuses: tuple[int, ...] = _BODY_STATUSES, body: bytes | None = None) -> HttpResponse:
    """One HTTP(S) request with bounded time and a bounded body.

    ``body`` is sent with the request (a PUT's payload, a POST's JSON). The answer's body is read only for
    ``body_statuses`` answers to any method but HEAD, and never beyond
    ``max_body`` bytes: a ``Content-Length`` above it, more bytes than it or a
    compressed body raise :class:`KvcStoreError`; a body cut short raises
    :class:`KvcFormatError`.  Redirects are not followed.
    """
    p = urlsplit(url)
    try:
        host, port = p.hostname, p.port
    except ValueError as e:
        raise KvcInputError(f"bad URL {ascii(url)}: {e}") from None
    if p.scheme not in ("http", "https") or not host:
        raise KvcInputError(f"not an http(s) URL: {ascii(url)}")
    if "@" in p.netloc:  # http.client sends no Authorization from them, and every message would show them
        raise KvcInputError(f"credentials in an http(s) URL are not sent; give them as a header: "
                            f"{ascii(p.scheme + '://***@' + p.netloc.rpartition('@')[2] + p.path)}")
    target = (p.path or "/") + (f"?{p.query}" if p.query else "")
    cls = HTTPSConnection if p.scheme == "https" else HTTPConnection
    conn = cls(host, port, timeout=limits.connect)
    fired = threading.Event()
    held: list[socket.socket] = []  # http.client drops conn.sock when the response owns the socket

    def abort() -> None:  # the total deadline: unblock whatever recv/connect is waiting
        fired.set()
        for sock in held or ([conn.sock] if conn.sock is not None else []):
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    watchdog = threading.Timer(limits.total, abort)
    watchdog.daemon = True
    watchdog.start()
    late = f"{url}: no complete answer within the {limits.total:g} s deadline"
    try:
        try:
            conn.connect()
            held.append(conn.sock)
            conn.sock.settimeout(limits.read)
            if fired.is_set():  # the deadline passed during connect, before the socket was held
                raise KvcStoreError(late)
            conn.request(method, target, body=body, headers={"Accept-Encoding": "identity", **(headers or {})})
            resp = conn.getresponse()
            status, hdrs = resp.status, resp.headers
            if method == "HEAD" or status not in body_statuses:
                return HttpResponse(status, hdrs, b"")
            enc = (hdrs.get("Content-Encoding") or "identity").strip().lower()
            if enc != "identity":
                raise KvcStoreError(f"{url}: server sent a {enc!r}-encoded body though identity was asked")
            cl = hdrs.get("Content-Length")
            if cl is not None:
                if not re.fullmatch(r"[0-9]{1,19}", cl.strip()):
                    raise KvcStoreError(f"{url}: bad Content-Length {ascii(cl[:40])}")
                if int(cl) > max_body:
                    raise KvcStoreError(f"{url}: server announces {int(cl):,} body bytes, "
                                        f"more than the {max_body:,} asked for; refused")
            buf = bytearray()
            while True:
                piece = resp.read(min(1 << 20, max_body + 1 - len(buf)))
                if fired.is_set():
                    raise KvcStoreError(late)
                if not piece:
                    break
                buf += piece
                if len(buf) > max_body:
                    raise KvcStoreError(f"{url}: server sent more than the {max_body:,} body bytes "
                                        "asked for; refused")
            return HttpResponse(status, hdrs, bytes(buf))
        except IncompleteRead as e:
            if fired.is_set():
                raise KvcStoreError(late) from None
            raise KvcFormatError(f"{url}: short read: connection closed after {len(e.partial)} of "
                                 f"{len(e.partial) + (e.expected or 0)} body bytes") from None
        except (HTTPException, OSError) as e:
            if fired.is_set():
                raise KvcStoreError(late) from None
            if isinstance(e, (ConnectionRefusedError, socket.gaierror)) or conn.sock is None:
                raise KvcStoreError(f"{url}: cannot connect: {e}") from None
            if isinstance(e, (socket.timeout, TimeoutError)):
                raise KvcStoreError(f"{url}: no data for {limits.read:g} s (read timeout)") from None
            raise KvcStoreError(f"{url}: transfer failed: {type(e).__name__}: {e}") from None
    finally:
        watchdog.cancel()
        conn.close()


class RangeReader(ByteSource):
    """Abstract random-access reader: the container's :class:`~kvcodec.core.source.ByteSource`
    (``size``, ``read(offset, length)``, one error contract); subclasses implement ``_read``.

    Use :meth:`open` (or :func:`open_range_reader`) to get a reader for a
    local path, ``file://`` URL or ``http(s)://`` URL.  Readers are context
    managers.  ``base``/``length`` arguments of the concrete classes expose a
    window of the underlying object as if it were the whole object.
    """

    size: int = 0
    name: str = "?"

    @staticmethod
    def open(source: str | os.PathLike[str], **kwargs: Any) -> "RangeReader":
        return open_range_reader(source, **kwargs)

    def read(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes starting at ``offset`` (as ``bytes``; the checks are ByteSource's)."""
        data = super().read(offset, length)
        return data if isinstance(data, bytes) else bytes(data)

    def __enter__(self) -> "RangeReader":
        return self


class BytesRangeReader(RangeReader):
    """A reader over bytes already in memory (tests, in-memory store entries)."""

    def __init__(self, data: bytes | bytearray | memoryview, name: str = "<bytes>") -> None:
        self._buf = memoryview(bytes(data))
        self.size = len(self._buf)
        self.name = name

    def _read(self, offset: int, length: int) -> bytes:
        return bytes(self._buf[offset:offset + length])


class FileRangeReader(RangeReader):
    """Positional reads (``os.pread``) from a local file; thread-safe.

    ``base``/``length`` select a window of the file (default: all of it).
    ``size`` is fixed at open; if the file shrinks later, reads raise
    :class:`KvcFormatError` (short read).
    """

    def __init__(self, path: str | os.PathLike[str], base: int = 0, length: int | None = None, *,
                 follow_symlinks: bool = True, dir_fd: int | None = None) -> None:
        """``follow_symlinks=False``: a symlink at ``path`` is refused (a store's entry is never one).
        ``dir_fd``: ``path``'s file is the one of its name in that open directory (a store's entry is opened
        where the store checked its directories, never through a symlink swapped in above it).

        The file is opened without blocking and checked on its descriptor: a FIFO at ``path`` held the open
        until some writer appeared (for ever), and a device node is not a file of known size."""
        self.name = os.fspath(path)
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
        if not follow_symlinks:
            flags |= getattr(os, "O_NOFOLLOW", 0)
        try:
            self._fd: int | None = os.open(self.name if dir_fd is None else os.path.basename(self.name), flags,
                                           dir_fd=dir_fd)
        except FileNotFoundError:
            raise KvcStoreError(f"{self.name}: no such file") from None
        except OSError as e:
            raise KvcStoreError(f"{self.name}: cannot open: {e.strerror or e}") from None
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            self.close()
            raise KvcStoreError(f"{self.name}: not a regular file; refusing to read it")
        try:
            check_not_sparse(st, self.name, "a store entry", self._fd)
        except KvcFormatError:
            self.close()
            raise
        total = st.st_size
        if base < 0 or base > total:
            self.close()
            raise KvcFormatError(f"{self.name}: window base {base} outside file of {total} bytes")
        if length is None:
            length = total - base
        if length < 0 or base + length > total:
            self.close()
            raise KvcFormatError(
                f"{self.name}: window {base}+{length} exceeds file of {total} bytes (truncated?)"
            )
        self.base = base
        self.size = length

    def _read(self, offset: int, length: int) -> bytes:
        if self._fd is None:
            raise KvcStoreError(f"{self.name}: reader is closed")
        pos = self.base + offset
        parts = []
        got = 0
        while got < length:
            try:
                b = os.pread(self._fd, length - got, pos + got)
            except OSError as e:
                raise KvcStoreError(f"{self.name}: read failed: {e.strerror or e}") from None
            if not b:
                break
            parts.append(b)
            got += len(b)
        return b"".join(parts)

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.close()
        except Exception:
            pass


class HttpRangeReader(RangeReader):
    """Read an object on an HTTP(S) server piecewise with ``Range`` requests.

    Uses :func:`http_request` (connect/read/total limits, body capped at the
    range asked for).  At open it sends ``Range: bytes=0-0`` to learn the
    size (from ``Content-Range``) and the validator (``ETag`` or
    ``Last-Modified``); later requests carry ``If-Range`` so that an object
    replaced on the server mid-read is detected (the server then answers 200
    and this raises :class:`KvcStoreError`) instead of mixing two versions.
    A server that ignores ``Range`` (answers 200 to a ranged request) is
    refused with :class:`KvcStoreError`.
    """

    def __init__(
        self,
        url: str,
        *,
        timeout: float = 30.0,
        headers: Mapping[str, str] | None = None,
        base: int = 0,
        length: int | None = None,
        limits: HttpLimits | None = None,
    ) -> None:
        """``timeout`` is the read timeout; ``limits`` (if given) sets all three limits."""
        if not url.lower().startswith(("http://", "https://")):
            raise KvcInputError(f"not an http(s) URL: {ascii(url)}")
        self.url = url
        self.name = url
        self.limits = limits or HttpLimits(connect=min(5.0, float(timeout)), read=float(timeout))
        self._headers = dict(headers or {})
        self._validator: str | None = None
        self.requests = 0
        self.bytes_fetched = 0
        total = self._probe()
        if base < 0 or base > total:
            raise KvcFormatError(f"{url}: window base {base} outside object of {total} bytes")
        if length is None:
            length = total - base
        if length < 0 or base + length > total:
            raise KvcFormatError(f"{url}: window {base}+{length} exceeds object of {total} bytes (truncated?)")
        self.total_size = total
        self.base = base
        self.size = length

    # -- HTTP plumbing ------------------------------------------------------
    def _request(self, first: int, last: int, probe: bool = False) -> tuple[int, Mapping[str, str], bytes]:
        hdrs = {"Range": f"bytes={first}-{last}", **self._headers}
        if self._validator:
            hdrs["If-Range"] = self._validator
        self.requests += 1
        r = http_request(self.url, headers=hdrs, limits=self.limits, max_body=last - first + 1,
                         body_statuses=(206,))  # a 200 to a ranged GET is refused unread
        if r.status == 416:
            if probe and (r.headers.get("Content-Range") or "").strip() == "bytes */0":
                return 416, r.headers, b""  # an empty object: bytes 0-0 cannot be satisfied
            raise KvcFormatError(
                f"{self.url}: HTTP 416 range bytes={first}-{last} not satisfiable (object truncated?)")
        if r.status >= 300 and r.status not in _BODY_STATUSES:
            raise KvcStoreError(f"{self.url}: HTTP {r.status} {_reason(r.status)}")
        self.bytes_fetched += len(r.body)
        return r.status, r.headers, r.body

    def _parse_content_range(self, headers: Mapping[str, str]) -> tuple[int, int, int | None]:
        cr = headers.get("Content-Range")
        m = _CONTENT_RANGE_RE.fullmatch(cr or "")
        if not m:
            raise KvcStoreError(f"{self.url}: 206 response with bad Content-Range {ascii((cr or '')[:80])}")
        total = None if m.group(3) == "*" else int(m.group(3))
        return int(m.group(1)), int(m.group(2)), total

    def _probe(self) -> int:
        status, headers, body = self._request(0, 0, probe=True)
        if status == 416:
            return 0
        if status == 206:
            first, last, total = self._parse_content_range(headers)
            if total is None:
                raise KvcStoreError(f"{self.url}: server does not report the object size")
        elif status == 200 and headers.get("Content-Length") == "0" and not body:
            return 0  # an empty object (nginx answers 200, not 416, for it)
        elif status == 200:
            raise KvcStoreError(
                f"{self.url}: server ignored the Range request (HTTP 200); "
                "piecewise reads need a server with byte-range support"
            )
        else:
            raise KvcStoreError(f"{self.url}: unexpected HTTP {status} to a range request")
        etag = headers.get("ETag")
        if etag and not etag.startswith("W/"):
            self._validator = etag
        else:
            self._validator = headers.get("Last-Modified")
        return total

    def _read(self, offset: int, length: int) -> bytes:
        first = self.base + offset
        last = first + length - 1
        status, headers, body = self._request(first, last)
        if status == 200:
            raise KvcStoreError(
                f"{self.url}: object changed on the server during the read (If-Range failed) "
                "or the server stopped honouring Range"
            )
        if status != 206:
            raise KvcStoreError(f"{self.url}: unexpected HTTP {status} to a range request")
        r_first, r_last, total = self._parse_content_range(headers)
        if total is not None and total != self.total_size:
            raise KvcStoreError(f"{self.url}: object size changed from {self.total_size} to {total}")
        if r_first != first:
            raise KvcStoreError(f"{self.url}: asked bytes {first}-{last}, server sent {r_first}-{r_last}")
        if r_last < last or len(body) < length:
            raise KvcFormatError(
                f"{self.url}: short read at offset {offset}: wanted {length} bytes, got {len(body)}"
            )
        return body[:length]


def _reason(status: int) -> str:
    from http import HTTPStatus

    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


def open_range_reader(source: str | os.PathLike[str], **kwargs: Any) -> RangeReader:
    """A reader for a local path, ``file://`` URL or ``http(s)://`` URL."""
    s = os.fspath(source)
    low = s.lower()
    if low.startswith(("http://", "https://")):
        return HttpRangeReader(s, **kwargs)
    if low.startswith("file://"):
        from urllib.parse import unquote, urlparse

        p = urlparse(s)
        if p.netloc not in ("", "localhost"):
            raise KvcInputError(f"file URL with a remote host is not supported: {s!r}")
        s = unquote(p.path)
    elif "://" in s:
        raise KvcInputError(f"unsupported range source {s!r}: use a path, file:// or http(s)://")
    return FileRangeReader(s, **kwargs)
