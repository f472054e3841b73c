"""Edits of entries in a store (the KDN service's ``POST /v1/entries/{key}/edit``, :mod:`kvcodec.service.edit`).

An edit reads the entry at ``key`` from the caller's store view, runs the edit, and puts the child under
the key of **its own** token ids (:meth:`kvcodec.store.StoreKey.for_tokens`, same model and namespace, the
codec id of the child's preset): the key names what the entry now holds, and the parent stays where it
was. A tenant's store view finds only that tenant's entries (sealed under its key,
:mod:`kvcodec.store.tenant`), so another tenant's entry is simply not there: an edit can neither read nor
overwrite it. An edit whose child would land on its parent's key (nothing changed) is refused.

``params`` is JSON (the service's request body): each operation takes only the names below, and anything
else is one :class:`KvcInputError` line.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from kvcodec.edit.entry import EditResult
from kvcodec.errors import KvcInputError, KvcModelMismatchError

__all__ = ["OP_PARAMS", "child_of", "edit_stored", "lineage_key_for", "put_meta", "resolve_params", "run_edit"]

#: operation -> the parameters it accepts (JSON names, as the library functions spell them)
OP_PARAMS: dict[str, frozenset[str]] = {
    "append": frozenset({"text", "token_ids", "preset"}),
    "redact": frozenset({"pattern", "text", "char_spans", "token_spans", "repair", "recompute_ratio", "select_layer",
                         "preset"}),
    "steer": frozenset({"pattern", "text", "char_spans", "token_spans", "auto", "heads", "alpha", "preset"}),
}


def _pairs(v: Any, what: str) -> list[tuple[int, int]]:
    if not isinstance(v, list) or not all(isinstance(p, list) and len(p) == 2 and all(isinstance(x, int) and not isinstance(x, bool)
                                                                                     for x in p) for p in v):
        raise KvcInputError(f"{what} must be a list of [start, end] integer pairs")
    return [(int(a), int(b)) for a, b in v]


def _check_op(op: Any, params: Any) -> None:
    if op not in OP_PARAMS:
        raise KvcInputError(f"unknown edit {op!r:.40}; one of {', '.join(OP_PARAMS)}")
    if not isinstance(params, Mapping):
        raise KvcInputError("the edit's parameters must be a JSON object")
    extra = sorted(set(params) - OP_PARAMS[op])
    if extra:
        raise KvcInputError(f"{op} takes no parameter {extra[0]!r:.40} (it takes {', '.join(sorted(OP_PARAMS[op]))})")


def resolve_params(lm: Any, data: bytes, op: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` with a ``pattern``, ``text`` or ``char_spans`` replaced by the ``token_spans`` they name in the
    entry ``data`` (other edits' params unchanged).

    Why apart: matching a pattern is bounded (:data:`kvcodec.edit.spans.PATTERN_SECONDS`) but still takes time,
    and the service runs it here, *before* the edit takes the one model slot, so a slow pattern delays only
    its own request, never another tenant's edit (issue 55). The tokenizer is the only part of ``lm`` used."""
    _check_op(op, params)
    if op == "append" or not any(params.get(k) is not None for k in ("pattern", "text", "char_spans")):
        return dict(params)
    from kvcodec.edit.entry import open_parent
    from kvcodec.edit.spans import redaction_spans, resolve_spans

    kw: dict[str, Any] = {}
    for name in ("pattern", "text", "char_spans", "token_spans"):
        if params.get(name) is not None:
            v = params[name]
            if name in ("pattern", "text") and not isinstance(v, str):
                raise KvcInputError(f"{name} must be a string")
            kw[name] = _pairs(v, name) if name.endswith("spans") else v
    # the edit's own checks of the entry (its model, its log, ids stored and inside the vocabulary: an id past what
    # the tokenizer takes escaped the matching as an OverflowError, a 500), before any matching
    ids = open_parent(bytes(data)).token_ids(lm, op)
    # a redaction's spans are what redact() itself removes (what the join of the kept text spells again too)
    spans = (redaction_spans if op == "redact" else resolve_spans)(lm.tokenizer, ids, **kw)
    out = {k: v for k, v in params.items() if k not in ("pattern", "text", "char_spans")}
    out["token_spans"] = [list(s) for s in spans]
    return out


def run_edit(lm: Any, data: bytes, op: str, params: Mapping[str, Any], progress: Callable[[str], None] | None = None,
             lineage_key: bytes | None = None) -> EditResult:
    """Run edit ``op`` with JSON ``params`` on the `.kvc` bytes ``data``; the child comes back as bytes.
    ``lineage_key``: a redaction's (:func:`kvcodec.edit.redact.redact`)."""
    _check_op(op, params)
    preset = params.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise KvcInputError("preset must be a string")
    if op == "append":
        from kvcodec.edit.append import append

        text, ids = params.get("text"), params.get("token_ids")
        if text is not None and not isinstance(text, str):
            raise KvcInputError("text must be a string")
        if ids is not None and not (isinstance(ids, list) and all(isinstance(x, int) and not isinstance(x, bool)
                                                                   and 0 <= x < 1 << 63 for x in ids)):
            raise KvcInputError("token_ids must be a list of non-negative integers below 2**63")
        return append(lm, data, text=text, token_ids=ids, preset=preset, progress=progress)
    kw: dict[str, Any] = {}
    for name in ("pattern", "text"):
        if params.get(name) is not None:
            if not isinstance(params[name], str):
                raise KvcInputError(f"{name} must be a string")
            kw[name] = params[name]
    for name in ("char_spans", "token_spans"):
        if params.get(name) is not None:
            kw[name] = _pairs(params[name], name)
    if op == "steer":
        from kvcodec.edit.steer import DEFAULT_ALPHA, steer

        auto = params.get("auto")
        if auto is not None and (isinstance(auto, bool) or not isinstance(auto, int)):
            raise KvcInputError("auto must be an integer (how many sentences to choose)")
        return steer(lm, data, _pairs(params.get("heads"), "heads"), auto=auto, alpha=params.get("alpha", DEFAULT_ALPHA), preset=preset,
                     progress=progress, **kw)
    from kvcodec.edit.redact import redact

    repair = params.get("repair", "prefill")
    if not isinstance(repair, str):
        raise KvcInputError("repair must be a string")
    return redact(lm, data, repair=repair, recompute_ratio=params.get("recompute_ratio"),
                  select_layer=params.get("select_layer"), preset=preset, progress=progress, lineage_key=lineage_key, **kw)


def child_of(lm: Any, key: Any, data: bytes, op: str, params: Mapping[str, Any],
             progress: Callable[[str], None] | None = None, lineage_key: bytes | None = None) -> tuple[Any, EditResult]:
    """The edited child of the entry ``data`` stored at ``key`` and the key it belongs under (not stored yet)."""
    from kvcodec.store.keys import StoreKey, codec_key

    if key.model != lm.fingerprint.id:
        raise KvcModelMismatchError(f"the entry belongs to model {key.model[:40]}, not to {lm.fingerprint.id[:40]}")
    res = run_edit(lm, bytes(data), op, params, progress, lineage_key=lineage_key)
    assert res.data is not None and res.preset is not None
    child = StoreKey.for_tokens(res.cache.token_ids, model=key.model, codec=codec_key(res.preset), namespace=key.namespace)
    if child == key:
        raise KvcInputError("the edit leaves the entry's content and codec unchanged; an edit never happens in place")
    return child, res


def lineage_key_for(store: Any, namespace: str) -> bytes | None:
    """The lineage key of a store's tenant in ``namespace``: derived from its tenant key (so only that tenant can
    check a redaction's lineage), None for a store without one."""
    tk = getattr(store, "key", None)
    if tk is None or not hasattr(tk, "namespace"):
        return None
    import hashlib
    import hmac

    return hmac.new(tk.namespace(namespace).mac_key, b"kvcodec edit lineage key v1", hashlib.sha256).digest()


def put_meta(op: str, parent: Any, lineage_key: bytes | None = None) -> dict[str, Any]:
    """The store meta of an edited entry: which edit of which key made it (the file's own log has the rest).

    A redaction names its parent key only by an HMAC under ``lineage_key`` (none without one): a store key
    is a chained digest of the parent's token ids, which would let whoever reads the meta test guesses of
    what was removed (issue 55)."""
    if op != "redact":
        return {"edit": {"op": op, "parent": parent.to_str()}}
    if lineage_key is None:
        return {"edit": {"op": op}}
    import hashlib
    import hmac

    mac = hmac.new(lineage_key, b"kvcodec edit parent key\x00" + parent.to_str().encode(), hashlib.sha256).hexdigest()
    return {"edit": {"op": op, "parent_mac": mac}}


def edit_stored(lm: Any, store: Any, key: Any, op: str, params: Mapping[str, Any],
                progress: Callable[[str], None] | None = None) -> tuple[Any, EditResult]:
    """Edit the entry at ``key`` (a :class:`kvcodec.store.StoreKey`) of ``store`` into a new entry; returns its
    key and the result. The parent entry is never changed."""
    entry = store.get_entry(key)
    if entry is None:
        raise KvcInputError(f"no entry {key}")
    lkey = lineage_key_for(store, key.namespace)
    child, res = child_of(lm, key, bytes(entry.data), op, params, progress, lineage_key=lkey)
    store.put(child, res.data, put_meta(op, key, lkey))
    return child, res
