"""Admission of the KDN service's requests: who may ask, how much, and how fast (issue 35; spec/kdn-v1.md §5).

Why a module of its own: everything here bounds work before and around a route's own logic -- authentication
and the refusal throttles, the request's deadline, body reading against the tenant's and the server's budgets
and ingest rate, and the fair pools that run a request's store calls (threads) and checks (worker processes) --
and none of it knows what a route does.  The routes (:class:`kvcodec.service.app.KdnService`, which inherits
:class:`Admission`) and the edit route (:mod:`kvcodec.service.edit`) call these helpers; the module docstring of
:mod:`kvcodec.service.app` lists the bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from aiohttp import web

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcQuotaError, KvcStoreError
from kvcodec.kdn_protocol import API
from kvcodec.service.auth import Principal, TokenTable
from kvcodec.service.checks import HttpError, error_line, parse_json
from kvcodec.service.config import (
    DRAIN_MAX,
    INLINE_JSON,
    MAX_THROTTLED,
    PEER_KEYS,
    PROBE_SLICE,
    REFUSAL_BODY_UNIT,
    SERVICE_CPU_WEIGHT,
    STORE_TURN_COST,
    THROTTLE_HOLD,
    WORKER_BASE,
    ServiceConfig,
)
from kvcodec.service.fair import FairScheduler, Overloaded, TokenBucket
from kvcodec.service.httputil import LogLimiter, json_reply
from kvcodec.service.metrics import Metrics
from kvcodec.service.server import KdnRequestHandler, PeerTable, peer_key
from kvcodec.service.workers import WorkerPool
from kvcodec.store import Store, StoreKey

log = logging.getLogger("kvcodec.service")

# a request key (typed Any: aiohttp types request keys as RequestKey, new in 3.12; the floor is aiohttp 3.9)
PRINCIPAL: Any = web.AppKey("principal", Principal)
DEADLINE = "kvc.deadline"
STOP = "kvc.stop_reading"  # set: the answer closes the connection without draining the body (server.py)
HELD = "kvc.body_held"  # (tenant, bytes) of the request's body, charged to the body budget until its answer
EXPECT = "kvc.expect_continue"  # True: the client waits for "100 Continue" before its body; "sent" once it has it

__all__ = ["Admission", "BodyBudget", "PRINCIPAL", "DEADLINE", "STOP", "HELD", "EXPECT", "expect_continue"]


async def expect_continue(request: web.Request) -> web.StreamResponse | None:
    """Every route's ``Expect`` handler (aiohttp runs it before the middlewares). ``100-continue`` is only noted
    here and acknowledged by :meth:`Admission._read_body` once authentication and every check before the body
    have passed; any other expectation is a one-line JSON 417.

    Why: aiohttp's own handler sent ``100 Continue`` at once, so a client with a bad token, a read-only token or a
    body over the limit was invited to send it (curl asks before any upload over 1 MiB), and its 401/403/413 came
    only after we had read and dropped its body for ``LINGER``; and an unknown expectation was answered in
    plain text, echoing the header."""
    if request.version < (1, 1):  # HTTP/1.0 has no 100 Continue (RFC 9110 §10.1.1): ignore the header
        return None
    if request.headers.get("Expect", "").strip().lower() == "100-continue":
        request[EXPECT] = True
        return None
    resp = json_reply({"error": "unsupported Expect header (only 100-continue)"}, 417)
    resp.force_close()
    return resp


class Admission:
    """The bounded-work half of :class:`kvcodec.service.app.KdnService`: its limits' state, its middlewares and
    the helpers through which its routes read bodies, run store calls and worker jobs."""

    tokens: TokenTable  # the service's token table (set by KdnService)

    def __init__(self, config: ServiceConfig, tokenizer_dirs: dict[str, str]) -> None:
        """``config``: already checked; ``tokenizer_dirs``: fingerprint id -> model directory, for the workers."""
        self.config = config
        c = config
        self.metrics = Metrics()
        self.workers = WorkerPool(c.workers, per_tenant=c.tenant_workers, max_queued=c.tenant_queue,
                                  queue_timeout=c.queue_timeout, tokenizers=tokenizer_dirs,
                                  memory=c.worker_memory, base=WORKER_BASE, tenant_cpu=c.tenant_worker_cpu)
        self.decode_quota = TokenBucket(c.tenant_decode_rate, c.max_decoded_bytes)
        # body bytes read per tenant: receiving, checksumming and storing bodies is the event loop's and the store
        # threads' work, which no worker share bounds (a tenant's large valid puts took half a core that way)
        self.ingest = TokenBucket(c.tenant_ingest_rate, max(c.tenant_ingest_rate, 1 << 20))  # burst: one second
        self._io = ThreadPoolExecutor(c.store_threads, thread_name_prefix="kvc-store")
        self.io_sched = FairScheduler(c.store_threads, c.tenant_store_threads, max_queued=256, name="store thread")
        # model work of edits (kvcodec.service.edit): one at a time in the service, round-robin between tenants
        self.edit_sched = FairScheduler(1, 1, max_queued=c.tenant_queue, name="model edit")
        self.bodies = BodyBudget(c.max_inflight_body, c.tenant_inflight_body)
        self.bad = LogLimiter(c.log_rate)
        # a tenant whose requests keep being refused (4xx) is answered 429 before any body is read or work done
        self.refusals = TokenBucket(c.tenant_refusal_rate, 5 * c.tenant_refusal_rate)
        self.throttled = 0  # requests being held back before their 429 (at most MAX_THROTTLED)
        # a client address whose requests keep failing authentication (or parsing) is throttled the same way: no
        # tenant to charge them to. Bounded: an attacker with many addresses cannot grow the table
        self.peer_refusals = TokenBucket(c.peer_refusal_rate, 5 * c.peer_refusal_rate, max_keys=PEER_KEYS)
        self.peers = PeerTable(c.peer_connections, self.peer_refusals,  # the connection layer's (service.server)
                               total_cap=c.max_connections)

    async def _start(self, app: web.Application) -> None:
        await self.workers.start()
        log.info("kdn: %d worker processes (pids %s)", self.workers.n, self.workers.pids())

    async def _close_pools(self) -> None:
        await self.workers.close()
        self._io.shutdown(wait=False, cancel_futures=True)

    # -- middlewares ----------------------------------------------------------------
    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        t0 = time.perf_counter()
        request[DEADLINE] = time.monotonic() + self.config.request_timeout
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        detail = ""
        held = None
        try:
            resp = await handler(request)
        except HttpError as e:
            resp, detail = json_reply({"error": str(e)}, e.status, e.headers), str(e)
        except Overloaded as e:
            self.metrics.overloaded(str(e.status))
            resp, detail = json_reply({"error": str(e)}, e.status, {"Retry-After": f"{e.retry_after:.0f}"}), str(e)
        except web.HTTPException as e:  # aiohttp's own: 404 no route, 405, 413 body too large
            if e.status == 413:
                msg = f"request body larger than the limit of {self.config.max_body} bytes"
            else:
                msg = e.reason
            resp, detail = json_reply({"error": msg}, e.status, {k: v for k, v in e.headers.items() if k in ("Allow",)}), msg
        except KvcInputError as e:
            resp, detail = json_reply({"error": error_line(e)}, 400), error_line(e)
        except KvcFormatError as e:
            resp, detail = json_reply({"error": error_line(e)}, 422), error_line(e)
        except KvcQuotaError as e:  # the tenant's own bound: no retry helps until it frees space
            resp, detail = json_reply({"error": error_line(e)}, 507), error_line(e)
        except KvcStoreError as e:
            resp, detail = json_reply({"error": error_line(e)}, 503), error_line(e)
        except KvcError as e:
            resp, detail = json_reply({"error": error_line(e)}, 422), error_line(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # our bug, or a library's failure mode on hostile input: one line, no traceback
            detail = error_line(e)
            resp = json_reply({"error": f"internal error: {type(e).__name__}"}, 500)
        finally:
            held = request.pop(HELD, None)
            if held is not None:
                self.bodies.give(*held)
        if request.get(EXPECT) is True and request.body_exists:  # refused before its body was invited: it never
            request[STOP] = True  # comes, and is not waited for (RFC 9110 §10.1.1: answer, then close)
        if request.get(STOP):
            resp.force_close()
            if isinstance(request.protocol, KdnRequestHandler):
                request.protocol.stop_reading()
        self.metrics.request(request.method, route, resp.status, time.perf_counter() - t0)
        if 400 <= resp.status < 500 and resp.status not in (404, 412, 416, 429) and PRINCIPAL in request:
            # a refusal that made us read a large body costs its tenant more than one that did not
            read = held[1] if held is not None else 0
            self.refusals.charge(request[PRINCIPAL].tenant, 1 + read / REFUSAL_BODY_UNIT)
        if resp.status >= 400 and resp.status not in (404, 412, 416):
            peer = request.remote or "?"
            self.bad.line(logging.ERROR if resp.status >= 500 else logging.WARNING,
                          f"kdn: {resp.status} {request.method} {route} from {peer}: {detail[:300]}")
        return resp

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        if request.path.startswith(API + "/"):
            hs = request.headers.getall("Authorization", [])
            # two are ambiguous (aiohttp's .get took the first; a proxy in front may have checked the last): neither
            # is used, the request is a 400 below
            h = hs[0] if len(hs) == 1 else ""
            scheme, _, tok = h.partition(" ")
            tok = tok.strip()
            given = scheme.lower() == "bearer" and bool(tok)
            p = self.tokens.lookup(tok) if given else None
            if p is None:
                # no tenant to charge: the client address pays, and one that keeps failing gets its 401s held back
                peer = peer_key(request.remote)
                await self._throttle(request, self.peer_refusals, peer, self.config.peer_refusal_rate,
                                     f"your address had more than {self.config.peer_refusal_rate:g} unauthenticated "
                                     "requests a second refused; retry later")
                self.peer_refusals.charge(peer, 1)
                if len(hs) > 1:
                    self.metrics.auth_failure("ambiguous")
                    raise HttpError(400, f"{len(hs)} Authorization headers: send one")
                if not given:
                    self.metrics.auth_failure("missing")
                    raise HttpError(401, "missing bearer token (Authorization: Bearer <token>)",
                                    {"WWW-Authenticate": 'Bearer realm="kvc"'})
                self.metrics.auth_failure("invalid")
                raise HttpError(401, "invalid token", {"WWW-Authenticate": 'Bearer realm="kvc", error="invalid_token"'})
            request[PRINCIPAL] = p
            await self._throttle(request, self.refusals, p.tenant, self.config.tenant_refusal_rate,
                                 f"tenant {p.tenant!r} had more than {self.config.tenant_refusal_rate:g} requests a "
                                 "second refused; retry later")
        return await handler(request)

    async def _throttle(self, request: web.Request, bucket: TokenBucket, who: str, rate: float, message: str) -> None:
        """A 429 for ``who`` (a tenant, or a client address) while its refusal balance is under one, held back
        first (a sleeping coroutine: no CPU, no body read), so a client that keeps sending refused requests gets
        its answers at a bounded rate rather than as fast as it can ask."""
        if rate <= 0 or bucket.balance(who) >= 1:
            return
        wait = (1 - bucket.balance(who)) / rate
        n = request.content_length
        if request.body_exists and (n is None or n > DRAIN_MAX):
            request[STOP] = True  # its body is not worth draining for a 429
        if self.throttled < MAX_THROTTLED:
            self.throttled += 1
            try:
                await asyncio.sleep(min(wait, THROTTLE_HOLD))
            finally:
                self.throttled -= 1
        raise Overloaded(429, message, retry_after=(1 - bucket.balance(who)) / rate)

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _left(request: web.Request) -> float:
        left = request[DEADLINE] - time.monotonic()
        if left <= 0:
            raise HttpError(504, "the request's deadline passed")
        return left

    async def _run(self, request: web.Request, fn: Callable[..., Any], *args: Any,
                   timeout: float | None = None, on_done: Callable[[], None] | None = None, charge: bool = True) -> Any:
        """A blocking store call in a thread of the store pool (fair between tenants), with a deadline.
        ``on_done``: called on the event loop when the call really ends (or at once if it never started).
        ``charge``: the thread's CPU time is charged to the tenant's CPU share (``--tenant-worker-cpu``; weighted:
        SERVICE_CPU_WEIGHT, STORE_TURN_COST), which paces its next worker job and key-probe turn. Why: a large
        lookup's candidate keys are built and probed here, in the service process, and without the charge that
        part of a tenant's work had no bound (issue 35, the lookups class). Loading a model for an edit passes
        False (:func:`kvcodec.service.edit._model_work`)."""
        tenant = request[PRINCIPAL].tenant if PRINCIPAL in request else "-"
        limit = min(timeout or self.config.op_timeout, self._left(request))
        deadline = time.monotonic() + limit
        try:
            await self.io_sched.acquire(tenant, min(deadline, time.monotonic() + self.config.queue_timeout))
        except BaseException:
            if on_done is not None:
                on_done()
            raise
        used = [0.0]

        def timed(*a: Any) -> Any:
            t0 = time.thread_time()
            try:
                return fn(*a)
            finally:
                used[0] = time.thread_time() - t0

        fut = asyncio.get_running_loop().run_in_executor(self._io, timed, *args)

        def finished(_f: Any) -> None:  # the thread cannot be stopped: its slot is freed when it really ends
            self.io_sched.release(tenant)
            if charge and tenant != "-":
                self.workers.cpu.charge(tenant, SERVICE_CPU_WEIGHT * used[0] + STORE_TURN_COST)
            if on_done is not None:
                on_done()

        fut.add_done_callback(finished)
        try:
            return await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
        except asyncio.TimeoutError:
            raise HttpError(504, f"store operation took longer than {limit:g} s") from None

    async def _probe(self, request: web.Request, st: Store, keys: list[Any],
                     allow: Callable[[StoreKey], None] | None = None) -> tuple[list[StoreKey], list[bool]]:
        """``(keys, found)``: ``keys`` (StoreKeys, or key strings -- a worker's, or an inline body's with only its
        shape checked -- parsed here) and whether each has an entry, in store-thread calls of at most PROBE_SLICE
        keys each.  ``allow`` (raises to refuse) sees each key
        before it is probed; a refusal ends the request, so nothing probed before it is answered.  Why slices: a
        large lookup's keys are parsed and named (HMAC) in Python, which held the GIL for milliseconds at a stretch,
        and every other request's event-loop and store-thread steps waited behind it: that alone doubled the honest
        clients' p99 (issue 35); in short turns they interleave.  Each turn first waits while the tenant is over its
        CPU share (:meth:`WorkerPool.pace`, a 429 past the request's queue deadline): a key list small enough to
        be parsed on the event loop takes no worker job, and without this it was the one tenant work never paced."""
        tenant = request[PRINCIPAL].tenant
        parsed: list[StoreKey] = []
        found: list[bool] = []
        for i in range(0, len(keys), PROBE_SLICE):
            await self.workers.pace(tenant, min(request[DEADLINE], time.monotonic() + self.config.queue_timeout))
            ks, f = await self._run(request, _parse_probe, st, keys[i:i + PROBE_SLICE], allow)
            parsed += ks
            found += f
        return parsed, found

    async def _read_body(self, request: web.Request, limit: int, what: str = "request body") -> bytes:
        """The body, whatever its framing: capped on the bytes read, each piece within ``body_idle_timeout``,
        the whole within ``body_timeout``, counted against the tenant's and the server's in-flight budget."""
        c = self.config
        if request.content_length is not None and request.content_length > limit:  # drained like any refusal
            raise HttpError(413, f"{what} of {request.content_length} bytes is larger than the limit of {limit}")
        tenant = request[PRINCIPAL].tenant if PRINCIPAL in request else "-"
        if request.get(EXPECT) is True:  # every check before the body passed: now the client may send it
            request[EXPECT] = "sent"
            await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            request.writer.output_size = 0  # not the answer: the answer has not started (as aiohttp's own handler)
        end = time.monotonic() + min(c.body_timeout, self._left(request))
        buf = bytearray()
        held = 0
        # each piece stays charged to the budget until the answer (the errors middleware gives it back); a body
        # refused for its size or pace is not drained afterwards
        request[STOP] = True
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise HttpError(408, f"{what} not received within {c.body_timeout:g} s")
            try:
                piece = await asyncio.wait_for(request.content.readany(), min(left, c.body_idle_timeout))
            except asyncio.TimeoutError:
                if left <= c.body_idle_timeout:
                    raise HttpError(408, f"{what} not received within {c.body_timeout:g} s") from None
                raise HttpError(408, f"{what}: no byte received for {c.body_idle_timeout:g} s") from None
            if not piece:
                break
            if len(buf) + len(piece) > limit:
                raise HttpError(413, f"{what} larger than the limit of {limit} bytes")
            self.bodies.take(tenant, len(piece))
            held += len(piece)
            request[HELD] = (tenant, held)
            buf += piece
            self.ingest.charge(tenant, len(piece))
            debt = -self.ingest.balance(tenant)
            if debt > 0:  # over its ingest rate: read its body more slowly (not reading lets TCP push back)
                await asyncio.sleep(min(debt / self.ingest.rate, max(0.0, end - time.monotonic())))
        request[STOP] = False
        return bytes(buf)

    async def _json_body(self, request: web.Request) -> tuple[bytes, dict[str, Any] | None]:
        """``(raw, parsed)``: small bodies parsed here, larger ones left (``None``) for a worker."""
        c = self.config
        limit, what = c.max_json_body, "JSON body"
        if request.content_length is None and c.max_chunked_json < limit:
            # Why a smaller cap: a body of unknown length is refused only once it is read, and a lookup is built in
            # memory, so its client knows the length; with Content-Length the limit is checked before any byte
            limit = c.max_chunked_json
            what = f"JSON body sent without Content-Length (send Content-Length for up to {c.max_json_body} bytes)"
        raw = await self._read_body(request, limit, what)
        if len(raw) <= INLINE_JSON:
            return raw, parse_json(raw)
        return raw, None

    async def _job(self, p: Principal, deadline: float, header: dict[str, Any], payload: bytes = b"",
                   decide: Callable[[dict[str, Any]], bool] | None = None, what: str = "job") -> dict[str, Any]:
        """One worker-process job for ``p``'s tenant (fair share, queue limit, deadline), counted by kind."""
        op = str(header.get("op"))
        try:
            rep = await self.workers.run(p.tenant, deadline, header, payload, decide=decide, what=what)
        except Overloaded:
            self.metrics.job(op, "overloaded")
            raise
        except HttpError as e:
            self.metrics.job(op, "timeout" if e.status == 504 else "refused")
            raise
        self.metrics.job(op, "ok")
        return rep


def _parse_probe(st: Store, keys: list[Any], allow: Callable[[StoreKey], None] | None
                 ) -> tuple[list[StoreKey], list[bool]]:
    ks = [k if isinstance(k, StoreKey) else StoreKey.from_str(k) for k in keys]
    if allow is not None:
        for k in ks:
            allow(k)
    return ks, st.contains_many(ks)


class BodyBudget:
    """Body bytes held at once, per tenant and in all (event loop only): request bodies being received and entries'
    answers being sent (:meth:`kvcodec.service.app.KdnService._send`)."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.used = 0
        self._by: dict[str, int] = {}

    def take(self, tenant: str, n: int) -> None:
        mine = self._by.get(tenant, 0)
        if mine + n > self.per_tenant:
            raise Overloaded(429, f"tenant's bodies (sent and received) would be more than {self.per_tenant} bytes "
                                  "at once; retry later")
        if self.used + n > self.total:
            raise Overloaded(503, "the server is holding too many bodies (sent and received) at once; retry later")
        self._by[tenant] = mine + n
        self.used += n

    def give(self, tenant: str, n: int) -> None:
        if not n:
            return
        self.used -= n
        left = self._by.get(tenant, 0) - n
        if left > 0:
            self._by[tenant] = left
        else:
            self._by.pop(tenant, None)

