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
