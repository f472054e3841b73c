"""Answers from the store against answers in context (issue 53): accuracy, identical answers and bits, per preset.

The path is the one users get: each context is captured once (the prefill observes the token importance, as
``kvc ask`` does), deposited with each preset through ``KnowledgeBase.deposit``, and every question is answered
through ``KnowledgeBase.ask`` from the store (``source == "store"`` is checked). The in-context answers come from a
``lossless`` entry, whose K/V are the prefill's bit for bit; on the first context of each model the benchmark
also answers by a plain prefill (a ``KnowledgeBase`` miss) and reports whether the two agree
(``lossless_is_in_context``), so that shortcut is checked, not assumed.

Scores (benchmarks/answer_tasks.py): exact accuracy (every reference in the output) and the share of answers
token-for-token identical to in-context, each with its 95 % Wilson interval, per (model, context length,
preset), over all questions and over the held-out questions alone; bits per stored element are the entries'
real bytes x 8 over the K+V elements of the context. Calibration is the shipped one where the model has it
(amortised, not charged per entry).

    python benchmarks/bench_answers.py --models smollm2,gemma3-270m --tokens 4096,8192 --per-family 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import harness
from answer_tasks import FAMILIES, make_contexts, score, wilson


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci95": [round(lo, 4), round(hi, 4)]}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    exact = sum(r["exact"] for r in rows)
    same = sum(r["identical"] for r in rows)
    return {"accuracy": _rate(exact, len(rows)), "identical": _rate(same, len(rows))}


def run_model(name: str, lengths: list[int], families: list[str], per_family: int, presets: list[str],
              texts: list[str], max_new: int, seed: int, say: Any) -> dict[str, Any]:
    import torch

    from kvcodec.models.capture import tokenize
    from kvcodec.models.load import load_model
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.texts import load_text

    lm = load_model(name)

    def count(s: str) -> int:
        return len(tokenize(lm.tokenizer, s))

    out: dict[str, Any] = {"model": name, "lengths": {}}
    checked_prefill = False
    with tempfile.TemporaryDirectory(prefix="kvc-answers-") as tmp:
        kbs = {p: KnowledgeBase(lm, store=str(Path(tmp) / p), preset=p) for p in ["lossless", *presets]}
        for T in lengths:
            contexts = make_contexts(families, per_family, T, count, load_text, texts, seed)
            rows: dict[str, list[dict[str, Any]]] = {p: [] for p in kbs}
            bits: dict[str, list[float]] = {p: [] for p in kbs}
            t0 = time.time()
            for ci, ctx in enumerate(contexts):
                docs = [ctx.text]
                ids, _ = kbs["lossless"].context_ids(docs)
                with torch.inference_mode():
                    cache = kbs[presets[0] if presets else "lossless"].capture(ids)
                for p, kb in kbs.items():
                    bits[p].append(kb.deposit(cache)["bits_per_element"])
                answers: dict[str, list[Any]] = {p: [] for p in kbs}
                for q in ctx.questions:
                    for p, kb in kbs.items():
                        a = kb.ask(docs, q.question, max_new_tokens=max_new, store_new=False)
                        if a.source != "store":
                            raise SystemExit(f"{name} {ctx.id} {p}: answered from {a.source}, not the store")
                        answers[p].append(a)
                    if not checked_prefill:
                        miss = KnowledgeBase(lm, store=str(Path(tmp) / "prefill"), preset="lossless")
                        a = miss.ask(docs, q.question, max_new_tokens=max_new, store_new=False)
                        out["lossless_is_in_context"] = a.source == "prefill" and a.answer_ids == answers["lossless"][-1].answer_ids
                        checked_prefill = True
                for qi, q in enumerate(ctx.questions):
                    ref = answers["lossless"][qi].answer_ids
                    for p in kbs:
                        a = answers[p][qi]
                        s = score(a.answer, q.answers)
                        rows[p].append({"id": q.id, "family": q.family, "split": q.split, "exact": bool(s["exact"]),
                                        "share": s["share"], "identical": a.answer_ids == ref, "answer": a.answer})
                say(f"{name} {T}: context {ci + 1}/{len(contexts)} ({ctx.family}, {len(ids)} tokens) "
                    + " ".join(f"{p} {sum(r['exact'] for r in rows[p])}/{len(rows[p])}" for p in kbs)
                    + f" [{time.time() - t0:.0f} s]")
            res: dict[str, Any] = {"contexts": len(contexts), "questions": len(rows["lossless"]), "methods": {}}
            for p in kbs:
                method = "in-context" if p == "lossless" else p
                held = [r for r in rows[p] if r["split"] == "held-out"]
                # in context stores nothing: its answers come from the lossless entry, whose bits are reported beside
                res["methods"][method] = {
                    "bits_per_element": None if p == "lossless" else sum(bits[p]) / len(bits[p]),
                    **({"lossless_entry_bits_per_element": sum(bits[p]) / len(bits[p])} if p == "lossless" else {}),
                    "all": _summary(rows[p]), "held_out": _summary(held),
                    "by_family": {f: _summary([r for r in rows[p] if r["family"] == f]) for f in families},
                    "rows": rows[p]}
            out["lengths"][str(T)] = res
    return out


def main(argv: list[str] | None = None) -> None:
    from kvcodec.texts import HELD_OUT

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--tokens", default="4096,8192", help="context lengths (tokens, approximate)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--per-family", type=int, default=10, help="contexts per family and length")
    ap.add_argument("--presets", default="near-lossless,balanced,small", help="lossy presets compared with in-context")
    ap.add_argument("--texts", default=",".join(t for t in HELD_OUT if t != "changelog-apt"),
                    help="haystack texts (held-out by default)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=53)
    run = harness.cli(ap, argv, case="answers")
    a = run.args
    families = [f for f in a.families.split(",") if f]
    if unknown := set(families) - set(FAMILIES):
        raise SystemExit(f"unknown families: {', '.join(sorted(unknown))}")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    results = [run_model(m, [int(t) for t in a.tokens.split(",")], families, a.per_family,
                         [p for p in a.presets.split(",") if p], [t for t in a.texts.split(",") if t],
                         a.max_new_tokens, a.seed, say) for m in a.models.split(",") if m]
    for r in results:
        for T, res in r["lengths"].items():
            print(f"{r['model']} {T} tokens: {res['questions']} questions in {res['contexts']} contexts "
                  f"(lossless = in-context checked: {r.get('lossless_is_in_context')})")
            for m, v in res["methods"].items():
                acc, same, ho = v["all"]["accuracy"], v["all"]["identical"], v["held_out"]["accuracy"]
                b = "     -" if v["bits_per_element"] is None else f"{v['bits_per_element']:6.2f}"
                print(f"  {m:14s} {b} bits/el  accuracy {acc['rate']:.3f} "
                      f"[{acc['ci95'][0]:.3f}, {acc['ci95'][1]:.3f}]  identical {same['rate']:.3f} "
                      f"[{same['ci95'][0]:.3f}, {same['ci95'][1]:.3f}]  held-out accuracy {ho['rate'] if ho['rate'] is not None else float('nan'):.3f} (n={ho['n']})")
    run.emit({"models": results})


if __name__ == "__main__":
    main()
