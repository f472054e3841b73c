"""Is it the codec? Re-asks, from entries of another preset, the KV-cache requests of a bench_rag run whose answer
differed from in-context learning's (issue 34).

A diagnostic, not an injection measurement: only the differing requests' segments are deposited (into a memory
store), each request is asked again exactly as bench_rag asked it (same segment, history slice and question),
and its answer is printed beside the run's ICL and KV-cache answers.

    python benchmarks/checks/rag_codec_check.py --out RUN_DIR --preset near-lossless [--model gemma3-270m --shape 4k]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import sys

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the benchmarks folder: bench_rag, rag_workload

import bench_rag as b  # noqa: E402
import rag_workload as w  # noqa: E402

from kvcodec.models.capture import tokenize
from kvcodec.models.load import load_model
from kvcodec.runtime.knowledge import KnowledgeBase
from kvcodec.store import Store
from kvcodec.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="A bench_rag run directory (its results.jsonl).")
    ap.add_argument("--preset", default="near-lossless")
    ap.add_argument("--model", default=None)
    ap.add_argument("--shape", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--facts", nargs="+", default=None, help="Only these fact ids, in this order.")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = b.Results(Path(a.out) / "results.jsonl").rows
    req = [r for r in rows if r["kind"] == "request" and (a.model in (None, r["model"])) and (a.shape in (None, r["shape"]))]
    by = {(r["model"], r["shape"], r["fact"]): {} for r in req}
    for r in req:
        by[(r["model"], r["shape"], r["fact"])][r["method"]] = r
    differ = [(k, v) for k, v in by.items() if "in-context learning" in v and "KV-cache learning" in v
              and v["in-context learning"]["answer"] != v["KV-cache learning"]["answer"]]
    if a.facts:
        differ = [d for f in a.facts for d in differ if d[0][2] == f]
    else:
        differ.sort()
    facts = {f.id: f for f in w.load_facts()}
    paras = w.plant([load_text(t) for t in w.KB_TEXTS], list(facts.values()))
    models: dict[str, object] = {}
    for (model, shape, fact_id), v in differ:
        lm = models.setdefault(model, load_model(model))
        setup = [r for r in rows if r["kind"] == "setup" and r["model"] == model and r["shape"] == shape][-1]
        segs = w.segments(paras, lambda s: len(tokenize(lm.tokenizer, s)), setup["knowledge_tokens"])  # noqa: B023
        hist = tokenize(lm.tokenizer, load_text(w.HISTORY_TEXT))
        icl = v["in-context learning"]
        question = w.prompt(b.history_for(hist, icl["n"], setup["history_tokens"], lm), facts[fact_id].question)
        seg = segs[w.Retriever(segs).top(facts[fact_id].question)]
        kb = KnowledgeBase(lm, Store.open("mem://"), preset=a.preset)
        kb.deposit(kb.capture(kb.context_ids([seg])[0]))
        got = b.ask_kv(kb, seg, question, setup.get("max_new_tokens", 32))
        print(json.dumps({"model": model, "shape": shape, "fact": fact_id, "key": facts[fact_id].answer,
                          "icl": icl["answer"][:60], "kv balanced": v["KV-cache learning"]["answer"][:60],
                          f"kv {a.preset}": got["answer"][:60], "source": got["source"],
                          f"{a.preset} == icl": got["answer"] == icl["answer"],
                          **{f"{a.preset} {k}": x for k, x in w.score(got["answer"], facts[fact_id].answer).items()}}),
              flush=True)


if __name__ == "__main__":
    main()
