"""Issue 14: an entry that ``ask`` / blend find but cannot read is a miss.

Each case uses a real entry of the embedded model deposited by a first ask,
then damages it the way it happens in practice: corrupt bytes behind a valid
header, the entry vanishing between lookup and get, or a file that needs a
calibration this machine does not have. The later ask must warn once, evict
the entry, answer exactly as a prefill does, and leave a good entry behind.
"""

from __future__ import annotations

import hashlib
import logging

import numpy as np
import pytest

from kvcodec.format import KvcReader
from kvcodec.runtime.knowledge import KnowledgeBase
from kvcodec.store import Store

from cliutil import run_kvc  # noqa: E402
from kvcodec.testing.surgery import header_obj, split, with_header  # noqa: E402

pytestmark = pytest.mark.model

DOC = open("/usr/share/common-licenses/Apache-2.0").read()[:600]
DOC2 = open("/usr/share/common-licenses/MPL-2.0").read()[:400]
Q = "What is this document?"


def plant(store: Store, key, data: bytes) -> None:
    """Put damaged payload bytes under ``key`` the way a tier that does not verify payloads would hold them."""
    store.put(key, data, {"note": "damaged by test"})


def corrupt_chunk(data: bytes) -> bytes:
    """Flip bytes inside the chunk data region: header, index and footer stay valid."""
    p = split(data)
    mid = p["dstart"] + len(p["data"]) // 2
    b = bytearray(data)
    for i in range(mid, mid + 16):
        b[i] ^= 0x5A
    out = bytes(b)
    with KvcReader(out) as r:  # still opens: only decoding the damaged chunk fails
        assert r.verify()
    return out


def unknown_calibration(data: bytes) -> bytes:
    """The same entry, but its external calibration attachments name a sha256 no calibration here has."""
    h = header_obj(data)
    ext = [n for n, a in h["attachments"].items() if a.get("blob") is None]
    assert ext, "a balanced entry references its calibration externally"
    for n in ext:
        h["attachments"][n]["sha256"] = hashlib.sha256(b"a calibration built on another machine " + n.encode()).hexdigest()
    return with_header(data, h)


def _good(store: Store, key) -> bytes:
    data = store.get(key)
    assert data is not None
    with KvcReader(data) as r:
        assert r.verify() == []
    return data


@pytest.fixture()
def warnings(caplog):
    caplog.set_level(logging.WARNING, logger="kvcodec.runtime.knowledge")
    return caplog


def _warned(caplog, key) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvcodec.runtime.knowledge" and key.to_str() in r.getMessage()]


@pytest.mark.parametrize("preset, damage", [("lossless", corrupt_chunk), ("balanced", unknown_calibration)])
def test_unreadable_entry_is_evicted_prefilled_and_replaced(lm, tmp_path, warnings, preset, damage):
    url = str(tmp_path / "st")
    kb = KnowledgeBase(lm, url, preset=preset)
    first = kb.ask([DOC], Q, max_new_tokens=8)
    assert first.source == "prefill"
    ids, _ = kb.context_ids([DOC])
    key = kb.key(ids)
    bad = damage(_good(kb.store, key))
    plant(kb.store, key, bad)
    assert kb.store.get(key) == bad

    ans = kb.ask([DOC], Q, max_new_tokens=8)
    assert ans.source == "prefill" and ans.cached_tokens == 0
    assert ans.answer_ids == first.answer_ids  # the answer is a prefill's, exactly
    assert [u["key"] for u in ans.unreadable] == [key.to_str()]
    assert len(_warned(warnings, key)) == 1
    good = _good(kb.store, key)  # a good entry is back in its place
    assert good != bad
    again = kb.ask([DOC], Q, max_new_tokens=8, store_new=False)
    assert again.source == "store" and not again.unreadable
    if preset == "lossless":
        assert again.answer_ids == first.answer_ids


def test_entry_vanishing_between_lookup_and_get_is_a_miss(lm, tmp_path, warnings, monkeypatch):
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    first = kb.ask([DOC], Q, max_new_tokens=6)
    key = kb.key(kb.context_ids([DOC])[0])
    real_get = kb.store.get
    calls = []

    def get_after_delete(k):
        calls.append(k)
        kb.store.rm(k)  # evicted / deleted by another process right after our lookup saw it
        return real_get(k)

    monkeypatch.setattr(kb.store, "get", get_after_delete)
    ans = kb.ask([DOC], Q, max_new_tokens=6)
    monkeypatch.undo()
    assert calls == [key]
    assert ans.source == "prefill" and ans.answer_ids == first.answer_ids
    assert "vanished" in ans.unreadable[0]["reason"] and len(_warned(warnings, key)) == 1
    _good(kb.store, key)  # stored again


def test_unreadable_prefix_entry_is_replaced_by_a_good_one(lm, tmp_path, warnings):
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    kb.ask([DOC], Q, max_new_tokens=2)
    ids, bounds = kb.context_ids([DOC, DOC2])
    pkey = kb.key(ids[: bounds[0]])
    good_prefix = _good(kb.store, pkey)
    plant(kb.store, pkey, corrupt_chunk(good_prefix))
    ans = kb.ask([DOC, DOC2], Q, max_new_tokens=6)
    fresh = KnowledgeBase(lm, str(tmp_path / "other"), preset="lossless").ask([DOC, DOC2], Q, max_new_tokens=6, store_new=False)
    assert ans.source == "prefill" and ans.answer_ids == fresh.answer_ids
    assert [u["key"] for u in ans.unreadable] == [pkey.to_str()]
    # the prefix entry is back, re-encoded from the longer prefill's KV (causal: the same K/V up to float rounding)
    with KvcReader(_good(kb.store, pkey)) as r, KvcReader(good_prefix) as g:
        back, orig = r.read_cache(), g.read_cache()
    assert np.array_equal(back.token_ids, ids[: bounds[0]])
    for a, b in zip(back.keys + back.values, orig.keys + orig.values):
        assert (a - b).abs().max().item() < 1e-3
    assert ans.stored["replaced"]["key"] == pkey.to_str()
    _good(kb.store, kb.key(ids))


def test_blend_treats_an_unreadable_chunk_as_a_miss(lm, tmp_path, warnings):
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    first = kb.ask_blended([DOC, DOC2], Q, max_new_tokens=6)
    k1 = kb.key(kb.doc_ids(DOC))
    plant(kb.store, k1, corrupt_chunk(_good(kb.store, k1)))
    ans = kb.ask_blended([DOC, DOC2], Q, max_new_tokens=6)
    assert ans.answer_ids == first.answer_ids  # lossless chunks: loading or recapturing give the same blend
    assert ans.cached_tokens == len(kb.doc_ids(DOC2))
    assert [u["key"] for u in ans.unreadable] == [k1.to_str()] and len(_warned(warnings, k1)) == 1
    assert ans.stored["keys"] == [k1.to_str()]
    _good(kb.store, k1)
    again = kb.ask_blended([DOC, DOC2], Q, max_new_tokens=6, store_new=False)
    assert again.cached_tokens == len(kb.doc_ids(DOC)) + len(kb.doc_ids(DOC2)) and not again.unreadable


def test_cli_ask_answers_past_a_corrupt_entry(lm, tmp_path, capsys):
    doc = tmp_path / "doc.txt"
    doc.write_text(DOC)
    url = str(tmp_path / "st")
    code, out1, err = run_kvc(["ask", "--doc", str(doc), "--store", url, "--preset", "lossless", "--max-new-tokens", "6", Q], capsys)
    assert code == 0, err
    kb = KnowledgeBase(lm, url, preset="lossless")
    key = kb.key(kb.context_ids([DOC])[0])
    plant(kb.store, key, corrupt_chunk(_good(kb.store, key)))
    code, out2, err = run_kvc(["ask", "--doc", str(doc), "--store", url, "--preset", "lossless", "--max-new-tokens", "6", Q], capsys)
    assert code == 0 and out2 == out1 and "Traceback" not in err
    lines = [ln for ln in err.splitlines() if "unreadable" in ln]
    assert len(lines) == 1 and key.to_str() in lines[0], err
    assert "[prefill:" in err
    with Store.open(url) as fresh:  # kb.store's in-process memory tier still holds what this test planted
        _good(fresh, key)


def test_bad_max_new_tokens_never_evicts_a_good_entry(lm, tmp_path):
    from kvcodec.errors import KvcInputError

    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    kb.ask([DOC], Q, max_new_tokens=1)
    key = kb.key(kb.context_ids([DOC])[0])
    before = _good(kb.store, key)
    with pytest.raises(KvcInputError):
        kb.ask([DOC], Q, max_new_tokens=0)
    assert kb.store.get(key) == before
    assert np.array_equal(KvcReader(before).token_ids, kb.context_ids([DOC])[0])
