"""The connection layer of ``kvc serve``: what happens before a request reaches a route.

aiohttp's :class:`~aiohttp.web.AppRunner` runs the application; two things
need the connection itself, below the routes and middlewares, so this module
gives the runner its own connection handler (:class:`KdnRequestHandler`):

* **connections in all** (``ServiceConfig.max_connections``, and at most :func:`descriptor_room`): past it a
  new connection is a one-line JSON ``503``, closed at once, like a connection over the per-peer cap below.
* **connections per peer** (``ServiceConfig.peer_connections``): one address
  may hold at most this many connections at once.  A connection over the cap
  is answered at once, before a byte of it is parsed, with a one-line JSON
  ``429`` and closed: no request handling, no body, no log line per refusal
  (they are counted in ``kvc_peer_refused_total``).  Why per address and not
  per tenant: a connection has no tenant until its head is parsed, and the
  cost we bound here (descriptors, parser state, slowloris heads) comes first.
* **answers that are not read** (``send_stall``, the service's ``body_idle_timeout``): while an answer waits
  for its client to read (the transport's buffer over its high-water mark), it must drain by at least
  :data:`STALL_PROGRESS` bytes every ``send_stall`` seconds, else the connection is aborted.  Why: aiohttp
  waits for a reader without end, so a client that asked for an entry and never read it held the entry's
  bytes, its connection and the handler for good (40 such GETs of one uncached entry: 40 copies).
* **a request head's size** (:data:`MAX_HEAD`, some 124 KiB: the 60 KiB metadata header and room for the
  rest): a one-line JSON ``431`` and the connection closed.  Why: aiohttp bounds each header line (62 KiB) and
  their count (128), not their sum, and holds a head whole until it ends: 200 connections of one address
  sending 6 MB heads took the service from 54 MB to 2.4 GB, a term of memory no limit counted.
* **a body's framing** (chunk sizes, chunk extensions, trailers): at most :data:`FRAMING_SLACK` bytes plus
  :data:`FRAMING_RATIO` per byte of body, else the body is refused (one-line JSON 400) and the connection's
  further bytes are never parsed.  Why: the parser reads and drops framing without end (an endless chunk
  extension, ``0000...`` as a chunk size) and without a byte of body, so the tenant's ingest rate and body
  limits never saw it: one tenant's connections held the event loop reading at line rate for their
  ``body_idle_timeout`` (64 of them: another tenant's requests went from under a millisecond to 190 ms).
* **malformed HTTP** (a bad request line, headers or framing, refused by
  aiohttp's parser before any route): the documented one-line JSON error
  (spec/kdn-v1.md §2) instead of aiohttp's plain text, and one rate-limited
  log line (:class:`~kvcodec.service.httputil.LogLimiter`), never a traceback.

:func:`run` serves until SIGINT or SIGTERM.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import signal
from typing import Any, Callable

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from kvcodec.kdn_protocol import MAX_META_HEADER
from kvcodec.service.checks import HttpError, error_line
from kvcodec.service.httputil import redact_credentials


ABUSIVE_HOLD = 1.0  # seconds a connection from an address far past its refusal rate waits before its 429
STALL_PROGRESS = 64 << 10  # bytes an unread answer must drain by each ``send_stall`` seconds (module docstring)
MAX_HEAD = MAX_META_HEADER + (64 << 10)  # bytes of a request head: the largest header we take, plus the rest
FRAMING_SLACK = 64 << 10  # a body's framing bytes allowed beyond FRAMING_RATIO per body byte (module docstring)
FRAMING_RATIO = 8  # chunks of one byte: "1\r\nx\r\n", 6 bytes on the wire per byte of body


def peer_key(addr: object) -> str:
    """The client a per-address limit counts: an IPv4 address, or an IPv6 address's /64 network.

    Why the /64: one IPv6 host or site holds a whole /64 (its privacy addresses rotate inside it, and any
    other is one ``ip addr add`` away), so a cap or throttle per IPv6 address bounded nothing: each new source
    address came with a fresh ``--peer-connections`` and a fresh refusal balance. An IPv4 address mapped into
    IPv6 (``::ffff:a.b.c.d``, a dual-stack listener's) counts as that IPv4 address."""
    if not addr:
        return "?"
    text = str(addr)
    try:
        ip = ipaddress.ip_address(text.split("%", 1)[0])  # a link-local address's zone (%eth0) is not the host
    except ValueError:
        return text
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return text


class PeerTable:
    """Open connections per peer address, capped (event loop only, no locks), and the addresses' refusal balance
    (``refusals``: the service's per-address throttle, charged here for HTTP the parser refuses)."""

    def __init__(self, cap: int, refusals: Any = None, total_cap: int = 1 << 30) -> None:
        self.cap = cap
        self.total_cap = total_cap  # connections at once, all addresses (``max_connections``, descriptors permitting)
        self.total = 0
        self.open: dict[str, int] = {}
        self.refused = 0
        self.refusals = refusals

    def full(self) -> bool:
        """As many connections open as the server takes, all addresses together."""
        return self.total >= self.total_cap

    def abusive(self, peer: str) -> bool:
        """Far past its refusal rate (a whole burst into debt): its new connections are refused unparsed."""
        r = self.refusals
        return r is not None and r.rate > 0 and r.balance(peer) < -r.burst

    def charge(self, peer: str) -> None:
        if self.refusals is not None:
            self.refusals.charge(peer, 1)

    def take(self, peer: str) -> bool:
        n = self.open.get(peer, 0)
        if n >= self.cap or self.full():
            self.refused += 1
            return False
        self.open[peer] = n + 1
        self.total += 1
        return True

    def give(self, peer: str) -> None:
        self.total -= 1
        n = self.open.get(peer, 0) - 1
        if n > 0:
            self.open[peer] = n
        else:
            self.open.pop(peer, None)


def _raw_json(status: int, reason: str, message: str, extra: str = "") -> bytes:
    body = json.dumps({"error": message}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json; charset=utf-8\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n{extra}\r\n").encode() + body


class KdnRequestHandler(RequestHandler):
    """aiohttp's connection handler plus the per-peer cap and JSON answers to malformed HTTP (module docstring)."""

    peers: PeerTable  # set on the class made by :func:`handler_class`
    send_stall: float = 15.0  # ditto: seconds an unread answer may make less than STALL_PROGRESS bytes of progress
    _kvc_stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._kvc_peer: str | None = peer_key(peer[0]) if isinstance(peer, (tuple, list)) and peer else "?"
        self._kvc_refused = False
        if self.peers.abusive(self._kvc_peer):
            # Held before its 429 (a timer, no CPU; counted against the address's connections, so at most
            # ``peer_connections`` wait at once): answered at once, a refused client just asks again, as fast as
            # it can open connections.
            self._kvc_refused = True
            if self.peers.take(self._kvc_peer):
                held, self._kvc_peer = self._kvc_peer, None
                msg = "your address keeps sending requests that are refused; retry later"
                asyncio.get_running_loop().call_later(ABUSIVE_HOLD, self._refuse, transport, msg, held)
            else:
                self._kvc_peer = None
                transport.close()
            return
        full = self.peers.full()
        if not self.peers.take(self._kvc_peer):
            self._kvc_peer = None
            self._kvc_refused = True
            if full:
                self._refuse(transport, "the server has too many connections open; retry later", status=503)
            else:
                self._refuse(transport, f"too many connections from your address at once (limit {self.peers.cap}); "
                                        "retry later")
            return
        super().connection_made(transport)

    def _refuse(self, transport: asyncio.BaseTransport, msg: str, held: str | None = None, status: int = 429) -> None:
        """A one-line JSON 429 (503: the server's cap) and the connection closed (aiohttp never saw it); ``held``:
        the address whose connection count it held."""
        reason = "Too Many Requests" if status == 429 else "Service Unavailable"
        try:
            if not transport.is_closing():
                transport.write(_raw_json(status, reason, msg, "Retry-After: 1\r\n"))  # type: ignore[attr-defined]
        finally:
            transport.close()
            if held is not None:
                self.peers.give(held)

    def data_received(self, data: bytes) -> None:
        """aiohttp's parsing, with what it does not bound bounded: a request head's size (MAX_HEAD) and a body's
        framing (FRAMING_SLACK, FRAMING_RATIO); module docstring."""
        if getattr(self, "_kvc_refused", False):  # a refused connection's bytes: never parsed
            return
        body = getattr(self, "_kvc_body", None)  # the body of the last request parsed, while it arrives
        in_body = body is not None and not body.is_eof()
        before = body.total_bytes if body is not None and in_body else 0
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a head is complete: next come its body, then the next head
            self._kvc_head = 0
            self._kvc_body = self._messages[-1][1] if self._messages else None
            self._kvc_framing = 0
        elif not in_body:
            self._kvc_head = getattr(self, "_kvc_head", 0) + len(data)
            if self._kvc_head > MAX_HEAD:
                self._kvc_too_large()
        elif body is not None and not body.is_eof():  # (complete: what else came is the next head)
            self._kvc_framing = getattr(self, "_kvc_framing", 0) + len(data) - (body.total_bytes - before)
            if self._kvc_framing > FRAMING_SLACK + FRAMING_RATIO * body.total_bytes:
                self._kvc_refused = True  # nothing more of this connection is parsed; it closes after the answer
                body.set_exception(HttpError(400, f"malformed HTTP request: the body's framing (chunk sizes, "
                                                  f"extensions, trailers) is over {FRAMING_RATIO} bytes per byte "
                                                  "of body"))

    def _kvc_too_large(self) -> None:
        """A request head over MAX_HEAD: a one-line JSON 431, the connection closed, the address charged."""
        self._kvc_refused = True
        t = self.transport
        peer = self._kvc_peer or "?"
        self.peers.charge(peer)
        self.logger.warning("431 from %s: request head larger than %d bytes", peer, MAX_HEAD)
        if t is None or t.is_closing():
            return
        if self._current_request is None:  # no answer of an earlier request being written on it
            t.write(_raw_json(431, "Request Header Fields Too Large",  # type: ignore[attr-defined]
                              f"request head larger than {MAX_HEAD} bytes"))
        t.close()

    def pause_writing(self) -> None:
        """The client is not reading as fast as we answer: from now on it must keep reading (module docstring)."""
        super().pause_writing()
        self._kvc_watch()

    def resume_writing(self) -> None:
        self._kvc_unwatch()
        super().resume_writing()

    def _kvc_watch(self) -> None:
        t = self.transport
        if t is not None and not t.is_closing():
            size = t.get_write_buffer_size()  # type: ignore[attr-defined]
            self._kvc_stall = asyncio.get_running_loop().call_later(self.send_stall, self._kvc_stalled, size)

    def _kvc_unwatch(self) -> None:
        if self._kvc_stall is not None:
            self._kvc_stall.cancel()
            self._kvc_stall = None

    def _kvc_stalled(self, size_then: int) -> None:
        self._kvc_stall = None
        t = self.transport
        if t is None or t.is_closing():
            return
        if size_then - t.get_write_buffer_size() >= STALL_PROGRESS:  # type: ignore[attr-defined]
            self._kvc_watch()  # slow, but reading
            return
        self.logger.warning("answer to %s not read for %g s: connection closed", self._kvc_peer or "?",
                            self.send_stall)
        t.abort()  # its buffered answer is dropped; the handler waiting to write it ends (connection lost)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._kvc_unwatch()
        peer = getattr(self, "_kvc_peer", None)
        if peer is None:  # refused in connection_made: aiohttp never saw this connection
            return
        self._kvc_peer = None
        self.peers.give(peer)
        super().connection_lost(exc)

    def stop_reading(self) -> None:
        """After this request's answer, close the connection without draining the rest of its body (aiohttp
        would read and drop it for ``lingering_time``): for a body refused for its size or pace, or a throttled
        tenant's large one, whose sender has already cost what it may."""
        self._lingering_time = 0.0

    def handle_error(self, request: BaseRequest, status: int = 500, exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        """aiohttp's answer to a request it could not parse (or a failure outside every middleware): one line
        of JSON, one rate-limited log line, the connection closed (its framing can no longer be trusted)."""
        if request.writer.output_size > 0:  # part of an answer is out already: only closing is left
            raise ConnectionError("the answer had started; closing the connection")
        # aiohttp's parser errors carry their one-line reason in ``message``
        what = str(getattr(exc, "message", "") or (error_line(exc) if exc is not None else message or "")).strip()
        what = redact_credentials(what)  # the parser quotes the request's bytes: never a token in the log or answer
        if status >= 500:
            text = "internal error"
        else:
            text = f"malformed HTTP request: {what or 'bad request'}"
        self.logger.warning("%s from %s: %s", status, request.remote or "?", what[:300])
        if status < 500:
            self.peers.charge(peer_key(request.remote))  # malformed HTTP: no tenant, the address pays
        resp = web.Response(status=status, text=json.dumps({"error": " ".join(text.split())[:1000]}),
                            content_type="application/json")
        resp.force_close()
        return resp


def _loop_error(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The event loop's own errors (a failed accept: out of descriptors) as one log line, never a traceback
    (asyncio's default handler printed one per try)."""
    exc = context.get("exception")
    what = error_line(exc) if isinstance(exc, BaseException) else ""
    logging.getLogger("kvcodec.service").warning("kdn: %s%s", context.get("message", "event loop error"),
                                                 f": {what}" if what else "")


def descriptor_room() -> int:
    """Connections the process's descriptor limit leaves room for: all but an eighth (at least 256) kept for the
    store's files and sockets, the workers' pipes and the listening socket. Why: past the limit, accepting failed
    (asyncio logged a traceback per try) and so did every tenant's store file opens, until the holders timed out."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 1 << 30
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(16, soft - max(256, soft // 8))


def handler_class(peers: PeerTable, send_stall: float = 15.0) -> type[KdnRequestHandler]:
    """A handler class bound to one service's peer table and unread-answer bound (aiohttp builds one handler per
    connection)."""
    return type("BoundKdnRequestHandler", (KdnRequestHandler,), {"peers": peers, "send_stall": send_stall})


class _Server(web.Server):
    """aiohttp's server, making :class:`KdnRequestHandler` connections."""

    handler_cls: type[KdnRequestHandler]

    def __call__(self) -> RequestHandler:
        return self.handler_cls(self, loop=self._loop, **self._kwargs)


class _Runner(web.AppRunner):
    def __init__(self, app: web.Application, handler_cls: type[KdnRequestHandler], **kw: Any) -> None:
        super().__init__(app, **kw)
        self._handler_cls = handler_cls

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # same server, our connection class: aiohttp offers no argument for it, so the class is swapped
        # (``_Server`` adds no state, only ``__call__``)
        server.__class__ = _Server
        server.handler_cls = self._handler_cls  # type: ignore[attr-defined]
        return server


def run(app: web.Application, peers: PeerTable, host: str, port: int,
        ready: Callable[[], None] | None = None, shutdown_timeout: float = 5.0, send_stall: float = 15.0) -> None:
    """Serve ``app`` on ``host:port`` until SIGINT or SIGTERM (then stop within ``shutdown_timeout``);
    ``send_stall``: the unread-answer bound (module docstring)."""

    peers.total_cap = min(peers.total_cap, descriptor_room())

    async def main() -> None:
        runner = _Runner(app, handler_class(peers, send_stall), access_log=None, shutdown_timeout=shutdown_timeout)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port).start()
            if ready is not None:
                ready()
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            loop.set_exception_handler(_loop_error)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await runner.cleanup()

    asyncio.run(main())


__all__ = ["KdnRequestHandler", "PeerTable", "descriptor_room", "handler_class", "peer_key", "run"]
