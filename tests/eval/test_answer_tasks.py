"""benchmarks/answer_tasks.py: the answer benchmark's contexts say what they claim (issue 53).

The generator is checked with a whitespace tokenizer and the machine's real texts: what a question asks is in
its context exactly once, distractors never collide with answers, variable chains are defined before use, the
held-out split is fixed by id, and the scoring is RULER's string match."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from answer_tasks import FAMILIES, make_context, make_contexts, score, split_of, wilson  # noqa: E402

from kvcodec.texts import HELD_OUT, load_text  # noqa: E402

TEXTS = [t for t in HELD_OUT if t != "changelog-apt"]


def words(s: str) -> int:
    return len(s.split())


@pytest.mark.parametrize("family", FAMILIES)
def test_contexts_are_deterministic_and_hold_each_answer(family):
    a = make_context(family, 0, 800, words, load_text, TEXTS)
    assert a == make_context(family, 0, 800, words, load_text, TEXTS)  # same seed, same context
    assert a.text != make_context(family, 1, 800, words, load_text, TEXTS).text
    assert 0.5 * 800 <= words(a.text) <= 1.3 * 800
    assert a.questions and len({q.id for q in a.questions}) == len(a.questions)
    every = [x for q in a.questions for x in q.answers]
    if family != "cwe":
        assert len(set(every)) == len(every)  # no answer is another question's answer
    for q in a.questions:
        for ans in q.answers:
            if family == "cwe":  # the common words: each strictly more frequent than any other word of the list
                items = re.findall(r"^\d+\. (\w+)$", a.text, flags=re.M)
                counts = {w: items.count(w) for w in set(items)}
                assert counts[ans] > max(c for w, c in counts.items() if w not in q.answers)
            else:
                assert len(re.findall(rf"\b{re.escape(ans)}\b", a.text)) >= 1
                assert ans not in a.haystack  # invented: written nowhere but in the planted facts
        assert score(" , ".join(q.answers), q.answers)["exact"]


def test_needles_state_each_fact_once_and_distractors_differ():
    c = make_context("multikey", 3, 1500, words, load_text, TEXTS)
    stated = re.findall(r"The special magic number for ([\w-]+) is (\d+)\.", c.text)
    assert len(stated) == 6 and len({k for k, _ in stated}) == 6  # three asked, three distractors
    for q in c.questions:
        key = re.search(r"for ([\w-]+)\?", q.question).group(1)
        assert [v for k, v in stated if k == key] == list(q.answers)


def test_variable_chains_are_defined_before_use():
    c = make_context("vartrack", 2, 1500, words, load_text, TEXTS)
    defined: dict[str, str] = {}
    for name, rhs in re.findall(r"VAR (\w+) = (VAR \w+|\d+)\.", c.text):
        if rhs.startswith("VAR "):
            assert rhs[4:] in defined, f"{name} reads {rhs} before it is set"
            defined[name] = defined[rhs[4:]]
        else:
            defined[name] = rhs
    for q in c.questions:
        value = re.search(r"value (\d+)", q.question).group(1)
        assert sorted(n for n, v in defined.items() if v == value) == sorted(q.answers)


def test_split_is_by_id_and_about_two_in_five():
    ids = [f"needle-4096-{i}/q{j}" for i in range(500) for j in range(4)]
    held = sum(split_of(i) == "held-out" for i in ids)
    assert 0.35 < held / len(ids) < 0.45
    assert all(split_of(i) == split_of(i) for i in ids[:50])
    cs = make_contexts(["needle"], 3, 600, words, load_text, TEXTS)
    assert all(q.split == split_of(q.id) for c in cs for q in c.questions)


def test_score_is_string_match_of_every_reference():
    assert score("The access code is 4817.", ["4817"]) == {"exact": True, "share": 1.0}
    assert score("48170", ["4817"])["exact"] is False  # whole words only
    assert score("Ilsa  drevanek!", ["Ilsa Drevanek"])["exact"]
    s = score("1234567, 7654321", ["1234567", "7654321", "1111111"])
    assert s["exact"] is False and s["share"] == pytest.approx(2 / 3)


def test_wilson_interval():
    lo, hi = wilson(17, 18)
    assert 0.74 < lo < 0.75 and 0.99 < hi <= 1.0
    assert wilson(0, 10)[0] == 0.0 and wilson(10, 10)[1] == 1.0 and wilson(0, 0) == (0.0, 1.0)


def test_parts_of_a_split_run_pool_into_one_table():
    """bench_answers --merge: the rows of parts split by --start pool per (model, length, method), the summaries are
    recomputed over all of them (not averaged), bits are weighted by contexts, and a question in two parts is refused."""
    import bench_answers

    def doc(rows, bits, contexts):
        v = {"bits_per_element": bits, "rows": rows}
        return {"results": {"models": [{"model": "m", "lengths": {"4096": {"contexts": contexts, "methods": {"p": v}}}}]}}

    def row(i, exact, same, split="held-in"):
        return {"id": f"q{i}", "family": "needle", "split": split, "exact": exact, "identical": same, "identical16": same}

    a = doc([row(0, True, True), row(1, False, True, "held-out")], 4.0, 1)
    b = doc([row(2, True, False), row(3, True, True), row(4, False, False, "held-out")], 5.0, 3)
    t = bench_answers.pooled([a, b])[("m", "4096", "p")]
    assert t["questions"] == 5 and t["all"]["accuracy"]["k"] == 3 and t["all"]["identical"]["k"] == 3
    assert t["held_out"]["accuracy"]["n"] == 2 and t["bits_per_element"] == pytest.approx((4.0 + 3 * 5.0) / 4)
    with pytest.raises(SystemExit, match="two parts"):
        bench_answers.pooled([a, a])


def test_bits_per_stored_element_on_a_ragged_cache():
    """bench_answers reports every method's bits two ways: over the K+V elements of every layer at every context token
    (kvcodec.accounting's charge) and over the elements the cache holds. A sliding-window layer keeps only its window
    (Gemma 3: 15 of 18 layers keep 511 tokens), so on a ragged cache the first is the smaller; they agree otherwise."""
    import bench_answers
    from formatutil import ragged_cache, synthetic_cache

    r = ragged_cache()  # 12 context tokens, 2 layers x 2 heads x head_dim 8; layer 0 keeps its last 5 tokens
    per_ctx, per_stored = bench_answers.entry_bits(1088.0, r)
    assert r.num_elements == 2 * 2 * 8 * (5 + 12)
    assert per_ctx == pytest.approx(1088.0 / (2 * 2 * 16 * 12)) and per_stored == pytest.approx(1088.0 / r.num_elements)
    assert per_stored > per_ctx
    a, b = bench_answers.entry_bits(1088.0, synthetic_cache(T=12))
    assert a == pytest.approx(b)


def test_pooled_bits_per_stored_element():
    """--merge pools bits per stored element weighted by contexts like bits per element, the in-context row from the
    lossless entry's; a part written before it was recorded leaves it None rather than mixing two rates."""
    import bench_answers

    def doc(bits, stored, contexts, i, lossless=None):
        v = {"bits_per_element": bits, "rows": [{"id": f"q{i}", "family": "needle", "split": "held-in", "exact": True,
                                                 "identical": True, "identical16": True}]}
        if stored is not None:
            v["bits_per_stored_element"] = stored
        if lossless is not None:
            v.update(bits_per_element=None, bits_per_stored_element=None, lossless_entry_bits_per_element=lossless[0],
                     lossless_entry_bits_per_stored_element=lossless[1])
        return {"results": {"models": [{"model": "m", "lengths": {"4096": {"contexts": contexts, "methods": {"p": v}}}}]}}

    t = bench_answers.pooled([doc(1.0, 4.0, 1, 0), doc(2.0, 6.0, 3, 1)])[("m", "4096", "p")]
    assert t["bits_per_element"] == pytest.approx(7.0 / 4) and t["bits_per_stored_element"] == pytest.approx(22.0 / 4)
    old = bench_answers.pooled([doc(1.0, 4.0, 1, 0), doc(2.0, None, 3, 1)])[("m", "4096", "p")]
    assert old["bits_per_stored_element"] is None
    t = bench_answers.pooled([doc(0, 0, 1, 0, lossless=(7.4, 27.0))])[("m", "4096", "p")]
    assert t["bits_per_element"] == pytest.approx(7.4) and t["bits_per_stored_element"] == pytest.approx(27.0)
