"""``POST /v1/entries/{key}/edit``: offline editing of a stored entry through the KDN (issue 37).

Body: ``{"op": "append" | "redact" | "steer", "params": {...}}`` (the parameters of :mod:`kvcodec.edit.stored`).
The entry at ``key`` is read from the caller's tenant view (another tenant's entry is not there: 404),
edited, and the child is put under the key of its own token ids, in the same namespace (201 with
``{"key", "parent", "bytes", "op", "params", "tokens", ...}``; a redaction answers ``parent_key_mac``, an HMAC
of the parent key under the tenant's key, instead of ``parent``, and its ``params`` are its log's: the token
spans, never the pattern). The parent is never changed. A body is at most :data:`EDIT_MAX_BODY` bytes (413). The token
must be allowed to write to the key's namespace.

Why the service loads a model here, when it otherwise holds none: an edit recomputes K/V (the appended
tokens, a redaction's repaired tokens), which needs the weights. Only models named with ``kvc serve
--model`` can be edited (their directories are known, checked and fingerprinted at start-up); the model is
loaded on the first edit that needs it and kept. The work runs in a store thread under the request's
deadline (at most :data:`EDIT_TIMEOUT` s), and is bounded like a worker job's (issue 35): one model edit at a
time in the whole service, round-robin between tenants (``KdnService.edit_sched``), and the thread's CPU time
charged to the tenant's worker CPU share (``--tenant-worker-cpu``), so a tenant's next edit or worker job waits
while it is over its share. The other store threads and the event loop stay free for everyone else.
"""

from __future__ import annotations

import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable

from aiohttp import web

from kvcodec.service.checks import HttpError
from kvcodec.service.config import INLINE_JSON

__all__ = ["EDIT_MAX_BODY", "EDIT_TIMEOUT", "MATCH_NICE", "MATCH_SLOTS", "add_edit_routes", "edit_entry"]

EDIT_TIMEOUT = 300.0  # seconds of model work for one edit (a redaction of a long context on a CPU)
EDIT_MAX_BODY = INLINE_JSON  # bytes of an edit's JSON body: parsed on the event loop, so small
MATCH_SLOTS = 4  # edits' span matchings running at once in the service (one per tenant)
MATCH_NICE = 10  # the niceness of the threads that run them (below the service's other threads)

_models: dict[str, Any] = {}
_models_lock = threading.Lock()


def _model(model_dir: str) -> Any:
    with _models_lock:
        lm = _models.get(model_dir)
        if lm is None:
            from kvcodec.models.load import load_model

            lm = _models[model_dir] = load_model(model_dir)
        return lm


async def edit_entry(svc: Any, request: web.Request) -> web.Response:
    """The handler; ``svc`` is the :class:`kvcodec.service.app.KdnService` (passed in: this module imports
    nothing of app.py, which registers it)."""
    from kvcodec.edit.stored import child_of, lineage_key_for, put_meta, resolve_params
    from kvcodec.store.tenant import PHYS_MODEL

    key, p = svc._key(request, write=True)
    if key.model == PHYS_MODEL:
        raise HttpError(400, "edits take a key in clear (the service must know the entry's model and tokens)")
    raw, body = await svc._json_body(request)
    if body is None:  # larger than the service parses on its event loop: say so, not that its shape is wrong
        raise HttpError(413, f"edit body of {len(raw)} bytes is larger than the limit of {EDIT_MAX_BODY} bytes")
    if not isinstance(body, dict) or not isinstance(body.get("op"), str):
        raise HttpError(400, 'the body must be a small JSON object {"op": ..., "params": {...}}')
    op, params = body["op"], body.get("params", {})
    model_dir = svc._tokenizer_dirs.get(key.model)
    if model_dir is None:
        raise HttpError(400, f"this service edits entries of the models it was started with (--model); "
                             f"not of {key.model[:40]}")
    st = svc.store_for(p)
    entry = await svc._run(request, st.get_entry, key)
    if entry is None:
        raise HttpError(404, f"no entry {key}")
    lm = await _model_work(svc, request, p.tenant, _model, model_dir, charge=False)
    # spans first, in a store thread of the tenant's and outside the model slot: a pattern runs under its time
    # bound with the GIL released (kvcodec.edit.spans.regex_spans), and a slow one delays only this request
    if isinstance(params, dict) and any(params.get(k) is not None for k in ("pattern", "text", "char_spans")):
        params = await _match_work(svc, request, p.tenant, resolve_params, lm, bytes(entry.data), op, params)
    lkey = lineage_key_for(st, key.namespace)
    child, res = await _model_work(svc, request, p.tenant, child_of, lm, key, bytes(entry.data), op, params, None, lkey)
    put = await svc._run(request, st.put, child, res.data, put_meta(op, key, lkey))
    # a redaction's answer names its parent as its stored meta does (keyed), never by the key in clear
    parent = put_meta(op, key, lkey)["edit"]
    reply = {"key": child.to_str(), "bytes": res.size, "stored_in": put.stored_in, "failed": put.failed,
             **{k: v for k, v in res.to_json().items() if k not in ("output", "size")}}
    if "parent" in parent:
        reply["parent"] = parent["parent"]
    elif "parent_mac" in parent:
        reply["parent_key_mac"] = parent["parent_mac"]
    return web.Response(status=201, text=json.dumps(reply, sort_keys=True), content_type="application/json")


async def _model_work(svc: Any, request: web.Request, tenant: str, fn: Any, *args: Any, charge: bool = True) -> Any:
    """``fn(*args)``: model work in a store thread, one at a time in the service (fair between tenants), paced to
    and charged against the tenant's worker CPU share (module docstring).

    ``charge=False`` (loading a model): one at a time too, but neither paced nor charged. Why: the service
    loads each ``--model`` once and keeps it, so the load is shared infrastructure that whoever edits first
    happens to trigger; charging it to them would pace an ordinary tenant for everyone's benefit. It is bounded
    all the same: at most one load per model named at start-up, in the service's lifetime.
    """
    deadline = time.monotonic() + min(EDIT_TIMEOUT, svc._left(request))
    if charge:
        await svc.workers.pace(tenant, deadline)
    await svc.edit_sched.acquire(tenant, min(deadline, time.monotonic() + svc.config.queue_timeout))

    def done() -> None:  # when the thread really ends (a timed-out edit keeps its slot until then)
        svc.edit_sched.release(tenant)

    # _run charges the thread's CPU time to the tenant (unless charge is False) before done frees the slot
    return await svc._run(request, fn, *args, timeout=EDIT_TIMEOUT, on_done=done, charge=charge)


async def _match_work(svc: Any, request: web.Request, tenant: str, fn: Any, *args: Any) -> Any:
    """``fn(*args)`` (an edit's span matching) in a store thread, *outside* the model slot: at most
    :data:`MATCH_SLOTS` at once in the service and one per tenant (``svc.match_sched``), paced to and charged
    against the tenant's CPU share like its worker jobs. Why: a pattern runs for up to its time bound
    (:data:`kvcodec.edit.spans.PATTERN_SECONDS`) with the GIL released; without these bounds one tenant's
    catastrophic patterns, sent in parallel, would hold every core for that long (issue 55)."""
    deadline = time.monotonic() + min(EDIT_TIMEOUT, svc._left(request))
    await svc.workers.pace(tenant, deadline)
    await svc.match_sched.acquire(tenant, min(deadline, time.monotonic() + svc.config.queue_timeout))

    def done() -> None:
        svc.match_sched.release(tenant)

    def niced() -> tuple[Any, BaseException | None, float]:  # in the store thread: the match in a low-priority one
        try:
            result, used = _match_pool().submit(_timed, fn, *args).result()
        except Exception as exc:  # a pattern refused at its bound burned it: charged all the same, below
            return None, exc, float(getattr(exc, "kvc_cpu_s", 0.0))
        return result, None, used

    result, exc, used = await svc._run(request, niced, on_done=done)
    svc.workers.cpu.charge(tenant, used)  # on the event loop, as every charge (the bucket is the loop's)
    if exc is not None:
        raise exc
    return result


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    """Raise this thread's niceness to :data:`MATCH_NICE` (Linux: niceness is per thread; raising it needs no
    privilege). Why: a pattern is untrusted work that may burn its whole bound; at a low priority it takes the
    CPU the service's other threads and the machine's other processes leave, so other tenants' reads and edits
    keep their latency while it runs (issue 55, bench_kdn_attack.py's editregex class)."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), MATCH_NICE)
    except (AttributeError, OSError):  # not Linux, or not allowed: the bound and the pacing still hold
        pass


def _match_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(MATCH_SLOTS, thread_name_prefix="kvc-match", initializer=_lower_priority)
        return _pool


def _timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.thread_time()
    try:
        return fn(*args), time.thread_time() - t0
    except Exception as exc:
        exc.kvc_cpu_s = time.thread_time() - t0  # type: ignore[attr-defined]
        raise


def add_edit_routes(svc: Any, router: web.UrlDispatcher, api: str) -> None:
    """Register the edit route of ``svc`` (called once by :meth:`kvcodec.service.app.KdnService.app`)."""
    from kvcodec.service.fair import FairScheduler

    if getattr(svc, "match_sched", None) is None:  # an edit's span matching: a few at a time, one per tenant
        svc.match_sched = FairScheduler(MATCH_SLOTS, 1, max_queued=svc.config.tenant_queue, name="edit pattern")

    def handler(request: web.Request) -> Awaitable[web.StreamResponse]:
        return edit_entry(svc, request)

    from kvcodec.service.admission import expect_continue

    router.add_post(f"{api}/entries/{{key}}/edit", handler, expect_handler=expect_continue)
