"""The edit-log golden vectors (spec/vectors/kvc-edit, spec/kvc-v1.md §4.5): checked, never regenerated."""

from __future__ import annotations

import pytest

from kvcodec.edit.entry import open_parent
from kvcodec.errors import KvcFormatError
from kvcodec.testing.golden import EDIT_DIR, check_edit_vectors


def test_edit_vectors_hold():
    assert check_edit_vectors() == []


@pytest.mark.parametrize("name, msg", [("log_loops", "loops"), ("log_bad_op", "op 'rewrite'")])
def test_the_editor_refuses_hostile_logs_before_any_work(name, msg):
    with pytest.raises(KvcFormatError, match=msg):
        open_parent(EDIT_DIR / f"{name}.kvc")


def test_a_chain_member_opens_with_its_digest():
    p = open_parent(EDIT_DIR / "chain_2_redact.kvc")
    assert p.reader.header.num_context_tokens == 6 and len(p.meta["edits"]) == 2
