"""``kvc ask``'s speed-up claim: only against a prefill timed on the very context answered (issue 57)."""

from __future__ import annotations

import json

import pytest

from cliutil import run_kvc  # noqa: E402

pytestmark = pytest.mark.model

DOC = open("/usr/share/common-licenses/Apache-2.0").read()[:300]
DOC2 = open("/usr/share/common-licenses/MPL-2.0").read()[:200]
Q = "What is this document?"


def test_an_appended_entrys_answer_claims_no_speedup_against_its_parents_prefill(lm, tmp_path, capsys, monkeypatch):
    """The parent entry carries the prefill TTFT of its own (shorter) context; its appended child, the context of both
    documents, was never prefilled. An answer from the child used to report its speed-up against the parent's prefill;
    it now reports none and says why (tests/runtime/test_knowledge.py checks a hit on the parent's own context keeps
    its measured prefill TTFT)."""
    import kvcodec.models.load
    from kvcodec.edit.stored import edit_stored
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.store import Store

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    monkeypatch.setattr(type(lm), "warm_up", lambda self: 0.0)  # a fresh process's set-up; this one is warm
    (tmp_path / "a.txt").write_text(DOC)
    (tmp_path / "b.txt").write_text(DOC2)
    url = str(tmp_path / "st")
    base = ["ask", "--store", url, "--preset", "lossless", "--max-new-tokens", "2"]
    one, both = ["--doc", str(tmp_path / "a.txt")], ["--doc", str(tmp_path / "a.txt"), "--doc", str(tmp_path / "b.txt")]

    code, out, err = run_kvc([*base, *one, Q, "--json"], capsys)
    assert code == 0, err
    parent = json.loads(out)
    assert parent["source"] == "prefill" and parent["stored"]["stored_in"]
    kb = KnowledgeBase(lm, url, preset="lossless")
    ids, _ = kb.context_ids([DOC])
    with Store.open(url) as st:  # the child: the parent's entry with the second document's tokens appended
        child, _ = edit_stored(lm, st, kb.key(ids), "append", {"token_ids": kb.doc_ids(DOC2).tolist()})
    assert child == kb.key(kb.context_ids([DOC, DOC2])[0])

    code, out, err = run_kvc([*base, *both, Q, "--json"], capsys)
    assert code == 0, err
    d = json.loads(out)
    assert d["source"] == "store" and d["cached_tokens"] == d["context_tokens"] > parent["context_tokens"]
    assert d["prefill_ttft_s"] is None and d["speedup_vs_prefill"] is None  # said, not left out
    code, _, err = run_kvc([*base, *both, Q], capsys)
    assert code == 0 and "[store: " in err and "x faster" not in err and "no prefill of this context was timed" in err



def test_an_answer_past_the_window_names_the_flag_that_lowers_it(lm, tmp_path, capsys, monkeypatch):
    """`kvc ask` past the model's window said "use --max-tokens", a flag it does not have; from kvc the message
    names --max-new-tokens, and from Python the argument max_new_tokens (tests/runtime/test_blend.py)."""
    import kvcodec.models.load
    from kvcodec.models.capture import max_context

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    (tmp_path / "a.txt").write_text(DOC)
    code, _, err = run_kvc(["ask", "--no-store", "--doc", str(tmp_path / "a.txt"), "--max-new-tokens",
                            str(max_context(lm)), Q], capsys)
    assert code == 2 and "context window" in err and "(lower --max-new-tokens, or give a shorter text)" in err, err
    assert "--max-tokens" not in err
