"""Answers from the store against answers in context (issue 53): accuracy, identical answers and bits, per preset.

The path is the one users get: each context is captured once (the prefill observes the token importance, as
``kvc ask`` does), deposited with each preset through ``KnowledgeBase.deposit``, and every question is answered
through ``KnowledgeBase.ask`` from the store (``source == "store"`` is checked). The in-context answers come from a
``lossless`` entry, whose K/V are the prefill's bit for bit; on the first context of each model the benchmark
also answers by a plain prefill (a ``KnowledgeBase`` miss) and reports whether the two agree
(``lossless_is_in_context``), so that shortcut is checked, not assumed.

Methods: kvcodec presets by name, or a preset at a fixed step (``faithful:step0=0.2``: a step sweep, deposited with
``KnowledgeBase(overrides=...)``); and the real peers (``--peers``), whose K/V are round-tripped by the peer's own code
(HF QuantizedCache's quanto / HQQ layers, ``kvcodec.eval.peers``) or cast to fp8 e4m3 (what LMCache's ``fp8`` serde
stores), then answered by the same greedy decode ``KnowledgeBase.ask`` uses (``greedy_from``), checked on the exact
cache against the in-context answers (``direct_is_in_context``). Peers store nothing in a store, so their bits are
what the library holds (codes + 16-bit scales and zero points; fp8: 8 bits).

Scores (benchmarks/answer_tasks.py): exact accuracy (every reference in the output) and the share of answers
token-for-token identical to in-context, each with its 95 % Wilson interval, per (model, context length,
preset), over all questions and over the held-out questions alone. Bits, two ways, for every method: per context
element (``bits_per_element``: bytes x 8 over the K+V elements of every layer at every context token, what
``kvcodec.accounting`` charges a file) and per stored element (``bits_per_stored_element``: over the K+V elements
the cache holds). They agree on SmolLM2; on a sliding-window model (Gemma 3: 15 of 18 layers keep their last 511
tokens, the ragged layout) a 4K context stores about 27 % of its context elements, so the first reads about 3.7x
lower. Calibration is the shipped one where the model has it (amortised, not charged per entry).

    python benchmarks/bench_answers.py --models smollm2,gemma3-270m --tokens 4096,8192 --per-family 10
    python benchmarks/bench_answers.py --merge part-a.json part-b.json   # pool the parts of a run split by --start
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness
from answer_tasks import FAMILIES, make_context, score, wilson


def _rate(k: int, n: int) -> dict[str, Any]:
    lo, hi = wilson(k, n)
    return {"k": k, "n": n, "rate": k / n if n else None, "ci95": [round(lo, 4), round(hi, 4)]}


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    exact = sum(r["exact"] for r in rows)
    same = sum(r["identical"] for r in rows)
    same16 = sum(r.get("identical16", r["identical"]) for r in rows)
    # identical: the whole greedy answer (up to --max-new-tokens); identical16: its first 16 tokens (an answer's
    # value comes first; what follows it is often the model's own continuation, where near-ties flip)
    return {"accuracy": _rate(exact, len(rows)), "identical": _rate(same, len(rows)), "identical16": _rate(same16, len(rows))}


def parse_method(m: str) -> tuple[str, dict[str, Any]]:
    """``preset`` or ``preset:key=value,key=value`` (values as JSON numbers) -> (preset, overrides)."""
    import json

    preset, _, rest = m.partition(":")
    over = {}
    for kv in filter(None, rest.split(";")):
        k, _, v = kv.partition("=")
        over[k] = json.loads(v)
    return preset, over


PEER_BLOCK = 128  # HF QuantizedCache's residual_length: the tokens it quantizes come in whole blocks of this many


def entry_bits(nbits: float, cache: Any) -> tuple[float, float]:
    """(bits per context element, bits per stored element) of ``nbits`` stored for ``cache``: over the K+V elements
    of every layer at every context token (``kvcodec.accounting.context_elements``), and over the elements the cache
    holds (a sliding-window layer keeps only its window; the two agree on a cache without one)."""
    from kvcodec.accounting import context_elements

    return nbits / context_elements(cache), nbits / cache.num_elements


def peer_roundtrip(cache: Any, peer: str) -> tuple[Any, int]:
    """(the cache a peer attends to, the bits it stores) for ``peer``: an HF QuantizedCache setting or ``fp8``."""
    import torch

    from kvcodec.core.kvcache import KVCache
    from kvcodec.eval.peers import HFQuantSpec, hf_quantized_roundtrip

    if peer == "fp8":
        cast = [[t.to(torch.float8_e4m3fn).to(t.dtype) for t in ts] for ts in (cache.keys, cache.values)]
        return (KVCache(cast[0], cast[1], cache.token_ids, cache.fingerprint, cache.positions, dict(cache.meta)),
                8 * cache.num_elements)
    # HF's QuantizedCache quantizes whole blocks and keeps the most recent tokens (up to its residual_length, 128) in
    # full precision: the same here, the residual charged at 16 bits per element (in the peer's favour)
    n = cache.num_tokens - cache.num_tokens % PEER_BLOCK
    head = KVCache([k[:, :n] for k in cache.keys], [v[:, :n] for v in cache.values], cache.token_ids[:n],
                   cache.fingerprint, None, dict(cache.meta))
    dec, bits = hf_quantized_roundtrip(head, HFQuantSpec.parse(peer))
    keys = [torch.cat([d, k[:, n:]], 1) for d, k in zip(dec.keys, cache.keys)]
    values = [torch.cat([d, v[:, n:]], 1) for d, v in zip(dec.values, cache.values)]
    rest = sum(k[:, n:].numel() + v[:, n:].numel() for k, v in zip(cache.keys, cache.values))
    return KVCache(keys, values, cache.token_ids, cache.fingerprint, cache.positions, dict(cache.meta)), bits + 16 * rest


def run_model(name: str, lengths: list[int], families: list[str], per_family: int, presets: list[str],
              texts: list[str], max_new: int, seed: int, say: Any, peers: tuple[str, ...] = (), start: int = 0) -> dict[str, Any]:
    import torch

    from kvcodec.integrations.hf import greedy_from
    from kvcodec.models.cachelayout import cache_for_model
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import capture_window
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.texts import load_text

    lm = load_model(name)

    def count(s: str) -> int:
        return len(tokenize(lm.tokenizer, s))

    out: dict[str, Any] = {"model": name, "lengths": {}}
    checked_prefill = False
    with tempfile.TemporaryDirectory(prefix="kvc-answers-") as tmp:
        kbs = {m: KnowledgeBase(lm, store=str(Path(tmp) / str(i)), preset=parse_method(m)[0], overrides=parse_method(m)[1])
               for i, m in enumerate(["lossless", *presets])}
        for T in lengths:
            contexts = [make_context(f, i, T, count, load_text, texts, seed)
                        for f in families for i in range(start, start + per_family)]
            methods = [*kbs, *peers]
            rows: dict[str, list[dict[str, Any]]] = {p: [] for p in methods}
            bits: dict[str, list[tuple[float, float]]] = {p: [] for p in methods}  # (per context, per stored element)
            tokens: list[int] = []
            t0 = time.time()
            for ci, ctx in enumerate(contexts):
                docs = [ctx.text]
                ids, _ = kbs["lossless"].context_ids(docs)
                with torch.inference_mode():  # once per context, observing what any preset reads
                    cache = capture(lm, token_ids=ids, score_window=capture_window())
                tokens.append(len(ids))
                for p, kb in kbs.items():
                    bits[p].append(entry_bits(8 * kb.deposit(cache)["bytes"], cache))
                answers: dict[str, list[Any]] = {p: [] for p in methods}
                peer_caches = {}
                for p in peers:
                    dec, nbits = peer_roundtrip(cache, p)
                    peer_caches[p] = dec
                    bits[p].append(entry_bits(nbits, cache))
                for q in ctx.questions:
                    for p, kb in kbs.items():
                        a = kb.ask(docs, q.question, max_new_tokens=max_new, store_new=False)
                        if a.source != "store":
                            raise SystemExit(f"{name} {ctx.id} {p}: answered from {a.source}, not the store")
                        answers[p].append(a)
                    qids = kbs["lossless"].question_ids(q.question)
                    with torch.inference_mode():
                        for p in peers:
                            toks, _ = greedy_from(lm, cache_for_model(lm, peer_caches[p]), len(ids), qids, max_new)
                            answers[p].append(_Direct(lm.tokenizer.decode(toks, skip_special_tokens=True).strip(), toks))
                    if not checked_prefill:
                        miss = KnowledgeBase(lm, store=str(Path(tmp) / "prefill"), preset="lossless")
                        a = miss.ask(docs, q.question, max_new_tokens=max_new, store_new=False)
                        out["lossless_is_in_context"] = a.source == "prefill" and a.answer_ids == answers["lossless"][-1].answer_ids
                        if peers:  # the peers' path (greedy_from on a cache handed to the model) on the exact cache
                            with torch.inference_mode():
                                toks, _ = greedy_from(lm, cache_for_model(lm, cache), len(ids), qids, max_new)
                            out["direct_is_in_context"] = toks == answers["lossless"][-1].answer_ids
                        checked_prefill = True
                for qi, q in enumerate(ctx.questions):
                    ref = answers["lossless"][qi].answer_ids
                    for p in methods:
                        a = answers[p][qi]
                        s = score(a.answer, q.answers)
                        rows[p].append({"id": q.id, "family": q.family, "split": q.split, "exact": bool(s["exact"]),
                                        "share": s["share"], "identical": a.answer_ids == ref,
                                        "identical16": list(a.answer_ids[:16]) == list(ref[:16]), "answer": a.answer})
                say(f"{name} {T}: context {ci + 1}/{len(contexts)} ({ctx.family}, {len(ids)} tokens) "
                    + " ".join(f"{p} {sum(r['exact'] for r in rows[p])}/{len(rows[p])}"
                               f" ={sum(r['identical'] for r in rows[p])}" for p in methods)
                    + f" [{time.time() - t0:.0f} s]")
            res: dict[str, Any] = {"contexts": len(contexts), "questions": len(rows["lossless"]),
                                   "context_tokens": tokens, "methods": {}}
            for p in methods:
                method = "in-context" if p == "lossless" else (f"peer:{p}" if p in peers else p)
                held = [r for r in rows[p] if r["split"] == "held-out"]
                # in context stores nothing: its answers come from the lossless entry, whose bits are reported beside
                per_ctx = sum(b for b, _ in bits[p]) / len(bits[p])
                per_stored = sum(b for _, b in bits[p]) / len(bits[p])
                res["methods"][method] = {
                    "bits_per_element": None if p == "lossless" else per_ctx,
                    "bits_per_stored_element": None if p == "lossless" else per_stored,
                    **({"lossless_entry_bits_per_element": per_ctx, "lossless_entry_bits_per_stored_element": per_stored}
                       if p == "lossless" else {}),
                    "bits_per_context": [list(b) for b in bits[p]],  # each context's (per context, per stored element)
                    "all": _summary(rows[p]), "held_out": _summary(held),
                    "by_family": {f: _summary([r for r in rows[p] if r["family"] == f]) for f in families},
                    "rows": rows[p]}
            out["lengths"][str(T)] = res
    return out


@dataclass
class _Direct:
    """A peer's answer (the fields of ``Answer`` the scoring reads)."""

    answer: str
    answer_ids: list[int]


def pooled(docs: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Rows of several result documents (parts of one run split by ``--start``: disjoint questions) pooled per
    (model, context length, method), with their summaries recomputed over all of them. Bits are weighted by contexts;
    bits per stored element is None where a part lacks it (a document written before it was recorded)."""
    rows: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    bits: dict[tuple[str, str, str], list[tuple[float, int]]] = {}
    stored: dict[tuple[str, str, str], list[tuple[float | None, int]]] = {}
    for doc in docs:
        for r in doc["results"]["models"]:
            for T, res in r["lengths"].items():
                for m, v in res["methods"].items():
                    key = (r["model"], T, m)
                    rows.setdefault(key, []).extend(v["rows"])
                    b = v["bits_per_element"] if v["bits_per_element"] is not None else v.get("lossless_entry_bits_per_element")
                    bits.setdefault(key, []).append((b, res["contexts"]))
                    sb = v.get("bits_per_stored_element")  # absent from documents written before it was recorded
                    if sb is None:
                        sb = v.get("lossless_entry_bits_per_stored_element")
                    stored.setdefault(key, []).append((sb, res["contexts"]))
    out = {}
    for key, rs in rows.items():
        ids = [r["id"] for r in rs]
        if len(set(ids)) != len(ids):
            raise SystemExit(f"{key}: a question appears in two parts (overlapping --start ranges)")
        n = sum(c for _, c in bits[key])
        sbs = stored[key]
        out[key] = {"questions": len(rs), "bits_per_element": sum(b * c for b, c in bits[key]) / n,
                    "bits_per_stored_element": (None if any(b is None for b, _ in sbs)
                                                else sum(float(b or 0) * c for b, c in sbs) / n),
                    "all": _summary(rs), "held_out": _summary([r for r in rs if r["split"] == "held-out"]),
                    "by_family": {f: _summary([r for r in rs if r["family"] == f]) for f in sorted({r["family"] for r in rs})}}
    return out


def _line(name: str, bits: float | None, v: dict[str, Any], stored: float | None = None) -> str:
    def iv(x: dict[str, Any]) -> str:
        return f"{x['rate']:.3f} [{x['ci95'][0]:.3f}, {x['ci95'][1]:.3f}]" if x["rate"] is not None else "-"

    def num(x: float | None) -> str:
        return "     -" if x is None else f"{x:6.2f}"

    return (f"  {name:24s} {num(bits)} bits/el ({num(stored)} per stored el)  accuracy {iv(v['all']['accuracy'])}  "
            f"identical {iv(v['all']['identical'])}  "
            f"first 16 tokens {iv(v['all']['identical16'])}  held-out: accuracy {iv(v['held_out']['accuracy'])} "
            f"identical {iv(v['held_out']['identical'])} (n={v['held_out']['accuracy']['n']})")


def merge_main(paths: list[str]) -> None:
    """``--merge A.json B.json ...``: the pooled table of parts of one run (no model is loaded)."""
    import json

    table = pooled([json.loads(Path(p).read_text()) for p in paths])
    for (model, T, m), v in sorted(table.items()):
        print(f"{model} {T} ({v['questions']} questions) " + _line(m, None if m == "in-context" else v["bits_per_element"], v,
                                                                   None if m == "in-context" else v["bits_per_stored_element"]))
        for f, s in v["by_family"].items():
            print(f"      {f:10s} accuracy {s['accuracy']['k']}/{s['accuracy']['n']}  identical {s['identical']['k']}/{s['identical']['n']}"
                  f"  first 16 {s['identical16']['k']}/{s['identical16']['n']}")


def main(argv: list[str] | None = None) -> None:
    from kvcodec.texts import HELD_OUT

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--merge"]:
        return merge_main(argv[1:])

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--tokens", default="4096,8192", help="context lengths (tokens, approximate)")
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--per-family", type=int, default=10, help="contexts per family and length")
    ap.add_argument("--start", type=int, default=0, help="index of each family's first context (to split a run in parts "
                    "whose questions do not overlap)")
    ap.add_argument("--presets", default="faithful,near-lossless,balanced,small",
                    help="kvcodec methods compared with in-context: presets, or PRESET:step0=X for a step sweep")
    ap.add_argument("--peers", default="", help="real peers: HF QuantizedCache settings (quanto4-g32-kivi, hqq2-g64-hf) "
                    "and fp8 (LMCache's fp8 serde)")
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
                         a.max_new_tokens, a.seed, say, tuple(p for p in a.peers.split(",") if p), a.start)
               for m in a.models.split(",") if m]
    for r in results:
        for T, res in r["lengths"].items():
            print(f"{r['model']} {T} tokens: {res['questions']} questions in {res['contexts']} contexts "
                  f"(lossless = in-context checked: {r.get('lossless_is_in_context')}; "
                  f"peers' path = in-context: {r.get('direct_is_in_context')})")
            for m, v in res["methods"].items():
                print(_line(m, v["bits_per_element"], v, v["bits_per_stored_element"]))
    run.emit({"models": results})


if __name__ == "__main__":
    main()
