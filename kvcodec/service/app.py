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

This module holds the routes: what each one does with the store once its request is admitted.  The bounds above
are enforced by :mod:`kvcodec.service.admission` (which :class:`KdnService` inherits), the limits are
:class:`~kvcodec.service.config.ServiceConfig`, stateless HTTP helpers are :mod:`kvcodec.service.httputil`, and
the paths and header names the client tier shares are :mod:`kvcodec.kdn_protocol`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from email.utils import formatdate
from typing import Any, Callable

from aiohttp import web

from kvcodec.errors import KvcInputError, json_loads
from kvcodec.kdn_protocol import (
    API,
    CONTAINS,
    CONTENT_TYPE,
    ENTRIES,
    H_CRC,
    H_CREATED,
    H_META,
    HEALTHZ,
    LOOKUP,
    MAX_META_HEADER,
    METRICS,
    WHOAMI,
)
from kvcodec.service.admission import DEADLINE, HELD, PRINCIPAL, Admission, expect_continue
from kvcodec.service.auth import Principal, TokenTable
from kvcodec.service.checks import (
    HttpError,
    contains_key_strings,
    logical_key,
    lookup_candidates,
    parse_lookup,
)
from kvcodec.service.config import LINGER, TENANT_CACHE, ServiceConfig
from kvcodec.service.fair import Overloaded
from kvcodec.service.httputil import HttpLayerLog, json_reply, parse_range
from kvcodec.service.server import run as run_server
from kvcodec.store import Store, StoreKey
from kvcodec.store.tenant import PHYS_MODEL, TenantKey
from kvcodec.store.tiers.base import MAX_TIER_META, check_meta, crc32c

log = logging.getLogger("kvcodec.service")

SERVICE = web.AppKey("service", object)

__all__ = ["KdnService", "make_app", "serve"]


class KdnService(Admission):
    """State of one ``kvc serve``: the store, the token table, and (from :class:`Admission`) metrics, workers and
    limits."""

    def __init__(self, store: Store, tokens: TokenTable, config: ServiceConfig | None = None,
                 server_key: TenantKey | None = None) -> None:
        self.store = store  # the backing tiers; requests go through per-tenant views (store_for)
        self.server_key = server_key or store.key
        self._views: dict[str, Store] = {}
        self._views_lock = threading.Lock()
        self.tokens = tokens
        config = config or ServiceConfig()
        config.check()
        self._tokenizer_dirs: dict[str, str] = {}  # fingerprint id -> model directory (the workers load them)
        for m in config.models:
            self._add_model(m)
        n = len(tokens.tenants())
        for t in store.tiers:  # an uncapped directory: no tenant fills the disk under the others
            share = t.share_tenants(n)
            if share is not None:
                log.warning("kdn: %s sets no tenant_bytes: each of the %d tenants may hold %s bytes (its share of the "
                            "disk space free now); set tenant_bytes= in the store URL to choose", t.url, n,
                            f"{share:,}")
        super().__init__(config, self._tokenizer_dirs)

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
                                            "logger": HttpLayerLog(self.bad)})
        app[SERVICE] = self
        r = app.router
        ex: dict[str, Any] = {"expect_handler": expect_continue}  # "100 Continue" only once a body is wanted
        r.add_get(HEALTHZ, self.healthz, **ex)
        r.add_get(METRICS, self.metrics_handler, **ex)
        r.add_get(WHOAMI, self.whoami, **ex)
        r.add_get(ENTRIES, self.ls, **ex)
        r.add_put(f"{ENTRIES}/{{key}}", self.put, **ex)
        r.add_get(f"{ENTRIES}/{{key}}", self.get, **ex)  # HEAD too (aiohttp adds it)
        r.add_delete(f"{ENTRIES}/{{key}}", self.delete, **ex)
        r.add_post(CONTAINS, self.contains, **ex)
        r.add_post(LOOKUP, self.lookup, **ex)
        from kvcodec.service.edit import add_edit_routes  # offline editing (issue 37)

        add_edit_routes(self, r, API)
        # last: every other path and method, so that they too get expect_continue (aiohttp's own "no route"
        # answer sent "100 Continue" first, inviting a body only to answer 404, and a plain-text 417)
        r.add_route("*", "/{tail:.*}", no_route, **ex)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        await self._close_pools()
        self.store.close()  # the views share these tiers

    # -- helpers ------------------------------------------------------------------------
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
    @staticmethod
    def _etag(data: bytes) -> tuple[str, str]:
        """``(etag, crc32c hex)`` of an entry version, computed on every read. Not memoised: a memo keyed by
        what an entry says of itself (key, created, size) answered a version put in the same millisecond with
        the same size as the one before it with that one's checksum (every client read of it then failed its
        check: a miss for good). crc32c costs a third of the seal's BLAKE3 hashes that the Store checks on the
        same read (64 MiB: 13 ms against 39, on the 2-vCPU EPYC). Runs in a store thread."""
        tag = f"{crc32c(data):08x}"
        return f'"{tag}-{len(data):x}"', tag

    # -- handlers -------------------------------------------------------------------------
    async def healthz(self, request: web.Request) -> web.Response:
        tiers = {t.name: t.available() for t in self.store.tiers}
        ok = any(up for t, up in zip(self.store.tiers, tiers.values()) if t.persistent) or \
            not any(t.persistent for t in self.store.tiers)
        return json_reply({"status": "ok" if ok else "degraded", "tiers": tiers}, 200 if ok else 503)

    async def metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.queues(self.workers.sched.queued(), self.io_sched.queued(), self.bodies.used,
                            self.bad.suppressed, self.peers.refused, self.throttled,
                            self.edit_sched.slots - self.edit_sched.free, self.edit_sched.queued())
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def whoami(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        return json_reply({"tenant": p.tenant, "namespaces": list(p.namespaces), "write": p.write})

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
            meta = check_meta(json_loads(meta_s), MAX_TIER_META)
        except ValueError as e:
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
        deadline = min(request[DEADLINE], time.monotonic() + c.queue_timeout + c.verify_timeout)
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
        return json_reply({"key": key.to_str(), "bytes": len(data), "stored_in": res.stored_in, "failed": res.failed},
                          201, {"Location": request.path})

    def _entry_and_tag(self, st: Store, key: StoreKey) -> tuple[Any, str, str] | None:
        e = st.get_entry(key)
        if e is None:
            return None
        etag, crc = self._etag(e.data)
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
                body = memoryview(data)[first:stop]  # no copy of the entry
                self.metrics.get(True, len(body) if request.method == "GET" else 0)
                return await self._send(request, p, web.Response(status=206, body=body, headers=headers), len(body))
        self.metrics.get(True, len(data) if request.method == "GET" else 0)
        return await self._send(request, p, web.Response(status=200, body=data, headers=headers), len(data))

    async def _send(self, request: web.Request, p: Principal, resp: web.Response, n: int) -> web.StreamResponse:
        """Send an entry's answer of ``n`` body bytes here, held against the tenant's and the server's body budget
        (``--tenant-inflight-body`` / ``--max-inflight-body``: 429 / 503 past it) until it is written.

        Why: aiohttp sends a handler's answer after the handler returns, where nothing counted it, so one tenant's
        concurrent GETs of a large entry (256 connections, each holding a copy of an uncached entry until its
        client had read it) were a term of the service's memory that no limit bounded (spec §5, "Memory")."""
        if request.method == "HEAD" or n == 0:
            return resp
        self.bodies.take(p.tenant, n)
        request[HELD] = (p.tenant, n)  # given back by the errors middleware, once this handler returns
        try:
            await resp.prepare(request)
            await resp.write_eof()
        except ConnectionError:  # the client went away, or its unread answer was cut (server.py): nothing to say
            pass
        return resp

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

    async def ls(self, request: web.Request) -> web.StreamResponse:
        """The tenant's entries in the token's namespaces only (a sealed entry's namespace is its seal's key's).

        Listed, filtered and encoded in one store-thread call (:func:`_listing`: charged to the tenant's CPU share,
        and paced by it first), and sent against the body budget (:meth:`_send`). Why: the rows were filtered and
        encoded on the event loop, some 2.3 s per million entries during which no other tenant's request moved,
        and the answer (hundreds of MB for such a tenant) was held outside every limit."""
        p: Principal = request[PRINCIPAL]
        with_meta = request.query.get("meta", "0") in ("1", "true")
        ns = request.query.get("namespace")
        if ns is not None:
            self._allow(p, ns)
        st = self.store_for(p)
        await self.workers.pace(p.tenant, min(request[DEADLINE], time.monotonic() + self.config.queue_timeout))
        body: bytes = await self._run(request, _listing, st, p, ns, with_meta)
        resp = web.Response(body=body, content_type="application/json", charset="utf-8")
        return await self._send(request, p, resp, len(body))

    async def contains(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        raw, obj = await self._json_body(request)
        if obj is not None:
            keys = contains_key_strings(obj)  # parsed in _probe's store-thread turns
        else:
            rep = await self._job(p, request[DEADLINE], {"op": "contains"}, raw, what="key list parse")
            keys = rep["keys"]

        def allow(k: StoreKey) -> None:
            self._allow(p, None if k.model == PHYS_MODEL else k.namespace)

        _, found = await self._probe(request, self.store_for(p), keys, allow)
        return json_reply({"found": found})

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
                rep = await self._job(p, request[DEADLINE], job, raw, what="lookup")
                cands = rep["keys"]
                n_ids = int(rep["tokens"])
        except HttpError as e:
            if e.status == 403:
                self.metrics.auth_failure("namespace")
            raise
        cands, found = await self._probe(request, self.store_for(p), cands)
        entries: list[dict[str, Any]] = [{"key": k.to_str(), "n_tokens": k.n_tokens, "url": f"{ENTRIES}/{k.to_str()}"}
                                         for k, ok in zip(cands, found) if ok]
        n = entries[0]["n_tokens"] if entries else 0
        self.metrics.lookup(n_ids, n)
        return json_reply({"n_tokens": n, "tokens": n_ids, "key": entries[0]["key"] if entries else None,
                           "entries": entries})



async def no_route(request: web.Request) -> web.StreamResponse:
    """The catch-all route: 405 (with ``Allow``) for a path another route serves with other methods, else 404."""
    allowed: set[str] = set()
    for res in request.app.router.resources():
        if res is not request.match_info.route.resource:
            allowed |= (await res.resolve(request))[1]
    if allowed:
        raise web.HTTPMethodNotAllowed(request.method, allowed)
    raise web.HTTPNotFound()


def _listing(st: Store, p: Principal, ns: str | None, with_meta: bool) -> bytes:
    """``{"entries": [...]}`` of ``p``'s visible entries in ``st`` (of namespace ``ns``), as JSON bytes; runs in a
    store thread (:meth:`KdnService.ls`)."""
    out = []
    for r in st.ls(with_meta=True, namespace=ns):
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
    return json.dumps({"entries": out}, sort_keys=True).encode()


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
        run_server(app, svc.peers, host, port, ready=announce, send_stall=svc.config.body_idle_timeout)
    except OSError as e:  # address in use, no permission, unknown host
        raise KvcInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None

