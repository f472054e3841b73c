"""Issue 8: ask from the store == ask by prefill; other model/codec/tenant never hit."""

from __future__ import annotations

import json

import pytest

from kvcodec.knowledge import KnowledgeBase, codec_id
from kvcodec.store import Store

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


def test_other_codec_namespace_or_model_miss(lm, other_lm, tmp_path):
    url = str(tmp_path / "st")
    KnowledgeBase(lm, url, preset="lossless", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1)
    assert KnowledgeBase(lm, url, preset="lossless", namespace="tenant-b").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert KnowledgeBase(lm, url, preset="zstd", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert KnowledgeBase(other_lm, url, preset="lossless", namespace="tenant-a").ask([DOC], "Q?", max_new_tokens=1, store_new=False).source == "prefill"
    assert codec_id("lossless") != codec_id("zstd")
    with Store.open(url) as st:
        assert len(st.ls()) == 1


def test_cli_store_put_ls_get_rm(lm, small_cache, tmp_path, capsys):
    from kvcodec.format import encode_kvc_bytes, get_plan
    from kvcodec.cli.main import main

    plan = get_plan("lossless", small_cache)
    f = tmp_path / "c.kvc"
    f.write_bytes(encode_kvc_bytes(small_cache, plan.pipelines, preset=plan.preset))
    url = str(tmp_path / "st")

    def run(*args):
        with pytest.raises(SystemExit) as e:
            main(list(args))
        out = capsys.readouterr()
        return e.value.code, out.out, out.err

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
