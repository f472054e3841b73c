"""Knowledge injection cost (issue 33): what it costs the KDN to take in a document (capture + encode + store)
against what it costs to read the same document once (prefill alone), at 1K, 4K and 16K tokens per document.

The KDN's case against re-reading text is that a document is injected once and reused by every later
query; against fine-tuning, that injection costs about one prefill. So per model and document length,
on the same documents, interleaved per document in one process:

* **prefill alone**: the model's forward over the document with its KV cache kept, exactly what a
  serving engine runs for a prompt (:func:`kvcodec.models.capture.prefill`, logits of the last position);
* **inject**: the KDN's deposit of the document: capture (the same prefill, the KV copied out, and the
  token importance the encoder reads observed on the way: ``capture(score_window=)``), then
  ``balanced``'s encode with rate control (no model forward), the writer's read-back, and the put
  into a sealed directory store (:class:`kvcodec.runtime.knowledge.KnowledgeBase.deposit`).

Reported per (model, length): CPU-seconds (process time, all threads) and wall seconds of each part,
the ratio inject / prefill for both, the bytes stored and bits per element. Documents are consecutive
windows of the held-out texts (``kvcodec.texts.HELD_OUT``) concatenated, so a 16K document is real
text; a length past the model's context window is skipped and says so (SmolLM2: 8,192 tokens).

``--threads`` (default 1) sizes torch, BLAS and numba alike, before they load. Each model's first
document is preceded by an untimed warm-up of both paths (imports, numba's cached kernels).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import harness  # noqa: E402

harness.pin_threads(sys.argv[1:])  # before numpy and torch load: their pools size themselves at import

import numpy as np  # noqa: E402


def corpus_ids(lm, names: list[str]) -> np.ndarray:
    """The token ids of the named texts, concatenated (a blank line between texts)."""
    from kvcodec.models.capture import tokenize
    from kvcodec.texts import load_text

    return tokenize(lm.tokenizer, "\n\n".join(load_text(n) for n in names))


def _one(lm, kb, ids: np.ndarray, preset: str) -> dict:
    """Prefill alone, then inject, of one document; CPU and wall seconds of each part."""
    from kvcodec.models.capture import capture, prefill
    from kvcodec.plan.presets import score_window

    with harness.stopwatch() as pf:
        prefill(lm, ids)
    with harness.stopwatch() as cap:
        cache = capture(lm, token_ids=ids, score_window=score_window(preset))
    with harness.stopwatch() as dep:
        rec = kb.deposit(cache)
    if rec["failed"]:
        raise SystemExit(f"the store refused the deposit: {rec['failed']}")
    inject_cpu, inject_wall = cap.cpu + dep.cpu, cap.wall + dep.wall
    return {"prefill_cpu_s": pf.cpu, "prefill_wall_s": pf.wall, "capture_cpu_s": cap.cpu, "capture_wall_s": cap.wall,
            "encode_store_cpu_s": dep.cpu, "encode_store_wall_s": dep.wall, "inject_cpu_s": inject_cpu,
            "inject_wall_s": inject_wall, "inject_over_prefill_cpu": inject_cpu / pf.cpu,
            "inject_over_prefill_wall": inject_wall / pf.wall, "encode_store_over_prefill_cpu": dep.cpu / pf.cpu,
            "bytes": rec["bytes"], "bits_per_element": rec["bits_per_element"]}


def main(argv=None) -> None:
    from kvcodec.texts import HELD_OUT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--texts", default=",".join(HELD_OUT), help="texts whose concatenation the documents are cut from")
    ap.add_argument("--tokens", default="1024,4096,16384", help="document lengths")
    ap.add_argument("--docs", default="4,2,1", help="documents per length (one number, or one per length)")
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--threads", type=int, default=1)
    run = harness.cli(ap, argv, case="inject")
    a = run.args
    import torch

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.models.capture import max_context
    from kvcodec.models.load import load_model
    from kvcodec.api import resolve_rate_model
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.store import Store, TenantKey

    torch.set_num_threads(a.threads)
    lengths = [int(x) for x in a.tokens.split(",") if x]
    docs = [int(x) for x in a.docs.split(",") if x]
    docs = docs * len(lengths) if len(docs) == 1 else docs
    if len(docs) != len(lengths):
        raise SystemExit("--docs: give one number, or one per --tokens length")
    rows, skipped, summary = [], [], {}
    for model in [m for m in a.models.split(",") if m]:
        lm = load_model(model)
        cal = ensure_calibration(lm)  # per model, shared by every file: not a document's cost
        resolve_rate_model(lm, cal)
        ids = corpus_ids(lm, [t for t in a.texts.split(",") if t])
        window = max_context(lm)
        with tempfile.TemporaryDirectory(prefix="bench-inject-") as root:
            kb = KnowledgeBase(lm, Store.open(root, key=TenantKey(os.urandom(32))), preset=a.preset)
            _one(lm, kb, ids[:256], a.preset)  # untimed warm-up of both paths
            for T, n in zip(lengths, docs):
                if window and T > window:
                    skipped.append({"model": model, "tokens": T, "why": f"past the model's context window of {window}"})
                    continue
                if n * T > len(ids):
                    skipped.append({"model": model, "tokens": T, "why": f"{n} x {T} tokens > the corpus's {len(ids)}"})
                    continue
                for d in range(n):
                    r = _one(lm, kb, ids[d * T:(d + 1) * T], a.preset)
                    r.update(model=model, tokens=T, doc=d)
                    rows.append(r)
                    print(f"{model} {T} doc {d}: prefill {r['prefill_cpu_s']:.1f} CPU-s, inject {r['inject_cpu_s']:.1f} "
                          f"(capture {r['capture_cpu_s']:.1f} + encode/store {r['encode_store_cpu_s']:.1f}) = "
                          f"{r['inject_over_prefill_cpu']:.2f}x; {r['bits_per_element']:.2f} b/el",
                          file=sys.stderr, flush=True)
                rs = [r for r in rows if r["model"] == model and r["tokens"] == T]
                tot = {k: float(sum(r[k] for r in rs)) for k in ("prefill_cpu_s", "prefill_wall_s", "capture_cpu_s",
                                                                 "encode_store_cpu_s", "inject_cpu_s", "inject_wall_s")}
                summary[f"{model}/{T}"] = {
                    "documents": len(rs), **tot, "bytes": int(sum(r["bytes"] for r in rs)),
                    "inject_over_prefill_cpu": tot["inject_cpu_s"] / tot["prefill_cpu_s"],
                    "inject_over_prefill_wall": tot["inject_wall_s"] / tot["prefill_wall_s"],
                    "encode_store_over_prefill_cpu": tot["encode_store_cpu_s"] / tot["prefill_cpu_s"],
                    "bits_per_element": float(np.mean([r["bits_per_element"] for r in rs]))}
    for k, s in summary.items():
        print(f"{k}: {s['documents']} docs, inject / prefill {s['inject_over_prefill_cpu']:.2f}x CPU, "
              f"{s['inject_over_prefill_wall']:.2f}x wall; encode+store alone {s['encode_store_over_prefill_cpu']:.2f}x",
              file=sys.stderr)
    run.emit({"rows": rows, "skipped": skipped, "summary": summary, "threads": a.threads, "finished": time.time()})


if __name__ == "__main__":
    main()
