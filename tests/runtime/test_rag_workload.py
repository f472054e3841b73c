"""Issue 34: the QA workload of benchmarks/bench_rag.py, and its KV-cache requests' fallback to prefill.

The workload's claims: the question file is what its generator writes (so a
reader can regenerate and diff it), every planted fact lands whole in exactly
one segment (else a request's knowledge may not hold its answer), the scores
mean what the benchmark says. The runtime's: a KV-cache request whose entry
is missing, corrupt or of another model is answered by prefill, with the
prefill's answer, counted as a fallback, never an error or a wrong cache.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import rag_workload as w  # noqa: E402


def test_question_file_is_the_generators_output():
    facts = w.load_facts()
    assert facts == w.make_facts(len(facts)) and len(facts) >= 200
    names = [f.question for f in facts]
    assert len(set(names)) == len(names)
    held_out = [f for f in facts if f.split == "held-out"]
    assert len(held_out) == len(facts) // 5
    assert all(f.answer in f.fact and f.answer not in f.question for f in facts)


def test_a_malformed_question_file_is_one_error(tmp_path):
    bad = tmp_path / "q.json"
    bad.write_text(json.dumps({"facts": [{"id": "x", "fact": "A is 1.", "question": "A?", "answer": "2", "at": 0.5,
                                          "split": "held-in"}]}))
    with pytest.raises(ValueError, match="bad position, split or answer"):
        w.load_facts(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not a question file"):
        w.load_facts(bad)


def words(s: str) -> int:
    return len(s.split())


def test_every_fact_lands_whole_in_exactly_one_segment():
    from kvcodec.texts import load_text

    facts = w.load_facts()[:60]
    paras = w.plant([load_text("apache2"), load_text("mpl2")], facts)
    assert sum(p in {f.fact for f in facts} for p in paras) == len(facts)
    for size in (300, 1000):
        segs = w.segments(paras, words, size)
        assert all(words(s) <= size for s in segs)
        homes = [w.home_segment(segs, f) for f in facts]
        assert homes == sorted(homes)  # facts keep their order through the base
        assert "".join(segs).replace("\n\n", "") == "".join(paras).replace("\n\n", "")  # nothing lost or repeated


def test_exact_and_lenient_scores():
    assert w.score("4817", "4817") == {"exact": True, "lenient": True}
    assert w.score("The code is 4817.", "4817") == {"exact": False, "lenient": True}
    assert w.score("4817. It is on the door.", "4817") == {"exact": True, "lenient": True}
    assert w.score("48170", "4817") == {"exact": False, "lenient": False}
    assert w.score("Ilsa  Moltrup!", "Ilsa Moltrup") == {"exact": True, "lenient": True}
    assert w.score("Ilsa", "Ilsa Moltrup") == {"exact": False, "lenient": False}


def test_quoting_the_planted_fact_is_exact_and_nothing_else_is():
    fact = "The access code of the Marberg seed vault is 6236."
    assert w.score("The access code of the Marberg seed vault is 6236.\nMore.", "6236", fact)["exact"]
    assert w.score("the access code of the marberg seed vault is 6236", "6236", fact)["exact"]
    for wrong in ("The access code of the Marberg seed vault is 6160.",  # the fact's form, another value
                  "The access code of the Varnvik orchard is 6236.",  # the value, another fact
                  "The code is 6236.", "The access code of the Marberg seed vault is 6236 or 6160."):
        assert w.score(wrong, "6236", fact)["exact"] is False
    assert w.score("The access code of the Marberg seed vault is 6236.", "6236")["exact"] is False  # no fact given


def test_reports_rescore_rows_and_shards_split_requests():
    import bench_rag

    facts = w.load_facts()[:2]
    rows = [{"kind": "request", "fact": facts[0].id, "answer": facts[0].fact, "exact": False, "lenient": True},
            {"kind": "request", "fact": facts[1].id, "answer": "no idea", "exact": True, "lenient": True},
            {"kind": "deposit", "seg": 0}]
    got = bench_rag.rescore(rows, facts)
    assert [r.get("exact") for r in got] == [True, False, None] and got[1]["lenient"] is False
    assert rows[0]["exact"] is False  # the rows themselves are left as written
    assert bench_rag.parse_shard("1/3") == (1, 3)
    for bad in ("3/3", "x", "1/0", "-1/2"):
        with pytest.raises(Exception, match="shard"):
            bench_rag.parse_shard(bad)


def test_a_segment_deposited_again_counts_once_and_calibration_is_apart():
    """A run resumed on a machine without its store deposits a segment again: the injection is its last deposit."""
    import bench_rag

    tag = {"model": "m", "shape": "4k"}
    rows = [{"kind": "setup", **tag, "knowledge_tokens": 4096, "history_tokens": 1024, "kb_tokens": 8000, "segments": 2,
             "requests": 0},
            {"kind": "calibration", "model": "m", "wall_s": 400.0, "cpu_s": 390.0},
            {"kind": "deposit", **tag, "seg": 0, "wall_s": 10.0, "cpu_s": 9.0, "bytes": 100},
            {"kind": "deposit", **tag, "seg": 1, "wall_s": 20.0, "cpu_s": 19.0, "bytes": 200},
            {"kind": "deposit", **tag, "seg": 0, "wall_s": 12.0, "cpu_s": 11.0, "bytes": 100}]
    [s] = bench_rag.summarise(rows)
    assert s["complete"]  # both segments, though three rows
    kv = bench_rag.injection(rows, "m", "4k")
    assert (kv["wall_s"], kv["cpu_s"], kv["bytes"], kv["segments_deposited"]) == (32.0, 30.0, 300, 2)
    assert kv["calibration"] == {"wall_s": 400.0, "cpu_s": 390.0}  # shown beside the injection, not inside it


def test_bm25_finds_each_facts_segment():
    pytest.importorskip("bm25s")
    from kvcodec.texts import load_text

    facts = w.load_facts()[:40]
    segs = w.segments(w.plant([load_text("apache2"), load_text("mpl2"), load_text("gpl3")], facts), words, 1500)
    r = w.Retriever(segs)
    assert [r.top(f.question) for f in facts] == [w.home_segment(segs, f) for f in facts]


@pytest.mark.model
def test_kv_request_with_a_missing_corrupt_or_foreign_entry_is_answered_by_prefill(lm, other_lm, tmp_path):
    """Each damaged case answers exactly as in-context learning does, counted as a fallback; a good entry is used."""
    import bench_rag

    from kvcodec.format import encode_kvc_bytes
    from kvcodec.models.capture import capture
    from kvcodec.plan.presets import get_plan
    from kvcodec.runtime.knowledge import KnowledgeBase

    seg = "\n\n".join(w.plant([open("/usr/share/common-licenses/Apache-2.0").read()[:1500]], w.load_facts()[:1]))
    question = w.prompt("apt (2.6.1) unstable; urgency=medium", w.load_facts()[0].question)
    icl = bench_rag.ask_icl(lm, seg, question, 6)

    def kb(name: str) -> KnowledgeBase:
        return KnowledgeBase(lm, str(tmp_path / name), preset="lossless")

    missing = bench_rag.ask_kv(kb("empty"), seg, question, 6)
    assert missing["fallback"] and missing["answer"] == icl["answer"] and not missing["unreadable"]

    good = kb("good")
    ids, _ = good.context_ids([seg])
    good.deposit(capture(lm, token_ids=ids))
    hit = bench_rag.ask_kv(good, seg, question, 6)
    assert not hit["fallback"] and hit["source"] == "store" and hit["cached_tokens"] == len(ids)
    assert hit["answer"] == icl["answer"]

    data = bytearray(good.store.get(good.key(ids)))
    mid = len(data) // 2
    data[mid:mid + 64] = bytes(b ^ 0x5A for b in data[mid:mid + 64])
    corrupt = kb("corrupt")
    corrupt.store.put(corrupt.key(ids), bytes(data), {"note": "damaged by test"})
    got = bench_rag.ask_kv(corrupt, seg, question, 6)
    assert got["fallback"] and got["unreadable"] and got["answer"] == icl["answer"]

    other = capture(other_lm, token_ids=ids)  # same tokens, same KV shapes, another model's weights
    foreign = kb("foreign")
    foreign.store.put(foreign.key(ids), encode_kvc_bytes(other, get_plan("lossless", other)), {"note": "another model"})
    got = bench_rag.ask_kv(foreign, seg, question, 6)
    assert got["fallback"] and got["unreadable"] and got["answer"] == icl["answer"]


def test_forward_flops_counts_weights_and_keys():
    from types import SimpleNamespace

    import bench_rag

    c = SimpleNamespace(hidden_size=8, num_attention_heads=2, num_key_value_heads=1, head_dim=4, intermediate_size=16)
    cfg = SimpleNamespace(get_text_config=lambda decoder: c)
    per_token = 2 * (2 * 8 * 2 * 4 + 2 * 8 * 1 * 4 + 3 * 8 * 16)  # q+o, k+v, gated MLP; one layer
    assert bench_rag.forward_flops(cfg, [None], 0, 3) == 3 * per_token + 4 * 2 * 4 * (1 + 2 + 3)
    assert bench_rag.forward_flops(cfg, [None], 10, 2) == 2 * per_token + 4 * 2 * 4 * (11 + 12)
    assert bench_rag.forward_flops(cfg, [3], 10, 2) == 2 * per_token + 4 * 2 * 4 * (3 + 3)  # a window of 3 keys
