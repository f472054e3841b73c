"""The KDN service: ``kvc serve``, an HTTP front of a :class:`~kvcodec.store.Store`, shared by many engines.

Built on aiohttp's web server.  The protocol is normative in
``spec/kdn-v1.md``; in short (every ``/v1`` route needs ``Authorization:
Bearer <token>``):

=======  ==========================  ==================================================
GET      /healthz                    liveness + tier availability (no auth)
GET      /metrics                    Prometheus text format (no auth)
GET      /v1/whoami                  tenant, namespaces, write permission of the token
PUT      /v1/entries/{key}           store a ``.kvc`` (verified; its token ids must hash to key)
GET/HEAD /v1/entries/{key}           the payload; Range, ETag, If-None-Match, If-Range
DELETE   /v1/entries/{key}           remove
GET      /v1/entries                 list the token's namespaces
POST     /v1/contains                {"keys": [...]} -> {"found": [...]}
POST     /v1/lookup                  token ids (or text + model) -> longest cached prefix
=======  ==========================  ==================================================

Why the server verifies every put: the store is shared, so one engine's bad
write would otherwise become every engine's failed load.  A ``.kvc`` is
accepted only if it parses, every CRC checks, every chunk decodes, it
carries its token ids, its model fingerprint id is the key's model, and its
token ids hash (``spec/store-keys.md``) to the key's digest.  Anything else
is a 4xx with a one-line JSON error and nothing stored.

Tenants: each bearer token names a tenant, and each tenant gets its own view
of the backing tiers: a :class:`~kvcodec.store.Store` whose tenant key is
derived from the server's own key and the tenant's name (spec/store-keys.md
§8).  So a token can name, read, list and delete only its tenant's entries,
whatever keys it sends.  Clients that are Stores themselves (``kvc+http://``)
send *physical* keys and sealed metadata (their own tenant key, above the
Tier interface); the service stores them as opaque names inside the tenant's
view and verifies the ``.kvc`` against the logical key named in the seal.
Keys sent in clear (logical keys, e.g. by curl) and the logical keys named by
seals must be in one of the token's namespaces.

Bounded work (issue 35; the limits are ``spec/kdn-v1.md`` §5 and :class:`ServiceConfig`):

* the event loop only moves bytes: every store call runs in a thread of a
  bounded pool shared fairly between tenants, and everything whose cost grows
  with the request -- checking and decoding a put entry, parsing a large JSON
  body, tokenizing a text lookup -- runs in a worker *process*
  (:mod:`kvcodec.service.workers`), at most ``tenant_workers`` per tenant,
  round-robin between tenants, killed at the request's deadline; a tenant's jobs are paced to
  ``tenant_worker_cpu`` cores on average (their CPU time is charged after each job, and so is the CPU time
  of the tenant's store-thread calls in this process);
* a put is checked cheap facts first (structure, declared decoded size against
  ``max_decoded_bytes`` and ``max_decoded_ratio`` x its size, token ids, model,
  key digest) and decoded only after the tenant's decode quota admits it;
* bodies are capped on the bytes actually read (any framing), must keep
  arriving (``body_idle_timeout``) and arrive whole within ``body_timeout``;
  the bytes being received at once are capped per tenant and in all, and a
  tenant's bodies are read at ``tenant_ingest_rate`` on average; a
  request's head must arrive within ``header_timeout``;
* a client address holds at most ``peer_connections`` connections, and HTTP that aiohttp's parser refuses
  is a one-line JSON ``400`` too (the connection layer: :mod:`kvcodec.service.server`);
* a tenant whose requests keep being refused (a refusal costs one, plus one per MiB of body read) gets its
  next answers as ``429`` held back up to a second, before any body is read; a client address whose
  requests keep failing authentication or parsing likewise (``peer_refusal_rate``), and one far past it has
  its new connections refused before they are parsed;
* memory is bounded and every term enforced (:meth:`ServiceConfig.memory_bound`): bodies are charged from
  their first byte to their answer, worker processes have a data limit (``worker_memory``);
* every refusal is a one-line JSON error, and one rate-limited log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Awaitable, Callable

from aiohttp import web

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.service.auth import Principal, TokenTable
from kvcodec.service.checks import (
    MAX_LOOKUP_TOKENS,
    HttpError,
    chunk_candidates,
    contains_key_strings,
    error_line,
    logical_key,
    lookup_candidates,
    parse_json,
    parse_lookup,
)
from kvcodec.service.fair import FairScheduler, Overloaded, TokenBucket
from kvcodec.service.metrics import Metrics
from kvcodec.service.server import KdnRequestHandler, PeerTable
from kvcodec.service.server import run as run_server
from kvcodec.service.workers import WorkerPool
from kvcodec.store import Store, StoreKey
from kvcodec.store.tenant import PHYS_MODEL, TenantKey
from kvcodec.store.tiers.base import MAX_TIER_META, check_meta, crc32c
from kvcodec.store.tiers.kdn import API, CONTENT_TYPE, H_CRC, H_CREATED, H_META, MAX_META_HEADER

log = logging.getLogger("kvcodec.service")

MAX_JSON_BODY = 16 << 20
MAX_CHUNKED_JSON = 1 << 20  # a JSON body sent without Content-Length: it can only be refused after it is read
TENANT_CACHE = 64 << 20   # each tenant view's in-process LRU (Store.for_key)
SERVICE_BASE = 384 << 20  # the event-loop process without bodies or caches (measured ~150-300 MB; spec §5)
WORKER_BASE = 256 << 20   # a worker with its decoders loaded, before a job's data (measured ~200 MB; spec §5)
THROTTLE_HOLD = 1.0       # seconds at most a throttled tenant's request waits before its 429
MAX_THROTTLED = 1024      # requests held back at once; beyond, the 429 is at once
DRAIN_MAX = 1 << 20        # a throttled request's body larger than this (or of unknown length) is not drained
LINGER = 1.0              # seconds the rest of a refused request's body is drained before its connection closes
REFUSAL_BODY_UNIT = 1 << 20  # a refused request costs its tenant one refusal, plus one per MiB of body it made us read
PEER_KEYS = 1 << 16       # client addresses whose refusals are remembered at once (the oldest is forgotten)
INLINE_JSON = 64 << 10   # JSON bodies up to this size are parsed on the event loop; larger ones by a worker
PROBE_SLICE = 16         # keys of a lookup or key list parsed and probed per store-thread call (KdnService._probe)
# The cost model of the service process (KdnService._run): its event loop and store threads share one interpreter
# lock, so a CPU-second of a tenant's there counts SERVICE_CPU_WEIGHT against its CPU share, plus STORE_TURN_COST
# for the event loop's own work handing each store-thread call over and back (measured ~0.18 ms here: a 600-key
# key list probed in 38 calls cost the service 16 CPU-ms against 9.7 in 2)
SERVICE_CPU_WEIGHT = 2.0
STORE_TURN_COST = 0.2e-3

PRINCIPAL = web.AppKey("principal", Principal)
SERVICE = web.AppKey("service", object)
_DEADLINE = "kvc.deadline"
_STOP = "kvc.stop_reading"  # set: the answer closes the connection without draining the body (server.py)
_HELD = "kvc.body_held"  # (tenant, bytes) of the request's body, charged to the body budget until its answer

__all__ = ["ServiceConfig", "KdnService", "HttpError", "make_app", "serve", "chunk_candidates"]


@dataclass
class ServiceConfig:
    """Limits and options of one service instance (``kvc serve`` flags; defaults in spec/kdn-v1.md §5)."""

    max_body: int = 1 << 30          # bytes of one PUT body
    body_timeout: float = 120.0      # seconds to receive a whole body
    body_idle_timeout: float = 15.0  # longest silence while a body is being received
    header_timeout: float = 10.0     # seconds to send a request's head (also: idle keep-alive connections close)
    op_timeout: float = 30.0         # seconds for one store operation
    verify_timeout: float = 300.0    # seconds to check (decode) one put in its worker
    request_timeout: float = 600.0   # deadline of any request: body, queue waits, work and store included
    queue_timeout: float = 60.0      # longest wait for a worker process or store thread
    verify: bool = True              # decode every chunk of a put (False: structure, CRCs, tokens, key only)
    models: list[str] = field(default_factory=list)  # models whose tokenizers serve text lookups
    max_json_body: int = MAX_JSON_BODY
    max_chunked_json: int = MAX_CHUNKED_JSON  # of those, one sent chunked (no Content-Length)
    max_lookup_tokens: int = MAX_LOOKUP_TOKENS
    max_lookup_text: int = 4 << 20   # characters of a text lookup
    max_decoded_bytes: int = 4 << 30  # decoded K/V a put entry may declare
    max_decoded_ratio: float = 256.0  # ... and at most this many times its own size
    max_chunk_decoded: int = 512 << 20  # decoded size of one of its chunks (a worker holds one at a time)
    workers: int = 2                 # worker processes (decode, large JSON, tokenization)
    tenant_workers: int = 1          # of them busy for one tenant at once
    tenant_queue: int = 16           # requests one tenant may have waiting for a worker (more: 429)
    tenant_worker_cpu: float = 0.5   # worker CPU-seconds per second one tenant's jobs may use on average (0: no share)
    tenant_decode_rate: float = 256 << 20  # decoded bytes per second per tenant (0: no quota); burst: max_decoded_bytes
    tenant_ingest_rate: float = 64 << 20  # body bytes per second read for one tenant (0: no limit); burst: one second
    store_threads: int = 16          # threads for store operations
    tenant_store_threads: int = 8    # of them busy for one tenant at once
    max_inflight_body: int = 2 << 30   # body bytes being received at once, all requests
    tenant_inflight_body: int = 1 << 30  # ... for one tenant
    worker_memory: int = 2 << 30     # memory a worker may allocate beyond its started state (hard: RLIMIT_DATA)
    peer_connections: int = 256      # connections one client address may hold at once (more: 429 at once)
    log_rate: float = 10.0           # bad-request log lines per second (more are counted, then summarised)
    tenant_refusal_rate: float = 20.0  # refused requests per second a tenant may cause (burst 5x); then 429 at once
    peer_refusal_rate: float = 20.0  # unauthenticated refusals (401, malformed HTTP) per second per client address

    def check(self) -> None:
        """:class:`KvcInputError` naming the first option out of range."""
        pos_int = ("max_body", "max_json_body", "max_chunked_json", "max_lookup_tokens", "max_lookup_text", "max_decoded_bytes",
                   "max_chunk_decoded",
                   "workers", "tenant_workers", "store_threads", "tenant_store_threads", "max_inflight_body",
                   "tenant_inflight_body", "worker_memory", "peer_connections")
        for k in pos_int:
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise KvcInputError(f"{k.replace('_', '-')} must be a positive integer, got {v!r}")
        for k in ("body_timeout", "body_idle_timeout", "header_timeout", "op_timeout", "verify_timeout",
                  "request_timeout", "queue_timeout"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 < v <= 86400:
                raise KvcInputError(f"{k.replace('_', '-')} must be in (0, 86400] seconds, got {v!r}")
        for k in ("max_decoded_ratio", "tenant_decode_rate", "log_rate", "tenant_refusal_rate", "peer_refusal_rate",
                  "tenant_worker_cpu", "tenant_ingest_rate"):
            v = getattr(self, k)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):
                raise KvcInputError(f"{k.replace('_', '-')} must be a finite number >= 0, got {v!r}")
        if self.tenant_queue < 0:
            raise KvcInputError("tenant-queue must be >= 0")
        if self.worker_memory <= max(self.max_body, self.max_json_body):
            raise KvcInputError(f"worker-memory ({self.worker_memory}) must be larger than max-body and max-json-body: "
                                "a worker holds the body it checks")

    def memory_bound(self, tenants: int) -> int:
        """The service's stated peak memory in bytes (spec/kdn-v1.md §5, "Memory"), every term enforced:
        the event-loop process (code, and each body held from its first byte to its answer, at most
        ``max_inflight_body``, counted twice for the one copy made when a body is complete), each tenant's
        in-process cache, and each worker (code, and at most ``worker_memory`` more: its data limit)."""
        return (SERVICE_BASE + 2 * self.max_inflight_body + tenants * TENANT_CACHE
                + self.workers * (WORKER_BASE + self.worker_memory))


class LogLimiter:
    """One log line per bad request, at most ``rate`` a second; the lines dropped are counted in the next one."""

    def __init__(self, rate: float, burst: float = 20.0) -> None:
        self.rate, self.burst = rate, max(burst, rate)
        self._tokens = self.burst
        self._at = time.monotonic()
        self.suppressed = 0

    def line(self, level: int, msg: str) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self.rate <= 0 or self._tokens < 1:
            self.suppressed += 1
            return False
        self._tokens -= 1
        if self.suppressed:
            msg += f" ({self.suppressed} more bad requests not logged)"
            self.suppressed = 0
        log.log(level, "%s", msg)
        return True


class _HttpLayerLog:
    """The logger aiohttp's connection handler writes to: malformed HTTP (bad request line, headers or framing,
    refused before any route or middleware) becomes one rate-limited line, never a traceback."""

    def __init__(self, limiter: LogLimiter) -> None:
        self.limiter = limiter

    def _line(self, level: int, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        try:
            text = msg % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        if isinstance(exc_info, BaseException):
            text += f": {error_line(exc_info)}"
        self.limiter.line(level, f"kdn: {text[:400]}")

    def exception(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def error(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        pass

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        pass


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj, sort_keys=True), content_type="application/json",
                        headers=headers)


class KdnService:
    """State of one ``kvc serve``: the store, the token table, metrics, workers and limits."""

    def __init__(self, store: Store, tokens: TokenTable, config: ServiceConfig | None = None,
                 server_key: TenantKey | None = None) -> None:
        self.store = store  # the backing tiers; requests go through per-tenant views (store_for)
        self.server_key = server_key or store.key
        self._views: dict[str, Store] = {}
        self._views_lock = threading.Lock()
        self.tokens = tokens
        self.config = config or ServiceConfig()
        self.config.check()
        c = self.config
        self.metrics = Metrics()
        self._etags: dict[tuple[StoreKey, float | None, int], str] = {}
        self._tokenizer_dirs: dict[str, str] = {}  # fingerprint id -> model directory (the workers load them)
        for m in c.models:
            self._add_model(m)
        self.workers = WorkerPool(c.workers, per_tenant=c.tenant_workers, max_queued=c.tenant_queue,
                                  queue_timeout=c.queue_timeout, tokenizers=self._tokenizer_dirs,
                                  memory=c.worker_memory, base=WORKER_BASE, tenant_cpu=c.tenant_worker_cpu)
        self.decode_quota = TokenBucket(c.tenant_decode_rate, c.max_decoded_bytes)
        # body bytes read per tenant: receiving, checksumming and storing bodies is the event loop's and the store
        # threads' work, which no worker share bounds (a tenant's large valid puts took half a core that way)
        self.ingest = TokenBucket(c.tenant_ingest_rate, max(c.tenant_ingest_rate, 1 << 20))  # burst: one second
        self._io = ThreadPoolExecutor(c.store_threads, thread_name_prefix="kvc-store")
        self.io_sched = FairScheduler(c.store_threads, c.tenant_store_threads, max_queued=256, name="store thread")
        # model work of edits (kvcodec.service.edit): one at a time in the service, round-robin between tenants
        self.edit_sched = FairScheduler(1, 1, max_queued=c.tenant_queue, name="model edit")
        self.bodies = _BodyBudget(c.max_inflight_body, c.tenant_inflight_body)
        self.bad = LogLimiter(c.log_rate)
        # a tenant whose requests keep being refused (4xx) is answered 429 before any body is read or work done
        self.refusals = TokenBucket(c.tenant_refusal_rate, 5 * c.tenant_refusal_rate)
        self.throttled = 0  # requests being held back before their 429 (at most MAX_THROTTLED)
        # a client address whose requests keep failing authentication (or parsing) is throttled the same way: no
        # tenant to charge them to. Bounded: an attacker with many addresses cannot grow the table
        self.peer_refusals = TokenBucket(c.peer_refusal_rate, 5 * c.peer_refusal_rate, max_keys=PEER_KEYS)
        self.peers = PeerTable(c.peer_connections, self.peer_refusals)  # the connection layer's (kvcodec.service.server)

    def store_for(self, p: Principal) -> Store:
        """The tenant's view of the backing tiers: a Store whose tenant key is derived for ``p.tenant``."""
        with self._views_lock:
            st = self._views.get(p.tenant)
            if st is None:
                secret = self.server_key.namespace(f"kdn-tenant.{p.tenant}").name_key
                st = self._views[p.tenant] = self.store.for_key(TenantKey(secret, f"kdn tenant {p.tenant}"))
            return st

    def _add_model(self, name: str) -> None:
        """Text lookups for ``name``: its fingerprint id here, its tokenizer in the workers (from its directory).

        The model is never loaded: its fingerprint comes from the directory's files (config, tokenizer, and
        the safetensors streamed through a hash with one buffer, cached per directory), as a loaded model's
        does, so the service holds no weights for it."""
        from kvcodec.models.fingerprint import fingerprint_dir
        from kvcodec.models.load import check_weights, resolve_model_dir

        d = resolve_model_dir(name)
        check_weights(d)
        fp = fingerprint_dir(d)
        self._tokenizer_dirs[fp.id] = str(d)
        log.info("kdn: text lookups for model %s (fingerprint %s)", name, fp.id)

    # -- app ------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body,
                              middlewares=[self._errors_mw, self._auth_mw],
                              handler_args={"max_field_size": MAX_META_HEADER + 1024,
                                            "keepalive_timeout": self.config.header_timeout,
                                            # a refused request's unread body is read and dropped for at most
                                            # LINGER s (aiohttp: 10): a client that sends its whole body before
                                            # reading still gets its one-line error; one that keeps sending
                                            # costs that much reading, then its connection closes
                                            "lingering_time": LINGER,
                                            "logger": _HttpLayerLog(self.bad)})
        app[SERVICE] = self
        r = app.router
        r.add_get("/healthz", self.healthz)
        r.add_get("/metrics", self.metrics_handler)
        r.add_get(f"{API}/whoami", self.whoami)
        r.add_get(f"{API}/entries", self.ls)
        r.add_put(f"{API}/entries/{{key}}", self.put)
        r.add_get(f"{API}/entries/{{key}}", self.get)  # HEAD too (aiohttp adds it)
        r.add_delete(f"{API}/entries/{{key}}", self.delete)
        r.add_post(f"{API}/contains", self.contains)
        r.add_post(f"{API}/lookup", self.lookup)
        from kvcodec.service.edit import add_edit_routes  # offline editing (issue 37)

        add_edit_routes(self, r, API)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    async def _start(self, app: web.Application) -> None:
        await self.workers.start()
        log.info("kdn: %d worker processes (pids %s)", self.workers.n, self.workers.pids())

    async def _close(self, app: web.Application) -> None:
        await self.workers.close()
        self._io.shutdown(wait=False, cancel_futures=True)
        self.store.close()  # the views share these tiers

    # -- middlewares ----------------------------------------------------------------
    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        t0 = time.perf_counter()
        request[_DEADLINE] = time.monotonic() + self.config.request_timeout
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        detail = ""
        held = None
        try:
            resp = await handler(request)
        except HttpError as e:
            resp, detail = _json({"error": str(e)}, e.status, e.headers), str(e)
        except Overloaded as e:
            self.metrics.overloaded(str(e.status))
            resp, detail = _json({"error": str(e)}, e.status, {"Retry-After": f"{e.retry_after:.0f}"}), str(e)
        except web.HTTPException as e:  # aiohttp's own: 404 no route, 405, 413 body too large
            if e.status == 413:
                msg = f"request body larger than the limit of {self.config.max_body} bytes"
            else:
                msg = e.reason
            resp, detail = _json({"error": msg}, e.status, {k: v for k, v in e.headers.items() if k in ("Allow",)}), msg
        except KvcInputError as e:
            resp, detail = _json({"error": error_line(e)}, 400), error_line(e)
        except KvcFormatError as e:
            resp, detail = _json({"error": error_line(e)}, 422), error_line(e)
        except KvcStoreError as e:
            resp, detail = _json({"error": error_line(e)}, 503), error_line(e)
        except KvcError as e:
            resp, detail = _json({"error": error_line(e)}, 422), error_line(e)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # our bug, or a library's failure mode on hostile input: one line, no traceback
            detail = error_line(e)
            resp = _json({"error": f"internal error: {type(e).__name__}"}, 500)
        finally:
            held = request.pop(_HELD, None)
            if held is not None:
                self.bodies.give(*held)
        if request.get(_STOP):
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
            h = request.headers.get("Authorization", "")
            scheme, _, tok = h.partition(" ")
            tok = tok.strip()
            given = scheme.lower() == "bearer" and bool(tok)
            p = self.tokens.lookup(tok) if given else None
            if p is None:
                # no tenant to charge: the client address pays, and one that keeps failing gets its 401s held back
                peer = request.remote or "?"
                await self._throttle(request, self.peer_refusals, peer, self.config.peer_refusal_rate,
                                     f"your address had more than {self.config.peer_refusal_rate:g} unauthenticated "
                                     "requests a second refused; retry later")
                self.peer_refusals.charge(peer, 1)
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
            request[_STOP] = True  # its body is not worth draining for a 429
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
        left = request[_DEADLINE] - time.monotonic()
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
            await self.workers.pace(tenant, min(request[_DEADLINE], time.monotonic() + self.config.queue_timeout))
            ks, f = await self._run(request, _parse_probe, st, keys[i:i + PROBE_SLICE], allow)
            parsed += ks
            found += f
        return parsed, found

    def _key(self, request: web.Request, write: bool = False) -> tuple[StoreKey, Principal]:
        try:
            key = StoreKey.from_str(request.match_info["key"])
        except KvcInputError as e:
            raise HttpError(400, str(e)) from None
        p: Principal = request[PRINCIPAL]
        if key.model == PHYS_MODEL:  # an opaque name from a sealing client: checked against its seal (_sealed_ns)
            self._allow(p, None, write)
        else:
            self._allow(p, key.namespace, write)
        return key, p

    def _allow(self, p: Principal, namespace: str | None, write: bool = False) -> None:
        if namespace is not None and not p.may_use(namespace):
            self.metrics.auth_failure("namespace")
            raise HttpError(403, f"tenant {p.tenant!r} may not use namespace {namespace[:128]!r}")
        if write and not p.write:
            self.metrics.auth_failure("read_only")
            raise HttpError(403, f"tenant {p.tenant!r} has a read-only token")

    def _allow_sealed(self, p: Principal, key: StoreKey, meta: Any) -> None:
        """For a physical key: the logical key its seal names must be in one of the token's namespaces."""
        if key.model != PHYS_MODEL:
            return
        try:
            logical = StoreKey.from_str(meta["key"])
        except (KeyError, TypeError, KvcInputError):
            self.metrics.auth_failure("namespace")
            raise HttpError(403, "the entry's seal names no key in this token's namespaces") from None
        self._allow(p, logical.namespace)

    async def _read_body(self, request: web.Request, limit: int, what: str = "request body") -> bytes:
        """The body, whatever its framing: capped on the bytes read, each piece within ``body_idle_timeout``,
        the whole within ``body_timeout``, counted against the tenant's and the server's in-flight budget."""
        c = self.config
        if request.content_length is not None and request.content_length > limit:  # drained like any refusal
            raise HttpError(413, f"{what} of {request.content_length} bytes is larger than the limit of {limit}")
        tenant = request[PRINCIPAL].tenant if PRINCIPAL in request else "-"
        end = time.monotonic() + min(c.body_timeout, self._left(request))
        buf = bytearray()
        held = 0
        # each piece stays charged to the budget until the answer (the errors middleware gives it back); a body
        # refused for its size or pace is not drained afterwards
        request[_STOP] = True
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
            request[_HELD] = (tenant, held)
            buf += piece
            self.ingest.charge(tenant, len(piece))
            debt = -self.ingest.balance(tenant)
            if debt > 0:  # over its ingest rate: read its body more slowly (not reading lets TCP push back)
                await asyncio.sleep(min(debt / self.ingest.rate, max(0.0, end - time.monotonic())))
        request[_STOP] = False
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

    def _etag(self, key: StoreKey, data: bytes, created: float | None) -> tuple[str, str]:
        """``(etag, crc32c hex)`` of an entry version; cached by (key, created, size).  Runs in a store thread."""
        ck = (key, created, len(data))
        tag = self._etags.get(ck)
        if tag is None:
            if len(self._etags) > 100_000:
                self._etags.clear()
            tag = self._etags[ck] = f"{crc32c(data):08x}"
        return f'"{tag}-{len(data):x}"', tag

    # -- handlers -------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        tiers = {t.name: t.available() for t in self.store.tiers}
        ok = any(up for t, up in zip(self.store.tiers, tiers.values()) if t.persistent) or \
            not any(t.persistent for t in self.store.tiers)
        return _json({"status": "ok" if ok else "degraded", "tiers": tiers}, 200 if ok else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.queues(self.workers.sched.queued(), self.io_sched.queued(), self.bodies.used,
                            self.bad.suppressed, self.peers.refused, self.throttled,
                            self.edit_sched.slots - self.edit_sched.free, self.edit_sched.queued())
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def whoami(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        return _json({"tenant": p.tenant, "namespaces": list(p.namespaces), "write": p.write})

    def _admit_decode(self, tenant: str, reply: dict[str, Any]) -> bool:
        """Between an entry's cheap checks and its decode: the tenant's decode quota (429 when spent)."""
        self.decode_quota.check(tenant)
        self.decode_quota.charge(tenant, float(reply.get("declared", 0)))
        return True

    async def put(self, request: web.Request) -> web.Response:
        c = self.config
        key, p = self._key(request, write=True)
        st = self.store_for(p)
        meta_s = request.headers.get(H_META, "{}")
        if len(meta_s) > MAX_META_HEADER:
            raise HttpError(400, f"{H_META} larger than {MAX_META_HEADER} bytes")
        try:
            meta = check_meta(json.loads(meta_s), MAX_TIER_META)
        except (ValueError, RecursionError) as e:
            raise HttpError(400, f"{H_META} is not a JSON object of at most {MAX_TIER_META} bytes: "
                                 f"{str(e)[:200]}") from None
        logical = logical_key(key, meta)
        if key.model == PHYS_MODEL:
            self._allow(p, logical.namespace)  # the seal's key, like a key in clear
        want = request.headers.get(H_CRC)
        if want is not None and not (len(want.strip()) == 8 and all(ch in "0123456789abcdefABCDEF" for ch in want.strip())):
            raise HttpError(400, f"{H_CRC} must be 8 hex digits")
        inm = request.headers.get("If-None-Match")
        if inm is not None and inm.strip() != "*":
            raise HttpError(400, "PUT supports only If-None-Match: *")
        data = await self._read_body(request, c.max_body, "PUT body")
        if not data:
            raise HttpError(400, "empty body: PUT a .kvc file")
        if inm is not None and (await self._run(request, st.contains_many, [key]))[0]:
            raise HttpError(412, f"{key} already exists")
        deadline = min(request[_DEADLINE], time.monotonic() + c.queue_timeout + c.verify_timeout)
        job = {"op": "check", "key": logical.to_str(), "max_decoded_bytes": c.max_decoded_bytes,
               "max_decoded_ratio": c.max_decoded_ratio, "max_chunk_bytes": c.max_chunk_decoded, "verify": c.verify,
               "crc": want.strip().lower() if want is not None else None}
        try:
            await self._job(p, deadline, job, data, decide=lambda r: self._admit_decode(p.tenant, r),
                            what="check of the entry")
        except (HttpError, Overloaded) as e:
            self.metrics.put("rejected" if e.status < 500 and e.status != 429 else "overloaded")
            raise
        res = await self._run(request, st.put, key, data, meta)
        self.metrics.put("ok", len(data))
        return _json({"key": key.to_str(), "bytes": len(data), "stored_in": res.stored_in, "failed": res.failed},
                     201, {"Location": request.path})

    def _entry_and_tag(self, st: Store, key: StoreKey) -> tuple[Any, str, str] | None:
        e = st.get_entry(key)
        if e is None:
            return None
        etag, crc = self._etag(key, e.data, e.created)
        return e, etag, crc

    async def get(self, request: web.Request) -> web.StreamResponse:
        key, p = self._key(request)
        got = await self._run(request, self._entry_and_tag, self.store_for(p), key)
        if got is None:
            self.metrics.get(False)
            raise HttpError(404, f"no entry {key}")
        e, etag, crc = got
        self._allow_sealed(p, key, e.meta)
        data: bytes = e.data
        headers = {
            "ETag": etag, "Accept-Ranges": "bytes", "Cache-Control": "private, no-cache",
            H_CRC: crc, H_META: json.dumps(e.meta, sort_keys=True, separators=(",", ":")),
            "Content-Type": CONTENT_TYPE,
        }
        if e.created:
            headers[H_CREATED] = f"{e.created:.3f}"
            headers["Last-Modified"] = formatdate(e.created, usegmt=True)
        inm = request.headers.get("If-None-Match")
        if inm is not None and (inm.strip() == "*" or etag in [t.strip() for t in inm.split(",")]):
            self.metrics.get(True)
            return web.Response(status=304, headers={k: headers[k] for k in ("ETag", "Cache-Control")})
        rng = request.headers.get("Range")
        if_range = request.headers.get("If-Range")
        if rng is not None and (if_range is None or if_range.strip() == etag):
            span = parse_range(rng, len(data))
            if span == "unsatisfiable":
                self.metrics.get(True)
                return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}", "ETag": etag})
            if isinstance(span, tuple):
                first, stop = span
                headers["Content-Range"] = f"bytes {first}-{stop - 1}/{len(data)}"
                body = data[first:stop]
                self.metrics.get(True, len(body) if request.method == "GET" else 0)
                return web.Response(status=206, body=body, headers=headers)
        self.metrics.get(True, len(data) if request.method == "GET" else 0)
        return web.Response(status=200, body=data, headers=headers)

    async def delete(self, request: web.Request) -> web.Response:
        key, p = self._key(request, write=True)
        st = self.store_for(p)
        if key.model == PHYS_MODEL:
            meta = await self._run(request, st.get_meta, key)
            if meta is None:
                raise HttpError(404, f"no entry {key}")
            self._allow_sealed(p, key, meta)
        if not await self._run(request, st.rm, key):
            raise HttpError(404, f"no entry {key}")
        return web.Response(status=204)

    async def ls(self, request: web.Request) -> web.Response:
        """The tenant's entries in the token's namespaces only (a sealed entry's namespace is its seal's key's)."""
        p: Principal = request[PRINCIPAL]
        with_meta = request.query.get("meta", "0") in ("1", "true")
        ns = request.query.get("namespace")
        if ns is not None:
            self._allow(p, ns)
        st = self.store_for(p)
        rows = await self._run(request, lambda: st.ls(with_meta=True, namespace=ns))
        out = []
        for r in rows:
            if r.key.model == PHYS_MODEL:
                try:
                    visible = p.may_use(StoreKey.from_str((r.meta or {})["key"]).namespace)
                except (KeyError, TypeError, KvcInputError):
                    visible = False
            else:
                visible = p.may_use(r.key.namespace)
            if visible:
                d = r.to_dict()
                if not with_meta:
                    d["meta"] = None
                out.append({**d, "tier": "kdn"})
        return _json({"entries": out})

    async def contains(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        raw, obj = await self._json_body(request)
        if obj is not None:
            keys = contains_key_strings(obj)  # parsed in _probe's store-thread turns
        else:
            rep = await self._job(p, request[_DEADLINE], {"op": "contains"}, raw, what="key list parse")
            keys = rep["keys"]

        def allow(k: StoreKey) -> None:
            self._allow(p, None if k.model == PHYS_MODEL else k.namespace)

        _, found = await self._probe(request, self.store_for(p), keys, allow)
        return _json({"found": found})

    async def lookup(self, request: web.Request) -> web.Response:
        """Longest cached prefix of token ids (or of a text, tokenized by a worker with the model's tokenizer)."""
        c = self.config
        p: Principal = request[PRINCIPAL]
        raw, obj = await self._json_body(request)
        try:
            if obj is not None and "text" not in obj:
                q = parse_lookup(obj, list(p.namespaces), max_tokens=c.max_lookup_tokens, max_text=c.max_lookup_text)
                cands = lookup_candidates(q, q.token_ids or [], c.max_lookup_tokens)
                n_ids = len(q.token_ids or [])
            else:
                if obj is not None and "text" in obj and not self._tokenizer_dirs:
                    parse_lookup(obj, list(p.namespaces), max_tokens=c.max_lookup_tokens, max_text=c.max_lookup_text)
                    raise HttpError(422, f"this service has no tokenizer for model {str(obj.get('model'))[:80]} "
                                         "(start it with --model, or send token_ids)")
                job = {"op": "lookup", "namespaces": list(p.namespaces), "max_tokens": c.max_lookup_tokens,
                       "max_text": c.max_lookup_text}
                rep = await self._job(p, request[_DEADLINE], job, raw, what="lookup")
                cands = rep["keys"]
                n_ids = int(rep["tokens"])
        except HttpError as e:
            if e.status == 403:
                self.metrics.auth_failure("namespace")
            raise
        cands, found = await self._probe(request, self.store_for(p), cands)
        entries = [{"key": k.to_str(), "n_tokens": k.n_tokens, "url": f"{API}/entries/{k.to_str()}"}
                   for k, ok in zip(cands, found) if ok]
        n = entries[0]["n_tokens"] if entries else 0
        self.metrics.lookup(n_ids, n)
        return _json({"n_tokens": n, "tokens": n_ids, "key": entries[0]["key"] if entries else None,
                      "entries": entries})


def _parse_probe(st: Store, keys: list[Any], allow: Callable[[StoreKey], None] | None
                 ) -> tuple[list[StoreKey], list[bool]]:
    ks = [k if isinstance(k, StoreKey) else StoreKey.from_str(k) for k in keys]
    if allow is not None:
        for k in ks:
            allow(k)
    return ks, st.contains_many(ks)


class _BodyBudget:
    """Body bytes being received at once, per tenant and in all (event loop only)."""

    def __init__(self, total: int, per_tenant: int) -> None:
        self.total, self.per_tenant = total, per_tenant
        self.used = 0
        self._by: dict[str, int] = {}

    def take(self, tenant: str, n: int) -> None:
        mine = self._by.get(tenant, 0)
        if mine + n > self.per_tenant:
            raise Overloaded(429, f"tenant is sending more than {self.per_tenant} body bytes at once; retry later")
        if self.used + n > self.total:
            raise Overloaded(503, "the server is receiving too many bodies at once; retry later")
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


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """A ``Range`` header against an entry of ``size`` bytes (RFC 9110 §14): ``(first, stop)`` to serve,
    ``"unsatisfiable"`` (416), or ``None`` (ignore it and send the whole entry: several ranges, another unit,
    a malformed or reversed range)."""
    unit, eq, spec = header.strip().partition("=")
    if not eq or unit.strip().lower() != "bytes" or "," in spec:
        return None
    a, dash, b = spec.strip().partition("-")
    if not dash or not (a.isascii() and b.isascii()) or (a and not a.isdigit()) or (b and not b.isdigit()) or not (a or b):
        return None
    big = 1 << 63  # digits beyond 19 are larger than any entry: no int() of an attacker's 4000-digit number

    def num(s: str) -> int:
        return big if len(s) > 19 else int(s)

    if not a:  # suffix: the last n bytes
        n = num(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size
    first = num(a)
    last = num(b) if b else None
    if last is not None and last < first:
        return None
    if first >= size:
        return "unsatisfiable"
    return first, size if last is None else min(last + 1, size)


def _resolve_range(sl: slice, size: int) -> tuple[int | None, int]:
    """``(first, stop)`` of a single byte range slice (aiohttp's form) against ``size`` bytes (first None: unsatisfiable)."""
    start, stop = sl.start, sl.stop
    if start is None or start < 0:  # suffix range bytes=-n
        n = -start if start is not None else 0
        if n <= 0 or size == 0:
            return None, 0
        return max(0, size - n), size
    if start >= size:
        return None, 0
    return start, size if stop is None else min(stop, size)


def make_app(store_url: str, tokens: TokenTable, config: ServiceConfig | None = None) -> web.Application:
    """The aiohttp application of a service over ``Store.open(store_url)`` (its key: the server's tenant key)."""
    if store_url.lower().startswith(("kvc+http://", "kvc+https://")):
        raise KvcInputError("the service's own store cannot be another kvc+http service")
    # Each tenant view gets an in-process LRU of this size (Store.for_key).
    return KdnService(Store.open(store_url, memory_bytes=TENANT_CACHE), tokens, config).app()


def _raise_fd_limit() -> None:
    """Many slow connections must not exhaust the descriptors: soft limit up to the hard one (at most 65536)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536)
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ImportError, ValueError, OSError):  # pragma: no cover - not POSIX, or not allowed
        pass


def serve(store_url: str, tokens: TokenTable, *, host: str = "127.0.0.1", port: int = 8470,
          config: ServiceConfig | None = None, ready: Callable[[str], None] | None = None) -> None:
    """Run the service until interrupted (SIGINT/SIGTERM)."""
    _raise_fd_limit()
    app = make_app(store_url, tokens, config)
    svc = app[SERVICE]
    assert isinstance(svc, KdnService)
    log.info("kdn: memory bound %.2f GiB (spec/kdn-v1.md §5: %d tenants, %d workers of at most %d MiB each, "
             "bodies at most %d MiB at once)", svc.config.memory_bound(len(tokens.tenants())) / 2**30,
             len(tokens.tenants()), svc.config.workers, svc.config.worker_memory >> 20,
             svc.config.max_inflight_body >> 20)

    def announce() -> None:
        if ready is not None:
            ready(f"http://{host}:{port}")

    try:
        run_server(app, svc.peers, host, port, ready=announce)
    except OSError as e:  # address in use, no permission, unknown host
        raise KvcInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

