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
Keys sent in clear (logical keys, e.g. by curl) must also be in one of the
token's namespaces.

The store is synchronous (directory, Redis, S3 tiers); every store call runs
in a worker thread with a deadline, so one slow tier never stalls the event
loop.  Request bodies are capped (``max_body``) and must arrive within
``body_timeout`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from email.utils import formatdate
from typing import Any, Awaitable, Callable

from aiohttp import web

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store import Store, StoreKey
from kvcodec.store.tiers.kdn import API, CONTENT_TYPE, H_CRC, H_CREATED, H_META, MAX_CONTAINS, MAX_META_HEADER
from kvcodec.store.keys import DEFAULT_CHUNK, chunk_hashes, prefix_keys
from kvcodec.store.tenant import PHYS_MODEL, TenantKey
from kvcodec.store.tiers.base import MAX_TIER_META, check_meta, crc32c
from kvcodec.service.auth import Principal, TokenTable
from kvcodec.service.metrics import Metrics

log = logging.getLogger("kvcodec.service")

MAX_LOOKUP_TOKENS = 1 << 20
MAX_JSON_BODY = 16 << 20

PRINCIPAL = web.AppKey("principal", Principal)
SERVICE = web.AppKey("service", object)


@dataclass
class ServiceConfig:
    """Limits and options of one service instance (``kvc serve`` flags)."""

    max_body: int = 1 << 30          # bytes of one PUT body
    body_timeout: float = 120.0      # seconds to receive a body
    op_timeout: float = 30.0         # seconds for one store operation
    verify_timeout: float = 300.0    # seconds to verify (decode) one put
    verify: bool = True              # decode every chunk of a put (False: structure + CRCs only)
    models: list[str] = field(default_factory=list)  # models whose tokenizers serve text lookups


class HttpError(Exception):
    """A clean 4xx/5xx answer: status and a one-line message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


def _json(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(status=status, text=json.dumps(obj, sort_keys=True), content_type="application/json",
                        headers=headers)


class KdnService:
    """State of one ``kvc serve``: the store, the token table, metrics and (optional) tokenizers."""

    def __init__(self, store: Store, tokens: TokenTable, config: ServiceConfig | None = None,
                 server_key: TenantKey | None = None) -> None:
        from kvcodec.format import KvcReader  # noqa: F401  (imports torch: at start, not in the first put)

        self.store = store  # the backing tiers; requests go through per-tenant views (store_for)
        self.server_key = server_key or store.key
        self._views: dict[str, Store] = {}
        self._views_lock = threading.Lock()
        self.tokens = tokens
        self.config = config or ServiceConfig()
        self.metrics = Metrics()
        self._etags: dict[tuple[StoreKey, float | None, int], str] = {}
        self._tokenizers: dict[str, Any] = {}  # fingerprint id -> tokenizer
        for m in self.config.models:
            self._add_model(m)

    def store_for(self, p: Principal) -> Store:
        """The tenant's view of the backing tiers: a Store whose tenant key is derived for ``p.tenant``."""
        with self._views_lock:
            st = self._views.get(p.tenant)
            if st is None:
                secret = self.server_key.namespace(f"kdn-tenant.{p.tenant}").name_key
                st = self._views[p.tenant] = self.store.for_key(TenantKey(secret, f"kdn tenant {p.tenant}"))
            return st

    def _add_model(self, name: str) -> None:
        from kvcodec.models.load import load_model

        lm = load_model(name)
        self._tokenizers[lm.fingerprint.id] = lm.tokenizer
        log.info("kdn: text lookups for model %s (fingerprint %s)", name, lm.fingerprint.id)

    # -- app ------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=self.config.max_body,
                              middlewares=[self._errors_mw, self._auth_mw],
                              handler_args={"max_field_size": MAX_META_HEADER + 1024})
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
        app.on_cleanup.append(self._close)
        return app

    async def _close(self, app: web.Application) -> None:
        self.store.close()  # the views share these tiers

    # -- middlewares ----------------------------------------------------------------
    @web.middleware
    async def _errors_mw(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                         ) -> web.StreamResponse:
        t0 = time.perf_counter()
        route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
        try:
            resp = await handler(request)
        except HttpError as e:
            resp = _json({"error": str(e)}, e.status, e.headers)
        except web.HTTPException as e:  # aiohttp's own: 404 no route, 405, 413 body too large
            if e.status == 413:
                msg = f"request body larger than the limit of {self.config.max_body} bytes"
            else:
                msg = e.reason
            resp = _json({"error": msg}, e.status, {k: v for k, v in e.headers.items() if k in ("Allow",)})
        except KvcInputError as e:
            resp = _json({"error": str(e)}, 400)
        except KvcFormatError as e:
            resp = _json({"error": str(e)}, 422)
        except KvcStoreError as e:
            resp = _json({"error": str(e)}, 503)
        except KvcError as e:
            resp = _json({"error": str(e)}, 422)
        self.metrics.request(request.method, route, resp.status, time.perf_counter() - t0)
        return resp

    @web.middleware
    async def _auth_mw(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
                       ) -> web.StreamResponse:
        if request.path.startswith(API + "/"):
            h = request.headers.get("Authorization", "")
            scheme, _, tok = h.partition(" ")
            if scheme.lower() != "bearer" or not tok.strip():
                self.metrics.auth_failure("missing")
                raise HttpError(401, "missing bearer token (Authorization: Bearer <token>)",
                                {"WWW-Authenticate": 'Bearer realm="kvc"'})
            p = self.tokens.lookup(tok.strip())
            if p is None:
                self.metrics.auth_failure("invalid")
                raise HttpError(401, "invalid token", {"WWW-Authenticate": 'Bearer realm="kvc", error="invalid_token"'})
            request[PRINCIPAL] = p
        return await handler(request)

    # -- helpers ------------------------------------------------------------------------
    async def _run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> Any:
        """A blocking call in a worker thread, with a deadline (default: the store operation's)."""
        loop = asyncio.get_running_loop()
        limit = timeout or self.config.op_timeout
        try:
            return await asyncio.wait_for(loop.run_in_executor(None, fn, *args), limit)
        except asyncio.TimeoutError:
            raise HttpError(504, f"operation took longer than {limit:g} s") from None

    def _key(self, request: web.Request, write: bool = False) -> tuple[StoreKey, Principal]:
        try:
            key = StoreKey.from_str(request.match_info["key"])
        except KvcInputError as e:
            raise HttpError(400, str(e)) from None
        p: Principal = request[PRINCIPAL]
        if key.model == PHYS_MODEL:  # an opaque name from a sealing client: isolation is the tenant's view
            self._allow(p, None, write)
        else:
            self._allow(p, key.namespace, write)
        return key, p

    def _allow(self, p: Principal, namespace: str | None, write: bool = False) -> None:
        if namespace is not None and not p.may_use(namespace):
            self.metrics.auth_failure("namespace")
            raise HttpError(403, f"tenant {p.tenant!r} may not use namespace {namespace!r}")
        if write and not p.write:
            self.metrics.auth_failure("read_only")
            raise HttpError(403, f"tenant {p.tenant!r} has a read-only token")

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        if request.content_length is not None and request.content_length > MAX_JSON_BODY:
            raise HttpError(413, f"JSON body larger than {MAX_JSON_BODY} bytes")
        raw = await self._body(request, MAX_JSON_BODY)
        try:
            obj = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as e:
            raise HttpError(400, f"body is not JSON: {e}") from None
        if not isinstance(obj, dict):
            raise HttpError(400, "body must be a JSON object")
        return obj

    async def _body(self, request: web.Request, limit: int) -> bytes:
        if request.content_length is not None and request.content_length > limit:
            raise HttpError(413, f"request body of {request.content_length} bytes is larger than the limit of {limit}")
        try:
            return await asyncio.wait_for(request.read(), self.config.body_timeout)
        except asyncio.TimeoutError:
            raise HttpError(408, f"request body not received within {self.config.body_timeout:g} s") from None

    def _etag(self, key: StoreKey, data: bytes, created: float | None) -> tuple[str, str]:
        """``(etag, crc32c hex)`` of an entry version; cached by (key, created, size)."""
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
        body, ctype = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": ctype})

    async def whoami(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        return _json({"tenant": p.tenant, "namespaces": list(p.namespaces), "write": p.write})

    async def put(self, request: web.Request) -> web.Response:
        key, p = self._key(request, write=True)
        st = self.store_for(p)
        meta_s = request.headers.get(H_META, "{}")
        if len(meta_s) > MAX_META_HEADER:
            raise HttpError(400, f"{H_META} larger than {MAX_META_HEADER} bytes")
        try:
            meta = check_meta(json.loads(meta_s), MAX_TIER_META)
        except ValueError as e:
            raise HttpError(400, f"{H_META} is not JSON: {e}") from None
        data = await self._body(request, self.config.max_body)
        if not data:
            raise HttpError(400, "empty body: PUT a .kvc file")
        want = request.headers.get(H_CRC)
        if want is not None and f"{crc32c(data):08x}" != want.strip().lower():
            self.metrics.put("rejected")
            raise HttpError(400, f"body fails its {H_CRC} checksum (damaged in transit)")
        inm = request.headers.get("If-None-Match")
        if inm is not None:
            if inm.strip() != "*":
                raise HttpError(400, "PUT supports only If-None-Match: *")
            if (await self._run(st.contains_many, [key]))[0]:
                raise HttpError(412, f"{key} already exists")
        try:
            await self._run(self.check_entry, self._logical(key, meta), data, timeout=self.config.verify_timeout)
        except KvcError as e:
            self.metrics.put("rejected")
            raise HttpError(422, f"entry refused: {e}") from None
        res = await self._run(st.put, key, data, meta)
        self.metrics.put("ok", len(data))
        return _json({"key": key.to_str(), "bytes": len(data), "stored_in": res.stored_in, "failed": res.failed},
                     201, {"Location": request.path})

    @staticmethod
    def _logical(key: StoreKey, meta: dict[str, Any]) -> StoreKey:
        """The key whose tokens the entry must hold: ``key``, or for a physical key the one its seal names."""
        if key.model != PHYS_MODEL:
            return key
        try:
            return StoreKey.from_str(meta["key"])
        except (KeyError, TypeError, KvcInputError):
            raise HttpError(422, "an entry under a physical key must carry its seal (metadata naming the "
                                 "logical key)") from None

    def check_entry(self, key: StoreKey, data: bytes) -> None:
        """Raise :class:`KvcError` unless ``data`` is a sound ``.kvc`` whose token ids hash to ``key``.

        A multi-level manifest (codec ``levels-v1``, spec/levels-v1.md) holds no
        token ids: it must parse, validate and name ``key``; its level chunks are
        ordinary ``.kvc`` entries checked as above.
        """
        from kvcodec.format import KvcReader
        from kvcodec.store.levels import LEVELS_CODEC, LevelManifest

        if key.codec == LEVELS_CODEC:
            LevelManifest.from_bytes(data, key)
            return

        with KvcReader(data) as r:
            if self.config.verify:
                problems = r.verify()
                if problems:
                    raise KvcFormatError(f"the .kvc does not verify: {problems[0]}")
            ids = r.token_ids
            if ids is None:
                raise KvcInputError("the .kvc carries no token ids (encode with token ids stored)")
            if r.fingerprint.id != key.model:
                raise KvcInputError(f"the .kvc is for model {r.fingerprint.id}, the key names model {key.model}")
        if len(ids) != key.n_tokens:
            raise KvcInputError(f"the .kvc holds {len(ids)} token ids, the key says {key.n_tokens}")
        for c in chunk_candidates(key.n_tokens):
            hs = chunk_hashes(ids, c, model=key.model, codec=key.codec, namespace=key.namespace)
            if hs and hs[-1].hex() == key.digest:
                return
        raise KvcInputError("the .kvc's token ids do not hash to the key's digest (spec/store-keys.md)")

    async def get(self, request: web.Request) -> web.StreamResponse:
        key, p = self._key(request)
        e = await self._run(self.store_for(p).get_entry, key)
        if e is None:
            self.metrics.get(False)
            raise HttpError(404, f"no entry {key}")
        data: bytes = e.data
        etag, crc = self._etag(key, data, e.created)
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
            try:
                sl = request.http_range
            except ValueError:  # multiple or malformed ranges: RFC 9110 lets us send the whole entry
                sl = None
            if sl is not None:
                first, stop = _resolve_range(sl, len(data))
                if first is None:
                    self.metrics.get(True)
                    return web.Response(status=416, headers={"Content-Range": f"bytes */{len(data)}", "ETag": etag})
                headers["Content-Range"] = f"bytes {first}-{stop - 1}/{len(data)}"
                body = data[first:stop]
                self.metrics.get(True, len(body) if request.method == "GET" else 0)
                return web.Response(status=206, body=body, headers=headers)
        self.metrics.get(True, len(data) if request.method == "GET" else 0)
        return web.Response(status=200, body=data, headers=headers)

    async def delete(self, request: web.Request) -> web.Response:
        key, p = self._key(request, write=True)
        if not await self._run(self.store_for(p).rm, key):
            raise HttpError(404, f"no entry {key}")
        return web.Response(status=204)

    async def ls(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        with_meta = request.query.get("meta", "0") in ("1", "true")
        ns = request.query.get("namespace")
        if ns is not None:
            self._allow(p, ns)
        st = self.store_for(p)
        rows = await self._run(lambda: st.ls(with_meta=with_meta, namespace=ns))
        return _json({"entries": [{**r.to_dict(), "tier": "kdn"} for r in rows]})

    async def contains(self, request: web.Request) -> web.Response:
        p: Principal = request[PRINCIPAL]
        obj = await self._json_body(request)
        ks = obj.get("keys")
        if not isinstance(ks, list) or len(ks) > MAX_CONTAINS:
            raise HttpError(400, f"'keys' must be a list of at most {MAX_CONTAINS} key strings")
        keys = [StoreKey.from_str(k) for k in ks]
        for k in keys:
            self._allow(p, None if k.model == PHYS_MODEL else k.namespace)
        found = await self._run(self.store_for(p).contains_many, keys)
        return _json({"found": found})

    async def lookup(self, request: web.Request) -> web.Response:
        """Longest cached prefix of token ids (or of a text, tokenized with the model's tokenizer)."""
        p: Principal = request[PRINCIPAL]
        obj = await self._json_body(request)
        model, codec = obj.get("model"), obj.get("codec")
        ns = obj.get("namespace", p.namespaces[0])
        chunk = obj.get("chunk", DEFAULT_CHUNK)
        if not isinstance(model, str) or not isinstance(codec, str) or not isinstance(ns, str):
            raise HttpError(400, "lookup needs string fields 'model' (fingerprint id) and 'codec'")
        if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= 1 << 16:
            raise HttpError(400, "'chunk' must be an integer in [1, 65536]")
        self._allow(p, ns)
        if ("token_ids" in obj) == ("text" in obj):
            raise HttpError(400, "give exactly one of 'token_ids' and 'text'")
        if "text" in obj:
            text = obj["text"]
            if not isinstance(text, str) or not text:
                raise HttpError(400, "'text' must be a non-empty string")
            tok = self._tokenizers.get(model)
            if tok is None:
                raise HttpError(422, f"this service has no tokenizer for model {model} (start it with --model, "
                                     "or send token_ids)")
            from kvcodec.models.capture import tokenize

            ids = [int(x) for x in tokenize(tok, text)]
        else:
            ids = obj["token_ids"]
            if not isinstance(ids, list) or len(ids) > MAX_LOOKUP_TOKENS or \
                    not all(isinstance(x, int) and not isinstance(x, bool) for x in ids):
                raise HttpError(400, f"'token_ids' must be a list of at most {MAX_LOOKUP_TOKENS} integers")
        cands = prefix_keys(ids, model=model, codec=codec, namespace=ns, chunk=chunk) if ids else []
        found = await self._run(self.store_for(p).contains_many, cands) if cands else []
        entries = [{"key": k.to_str(), "n_tokens": k.n_tokens, "url": f"{API}/entries/{k.to_str()}"}
                   for k, ok in zip(cands, found) if ok]
        n = entries[0]["n_tokens"] if entries else 0
        self.metrics.lookup(len(ids), n)
        return _json({"n_tokens": n, "tokens": len(ids), "key": entries[0]["key"] if entries else None,
                      "entries": entries})


def chunk_candidates(n_tokens: int) -> list[int]:
    """Chunk sizes a key digest of ``n_tokens`` tokens may have been chained with.

    ``ask`` and blend chain in chunks of 256 (the last one may be partial); the vLLM
    connector keys chunk entries covering ``k * chunk_tokens`` tokens, so its
    chunk size divides the entry's token count.  256 first, then every divisor.
    """
    divs = {DEFAULT_CHUNK}
    i = 1
    while i * i <= n_tokens:
        if n_tokens % i == 0:
            divs.update((i, n_tokens // i))
        i += 1
    return [DEFAULT_CHUNK] + sorted(divs - {DEFAULT_CHUNK}, reverse=True)


def _resolve_range(sl: slice, size: int) -> tuple[int | None, int]:
    """``(first, stop)`` of a single byte range against an entry of ``size`` bytes (first None: unsatisfiable)."""
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
    return KdnService(Store.open(store_url, memory_bytes=64 << 20), tokens, config).app()


def serve(store_url: str, tokens: TokenTable, *, host: str = "127.0.0.1", port: int = 8470,
          config: ServiceConfig | None = None, ready: Callable[[str], None] | None = None) -> None:
    """Run the service until interrupted (SIGINT/SIGTERM)."""
    app = make_app(store_url, tokens, config)

    def announce(*parts: Any, **_: Any) -> None:
        if ready is not None:
            ready(f"http://{host}:{port}")

    try:
        web.run_app(app, host=host, port=port, print=announce, access_log=None, shutdown_timeout=5.0)
    except OSError as e:  # address in use, no permission, unknown host
        raise KvcInputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
