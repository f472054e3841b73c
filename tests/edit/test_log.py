"""The edit log (meta.edits): well-formed records, loops refused, chains bounded."""

from __future__ import annotations

import pytest

from kvcodec.edit.log import EDITS_META_KEY, MAX_EDITS, extend_log, parse_log
from kvcodec.errors import KvcFormatError, KvcInputError

A, B, C, T = "a" * 64, "b" * 64, "c" * 64, "d" * 64


def rec(parent: str, op: str = "append") -> dict:
    return {"op": op, "params": {}, "parent_sha256": parent, "parent_token_ids_sha256": T}


def test_a_file_never_edited_has_an_empty_log():
    assert parse_log({}) == []
    assert parse_log({"model": "smollm2"}) == []


def test_extend_appends_one_record_naming_the_parent():
    log = extend_log({EDITS_META_KEY: [rec(A)]}, B, T, "redact", {"token_spans": [[1, 2]]})
    assert [r["parent_sha256"] for r in log] == [A, B]
    assert log[-1]["op"] == "redact" and log[-1]["params"] == {"token_spans": [[1, 2]]}
    assert [r.op for r in parse_log({EDITS_META_KEY: log})] == ["append", "redact"]


@pytest.mark.parametrize("bad, msg", [
    ("nope", "must be a list"),
    ([rec(A, op="rewrite")], "op 'rewrite'"),
    ([{"op": "append", "parent_sha256": "xyz", "parent_token_ids_sha256": T}], "parent_sha256 must be 64"),
    ([{"op": "append", "parent_sha256": A, "parent_token_ids_sha256": T, "params": []}], "params must be an object"),
    ([{"op": "append", "parent_sha256": A, "parent_token_ids_sha256": T, "params": {"x": "y" * 5000}}], "at most"),
    ([rec(A), rec(B), rec(A)], "loops"),
    ([rec(A)] * (MAX_EDITS + 1), "at most"),
])
def test_hostile_logs_are_one_format_error(bad, msg):
    with pytest.raises(KvcFormatError, match=msg):
        parse_log({EDITS_META_KEY: bad})


def test_a_log_naming_its_own_file_as_ancestor_loops():
    with pytest.raises(KvcFormatError, match="loops"):
        parse_log({EDITS_META_KEY: [rec(A), rec(C)]}, own_sha256=C)
    with pytest.raises(KvcFormatError, match="loops"):
        extend_log({EDITS_META_KEY: [rec(A)]}, A, T, "append", {})


def test_the_chain_length_is_bounded():
    full = [rec(f"{i:064x}") for i in range(MAX_EDITS)]
    with pytest.raises(KvcInputError, match="already been edited"):
        extend_log({EDITS_META_KEY: full}, C, T, "append", {})


def test_a_redaction_seals_what_came_before_and_names_its_parent_only_by_a_keyed_digest():
    """Issue 55: a redacted child's log carries no plain digest of any ancestor and no earlier parameters."""
    from kvcodec.edit.log import lineage_mac, redaction_log

    parent_meta = {EDITS_META_KEY: [{**rec(A), "params": {"appended_token_ids_sha256": C, "tokens": 3}}]}
    log = redaction_log(parent_meta, B, {"token_spans": [[1, 2]], "removed_tokens": 1}, lineage_key=b"k" * 32)
    assert log[0] == {"op": "append", "sealed": True}
    assert log[1] == {"op": "redact", "params": {"token_spans": [[1, 2]], "removed_tokens": 1},
                      "parent_mac": lineage_mac(b"k" * 32, B)}
    text = str(log)
    assert A not in text and B not in text and C not in text and T not in text
    parsed = parse_log({EDITS_META_KEY: log})
    assert parsed[0].sealed and parsed[1].redaction and parsed[1].parent_sha256 is None
    # editing the redacted child further names it (it no longer holds the secret) in clear, as any edit does
    more = extend_log({EDITS_META_KEY: log}, C, T, "append", {})
    assert [r.op for r in parse_log({EDITS_META_KEY: more})] == ["append", "redact", "append"]
    assert redaction_log({}, B, {})[-1] == {"op": "redact", "params": {}}  # no key: no parent named at all


@pytest.mark.parametrize("bad, msg", [
    ([{"op": "append", "sealed": True}], "no redaction follows"),
    ([{"op": "append", "sealed": True, "params": {}}, {"op": "redact", "params": {}}], "sealed record is exactly"),
    ([{"op": "append", "sealed": "yes"}, {"op": "redact", "params": {}}], "sealed record is exactly"),
    ([{"op": "append", "params": {}}], "only a redaction"),
    ([{"op": "redact", "params": {}, "parent_mac": "xyz"}], "parent_mac must be 64"),
    ([{"op": "redact", "params": {}, "extra": 1}], "only a redaction"),
])
def test_hostile_redaction_logs_are_one_format_error(bad, msg):
    with pytest.raises(KvcFormatError, match=msg):
        parse_log({EDITS_META_KEY: bad})


def test_a_record_carries_the_childs_promise():
    """Issue 57: the promise rides on the record, a sealed record drops it, a redaction record may carry it."""
    from kvcodec.edit.log import entry_promise, promise_text, redaction_log

    keeps = {"preset": "balanced", "kl": 0.01, "top1": 0.93, "basis": "fresh prefill of the child's ids"}
    log = extend_log({}, A, T, "append", {"repair": "prefill"}, keeps)
    assert log[-1]["promise"] == keeps and entry_promise({EDITS_META_KEY: log}) == (True, keeps)
    assert promise_text(keeps).startswith("balanced (mean KL <= 0.01, top-1 >= 0.93) against an exact prefill")
    none = {"none": "the parent is lossy (balanced): its decode error is carried (repair=incremental)"}
    red = redaction_log({EDITS_META_KEY: log}, B, {"repair": "blend"}, promise=none)
    assert red[0] == {"op": "append", "sealed": True} and red[1]["promise"] == none
    assert entry_promise({EDITS_META_KEY: red}) == (True, none) and promise_text(none).startswith("none: the parent")
    assert entry_promise({}) == (False, None) and entry_promise({EDITS_META_KEY: [rec(A)]}) == (True, None)
    assert promise_text(None).startswith("not recorded")


@pytest.mark.parametrize("promise", [
    {"preset": "balanced"}, {"none": ""}, {"none": "x", "preset": "balanced"}, {"preset": "b", "basis": "x", "kl": -1},
    {"preset": "b", "basis": "x", "kl": float("nan")}, {"preset": "b", "basis": "x", "top1": True},
    {"preset": "b", "basis": "x" * 201}, {"preset": "b", "basis": "x", "extra": 1}, "balanced", [],
])
def test_hostile_promises_are_one_format_error(promise):
    with pytest.raises(KvcFormatError, match="promise must be"):
        parse_log({EDITS_META_KEY: [{**rec(A), "promise": promise}]})
    with pytest.raises(KvcFormatError, match="promise must be"):
        parse_log({EDITS_META_KEY: [{"op": "redact", "params": {}, "promise": promise}]})


@pytest.mark.model
@pytest.mark.parametrize("op", ["append", "redact"])
def test_a_full_chain_is_refused_before_the_edit_runs(lm, entry, op, monkeypatch):
    """An entry already edited MAX_EDITS times: the edit prefilled its child and only the write refused it."""
    from kvcodec.api import encode
    from kvcodec.core.kvcache import KVCache
    from kvcodec.edit.append import append
    from kvcodec.edit.redact import redact

    cache, _ = entry(24)
    full = [rec(f"{i:064x}") for i in range(MAX_EDITS)]
    data = encode(KVCache(cache.keys, cache.values, cache.token_ids, cache.fingerprint, None, {EDITS_META_KEY: full}),
                  None, preset="lossless").data
    ran = []
    monkeypatch.setattr("kvcodec.edit.append.capture", lambda *a, **k: ran.append(1))
    monkeypatch.setattr("kvcodec.edit.append.append_cache", lambda *a, **k: ran.append(1))
    monkeypatch.setattr("kvcodec.edit.redact._prefill", lambda *a, **k: ran.append(1))
    with pytest.raises(KvcInputError, match="already been edited"):
        if op == "append":
            append(lm, data, text=" more")
        else:
            redact(lm, data, token_spans=[(1, 2)])
    assert not ran
