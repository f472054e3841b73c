"""``POST /v1/entries/{key}/edit``: offline editing of a stored entry through the KDN (issue 37).

Body: ``{"op": "append" | "redact" | "steer", "params": {...}}`` (the parameters of :mod:`kvcodec.edit.stored`).
The entry at ``key`` is read from the caller's tenant view (another tenant's entry is not there: 404),
edited, and the child is put under the key of its own token ids, in the same namespace (201 with
``{"key", "parent", "bytes", "op", "params", "tokens", ...}``). The parent is never changed. The token
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
import threading
import time
from typing import Any, Awaitable

from aiohttp import web

from kvcodec.service.checks import HttpError

__all__ = ["EDIT_TIMEOUT", "add_edit_routes", "edit_entry"]

EDIT_TIMEOUT = 300.0  # seconds of model work for one edit (a redaction of a long context on a CPU)

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
    from kvcodec.edit.stored import child_of, put_meta
    from kvcodec.store.tenant import PHYS_MODEL

    key, p = svc._key(request, write=True)
    if key.model == PHYS_MODEL:
        raise HttpError(400, "edits take a key in clear (the service must know the entry's model and tokens)")
    _, body = await svc._json_body(request)
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
    child, res = await _model_work(svc, request, p.tenant, child_of, lm, key, bytes(entry.data), op, params)
    put = await svc._run(request, st.put, child, res.data, put_meta(op, key))
    reply = {"key": child.to_str(), "parent": key.to_str(), "bytes": res.size, "stored_in": put.stored_in,
             "failed": put.failed, **{k: v for k, v in res.to_json().items() if k not in ("output", "size")}}
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


def add_edit_routes(svc: Any, router: web.UrlDispatcher, api: str) -> None:
    """Register the edit route of ``svc`` (called once by :meth:`kvcodec.service.app.KdnService.app`)."""

    def handler(request: web.Request) -> Awaitable[web.StreamResponse]:
        return edit_entry(svc, request)

    router.add_post(f"{api}/entries/{{key}}/edit", handler)
