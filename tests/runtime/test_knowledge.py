"""Issue 8: ask from the store == ask by prefill; other model/codec/tenant never hit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcodec.runtime.knowledge import KnowledgeBase
from kvcodec.store.keys import codec_key
from kvcodec.store import Store

from cliutil import run_kvc  # noqa: E402

pytestmark = pytest.mark.model

DOC = open("/usr/share/common-licenses/Apache-2.0").read()[:600]
DOC2 = open("/usr/share/common-licenses/MPL-2.0").read()[:400]


def test_second_ask_loads_from_store_and_answers_identically(lm, tmp_path):
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    first = kb.ask([DOC], "What is this document?", max_new_tokens=12)
    assert first.source == "prefill" and first.cached_tokens == 0 and first.stored["stored_in"]
    second = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless").ask([DOC], "What is this document?", max_new_tokens=12)
    assert second.source == "store" and second.cached_tokens == second.context_tokens
    assert second.answer_ids == first.answer_ids
    assert second.prefill_ttft_s == pytest.approx(first.ttft_s)


def test_prefix_chain_reuses_the_first_document(lm, tmp_path):
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    kb.ask([DOC], "Summarize.", max_new_tokens=2)
    chained = kb.ask([DOC, DOC2], "Summarize.", max_new_tokens=6)
    ids, bounds = kb.context_ids([DOC, DOC2])
    assert chained.source == "store+prefill" and chained.cached_tokens == bounds[0]
    fresh = KnowledgeBase(lm, str(tmp_path / "other"), preset="lossless").ask([DOC, DOC2], "Summarize.", max_new_tokens=6, store_new=False)
    assert fresh.source == "prefill" and fresh.answer_ids == chained.answer_ids
    again = kb.ask([DOC, DOC2], "Summarize.", max_new_tokens=6)
    assert again.source == "store" and again.answer_ids == chained.answer_ids


@pytest.mark.parametrize("ns", ["a/b", "", "x" * 200])
def test_a_namespace_no_key_can_carry_is_refused(lm, tmp_path, ns, capsys):
    """`kvc ask --namespace a/b` answered by prefill with two warning lines and exited 0."""
    from kvcodec.errors import KvcInputError

    with pytest.raises(KvcInputError, match="namespace"):
        KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless", namespace=ns)
    code, out, err = run_kvc(["ask", "--doc", "apache2", "Q?", "--store", str(tmp_path / "st"), "--namespace", ns,
                              "--max-new-tokens", "1"], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 2 and len(lines) == 1 and "namespace" in lines[0] and not out, err


def test_other_codec_namespace_or_model_miss(lm, other_lm, tmp_path):
    url = str(tmp_path / "st")
    KnowledgeBase(lm, url, preset="lossless", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1)
    assert KnowledgeBase(lm, url, preset="lossless", namespace="tenant-b").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert KnowledgeBase(lm, url, preset="zstd", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert KnowledgeBase(other_lm, url, preset="lossless", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert codec_key("lossless") != codec_key("zstd")
    with Store.open(url) as st:
        assert len(st.ls()) == 1


def test_cli_store_put_ls_get_rm(lm, small_cache, tmp_path, capsys):
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.plan.presets import get_plan

    plan = get_plan("lossless", small_cache)
    f = tmp_path / "c.kvc"
    f.write_bytes(encode_kvc_bytes(small_cache, plan.pipelines, preset=plan.preset))
    url = str(tmp_path / "st")

    def run(*args):
        return run_kvc(list(args), capsys)

    code, out, _ = run("store", "put", str(f), "--store", url, "--json")
    assert code == 0
    key = json.loads(out)["key"]
    code, out, _ = run("store", "ls", "--store", url, "--json")
    assert [r["key"] for r in json.loads(out)] == [key]
    code, _, _ = run("store", "get", key, "-o", str(tmp_path / "back.kvc"), "--store", url)
    assert code == 0 and (tmp_path / "back.kvc").read_bytes() == f.read_bytes()
    assert run("store", "rm", key, "--store", url)[0] == 0
    code, _, err = run("store", "get", key, "-o", str(tmp_path / "x.kvc"), "--store", url)
    assert code != 0 and err.startswith("kvc: error: no entry")
    code, _, err = run("store", "get", "not-a-key", "-o", str(tmp_path / "x.kvc"), "--store", url)
    assert code != 0 and "bad store key" in err


# -- issue 9: blended asks over per-document chunks ---------------------------------------
BLEND_A = open("/usr/share/common-licenses/Apache-2.0").read()[:900]  # ~185 tokens
BLEND_B = open("/usr/share/common-licenses/MPL-2.0").read()[:900]  # ~210 tokens
BLEND_Q = "Which licenses are these?"


def test_blended_asks_store_each_chunk_and_load_them_in_any_order(lm, tmp_path):
    url = str(tmp_path / "st")
    kb = KnowledgeBase(lm, url, preset="lossless")
    n_a, n_b = len(kb.doc_ids(BLEND_A)), len(kb.doc_ids(BLEND_B))
    first = kb.ask_blended([BLEND_A, BLEND_B], BLEND_Q, max_new_tokens=6)
    assert first.source == "blend" and first.cached_tokens == 0
    assert first.context_tokens == len(kb.context_ids([BLEND_A, BLEND_B])[0])
    assert len(first.stored["chunks"]) == 2 and first.stored["stored_in"]
    assert set(first.stored["keys"]) == {kb.key(kb.doc_ids(BLEND_A)).to_str(), kb.key(kb.doc_ids(BLEND_B)).to_str()}
    with Store.open(url) as st:
        assert len(st.ls()) == 2
    # another process, the documents in the other order: both chunks come from the store, nothing new is stored
    second = KnowledgeBase(lm, url, preset="lossless").ask_blended([BLEND_B, BLEND_A], BLEND_Q, max_new_tokens=6)
    assert second.source == "blend" and second.cached_tokens == n_a + n_b and second.stored is None
    # a subset loads just its chunk
    third = kb.ask_blended([BLEND_B], BLEND_Q, max_new_tokens=2)
    assert third.cached_tokens == n_b and third.stored is None
    with Store.open(url) as st:
        assert len(st.ls()) == 2


def test_blend_ratio_one_equals_a_prefill_ask(lm, tmp_path):
    """recompute ratio 1 == a full prefill of the same tokens: the plain (prefill) ask gives the same greedy tokens."""
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    kb.ask_blended([BLEND_A, BLEND_B], BLEND_Q, max_new_tokens=1)  # deposit both chunks
    plain = KnowledgeBase(lm, str(tmp_path / "other"), preset="lossless").ask(
        [BLEND_B, BLEND_A], BLEND_Q, max_new_tokens=12, store_new=False)
    assert plain.source == "prefill"
    blended = kb.ask_blended([BLEND_B, BLEND_A], BLEND_Q, max_new_tokens=12, recompute_ratio=1.0)
    assert blended.cached_tokens > 0 and blended.context_tokens == plain.context_tokens
    assert blended.answer_ids == plain.answer_ids and blended.answer == plain.answer


def test_cli_ask_blend(lm, tmp_path, capsys, monkeypatch):
    import kvcodec.models.load

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    (tmp_path / "a.txt").write_text(BLEND_A)
    (tmp_path / "b.txt").write_text(BLEND_B)
    url = str(tmp_path / "st")

    def run(*args):
        return run_kvc(list(args), capsys)

    base = ["ask", "--store", url, "--preset", "lossless", "--max-new-tokens", "3"]
    code, out, err = run(*base, "--blend", "--doc", str(tmp_path / "a.txt"), "--doc", str(tmp_path / "b.txt"), BLEND_Q, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert d["source"] == "blend" and d["cached_tokens"] == 0 and len(d["stored"]["chunks"]) == 2
    code, out, err = run(*base, "--blend", "--recompute-ratio", "0.3", "--doc", str(tmp_path / "b.txt"),
                         "--doc", str(tmp_path / "a.txt"), BLEND_Q)
    assert code == 0, err
    assert "[blend: " in err and "recompute ratio 0.3" in err and "stored" not in err
    for bad, msg in ((["--blend", "--recompute-ratio", "1.5"], "[0, 1]"), (["--recompute-ratio", "0.5"], "only applies with --blend")):
        code, _, err = run(*base, *bad, "--doc", str(tmp_path / "a.txt"), BLEND_Q)
        assert code == 2 and err.startswith("kvc: error:") and msg in err and len(err.strip().splitlines()) == 1


def test_balanced_entry_from_the_store_stays_within_the_preset_quality(lm, gpl3_ids, tmp_path):
    """A `balanced` entry loaded from the store continues like the exact cache (KL <= 0.01, the preset's bound)."""
    from kvcodec.models.capture import capture
    from kvcodec.models.quality import evaluate
    from kvcodec.format import KvcReader

    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="balanced")
    exact = capture(lm, token_ids=gpl3_ids[:512])
    stored = kb.deposit(exact)
    # compressed (fp16 is 16): the encode-time check sizes the step from an out-of-sample probe, which at a
    # 512-token context costs more bits than the preset's fixed knob did (about 4.8 here)
    assert stored["bits_per_element"] < 6.0
    data = Store.open(str(tmp_path / "st")).get(kb.key(exact.token_ids))
    decoded = KvcReader(data).read_cache()
    q = evaluate(lm, exact, decoded, gpl3_ids[512:640], greedy_tokens=0)
    assert 0 < q.kl_mean <= 0.01, q


def _weak_chat(rm, factor, ratios):
    """``rm`` with ``balanced``'s chat probe rows at these measured-over-predicted ratios and this factor."""
    from dataclasses import replace

    rows = [{"text": "t", "tokens": 512, "kl": 1e-3 * r, "predicted": 1e-3} for r in ratios]
    return replace(rm, chat_factor={"balanced": {"factor": factor, "rows": rows, "version": 1}})


def test_the_kdn_checks_deposits_where_the_chat_probe_says_prediction_can_miss(lm, gpl3_ids, tmp_path, monkeypatch):
    """Issue 57: a knowledge base turns the encode-time check on by itself where the model's chat probe measured a
    context that the corrected prediction would send past the promise (a row > 1/AIM after the factor, or a factor
    at its ceiling), and only there; an explicit check=True/False wins; the check really runs on the deposit."""
    import kvcodec.api as api
    import kvcodec.plan.check as check_mod
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import CHAT_FACTOR_RANGE, load_rate_model
    from kvcodec.plan.ratecontrol import AIM

    cal = ensure_calibration(lm)
    shipped = load_rate_model(cal)
    assert api.check_by_default(lm, "balanced", cal) is None  # the shipped model's probe: prediction trusted
    margin = 1 / AIM
    cases = {(2.0, (2.0 * margin * 1.1, 1.0)): True, (2.0, (2.0 * margin * 0.9, 1.0)): False,
             (CHAT_FACTOR_RANGE[1], (16.0, 16.0)): True}
    for (factor, ratios), weak in cases.items():
        rm = _weak_chat(shipped, factor, ratios)
        monkeypatch.setattr(api, "resolve_rate_model", lambda *a, rm=rm, **k: rm)
        got = api.check_by_default(lm, "balanced", cal)
        assert (got is not None) == weak, (factor, ratios, got)
        assert api.check_by_default(lm, "balanced", cal, {"step0": 0.2}) is None  # a fixed step: no rate control
        assert api.check_by_default(lm, "near-lossless", cal) is None  # its rows are not measured here

    rm = _weak_chat(shipped, 2.0, (2.0 * margin * 1.5, 1.0))
    monkeypatch.setattr(api, "resolve_rate_model", lambda *a, **k: rm)
    calls = []
    real = check_mod.guarded_step
    monkeypatch.setattr(check_mod, "guarded_step", lambda *a, **k: calls.append(1) or real(*a, **k))
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="balanced")
    cache = kb.capture(np.concatenate([kb.prefix_ids(), gpl3_ids[:320]]))  # a chat context, as kvc ask stores
    stored = kb.deposit(cache)
    assert stored["checked"] and "chat probe" in stored["check_reason"] and calls == [1]
    kb2 = KnowledgeBase(lm, str(tmp_path / "st2"), preset="balanced", check=False)  # the caller's word wins
    assert kb2._rate() == "predict" and kb2.check_reason is None


def test_default_preset_falls_back_to_lossless_where_no_calibration_fits_the_window(lm, tmp_path, monkeypatch, caplog):
    """No preset named: the lossy default, except for a model whose window cannot hold the calibration or the rate
    fit (512 tokens: 256 of context and 256 of continuation), which would make every lossy deposit fail; that one
    stores lossless entries, with one warning naming its window. A named preset is used as named, without warning."""
    import logging

    import kvcodec.models.capture as capture_mod
    from kvcodec import api
    from kvcodec.calibration.build import min_calibration_window
    from kvcodec.onboard.ratefit import min_fit_window

    assert api.default_preset(lm) == (api.DEFAULT_LOSSY, None)  # SmolLM2's 8K window
    need = max(min_calibration_window(), min_fit_window())
    assert need == 512
    for window, want in ((need, api.DEFAULT_LOSSY), (need - 1, "lossless"), (256, "lossless"), (None, api.DEFAULT_LOSSY)):
        monkeypatch.setattr(capture_mod, "max_context", lambda _lm, w=window: w)
        preset, why = api.default_preset(lm)
        assert preset == want and (why is None) == (want == api.DEFAULT_LOSSY), (window, preset, why)
        if why is not None:
            assert f"window of {window} tokens" in why and str(need) in why
    monkeypatch.setattr(capture_mod, "max_context", lambda _lm: 256)
    why = api.default_preset(lm)[1]
    caplog.set_level(logging.WARNING, logger="kvcodec.runtime.knowledge")
    kb = KnowledgeBase(lm, str(tmp_path / "st"))
    assert kb.preset == "lossless" and kb.codec == codec_key("lossless", {})
    assert [r.getMessage() for r in caplog.records] == [f"storing lossless entries: {why}"]
    caplog.clear()
    assert KnowledgeBase(lm, str(tmp_path / "st"), preset="balanced").preset == "balanced" and not caplog.records

