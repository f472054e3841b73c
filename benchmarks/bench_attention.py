"""transformers' SDPA vs kvcodec's schedule of it (kvcodec.models.sdpa_schedule): the same forward passes, timed.

Two passes per model and length, each run both ways in turn (``--repeat``
times, interleaved, so load drift hits both alike), one process:

* **prefill**: the context from position 0, as an in-context request or a
  capture runs it. On a sliding-window layer transformers hands SDPA the
  whole band as one mask, and the schedule runs it in blocks of query rows
  over only the keys each block may see.
* **over cache**: ``--new`` tokens over the context's cache, as a KV-cache
  request's history + question. The schedule splits each full-attention layer
  into the cached keys (no mask) and the new ones (causal); sliding layers
  again in blocks.

Reported per pass: CPU-seconds of each (min and median over the repeats), their
ratio, and how far the schedule's last-position logits are from transformers'
(max |difference| over the vocabulary, and whether the argmax is the same).
Real text (pydoc, gpl3, pydoc-exec, py-argparse, concatenated), one thread by default. A length past a model's
window is reported as skipped.

    python benchmarks/bench_attention.py --models gemma3-270m,smollm2 --tokens 2048,6144,8192 --new 2048 --repeat 3
"""

from __future__ import annotations

import sys

import harness

harness.pin_threads(sys.argv[1:])

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvcodec.models.capture import max_context, model_cache, tokenize  # noqa: E402
from kvcodec.models.load import LoadedModel, load_model  # noqa: E402
from kvcodec.models.sdpa_schedule import fast_sdpa  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402


@torch.inference_mode()
def forward(lm: LoadedModel, ids: np.ndarray, n_ctx: int, scheduled: bool) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """CPU-s of the prefill of ``ids[:n_ctx]`` and of the rest over its cache; the two last-position logits."""
    def ctx() -> Any:
        return fast_sdpa(lm) if scheduled else contextlib.nullcontext()

    with ctx(), harness.stopwatch() as sw1:
        out = lm.model(input_ids=torch.as_tensor(ids[:n_ctx])[None], past_key_values=model_cache(lm), use_cache=True,
                       logits_to_keep=1)
    pos = torch.arange(n_ctx, len(ids))[None]
    with ctx(), harness.stopwatch() as sw2:
        out2 = lm.model(input_ids=torch.as_tensor(ids[n_ctx:])[None], past_key_values=out.past_key_values,
                        position_ids=pos, use_cache=True, logits_to_keep=1)
    return float(sw1.cpu or 0.0), float(sw2.cpu or 0.0), out.logits[0, -1].float(), out2.logits[0, -1].float()


def summary(xs: list[float]) -> dict[str, float]:
    return {"min": round(min(xs), 3), "median": round(statistics.median(xs), 3)}


def measure(lm: LoadedModel, ids: np.ndarray, n_ctx: int, repeat: int) -> dict[str, Any]:
    times: dict[tuple[str, bool], list[float]] = {(p, s): [] for p in ("prefill", "over_cache") for s in (False, True)}
    logits: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    for r in range(repeat):
        for scheduled in ((False, True) if r % 2 == 0 else (True, False)):  # alternate which goes first
            t1, t2, l1, l2 = forward(lm, ids, n_ctx, scheduled)
            times[("prefill", scheduled)].append(t1)
            times[("over_cache", scheduled)].append(t2)
            logits[scheduled] = (l1, l2)
    row: dict[str, Any] = {"model": lm.name, "context": n_ctx, "new": len(ids) - n_ctx}
    for i, p in enumerate(("prefill", "over_cache")):
        ref, got = logits[False][i], logits[True][i]
        row[p] = {"transformers_cpu_s": summary(times[(p, False)]), "scheduled_cpu_s": summary(times[(p, True)]),
                  "speedup_median": round(statistics.median(times[(p, False)]) / statistics.median(times[(p, True)]), 2),
                  "max_abs_logit_diff": float((got - ref).abs().max()), "max_abs_logit": float(ref.abs().max()),
                  "same_argmax": bool(int(got.argmax()) == int(ref.argmax()))}
    return row


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="gemma3-270m,smollm2", help="comma-separated model names or local HF directories")
    ap.add_argument("--tokens", default="2048,8192", help="context lengths (comma-separated)")
    ap.add_argument("--new", type=int, default=2048, help="tokens fed over each context's cache")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each way, interleaved")
    ap.add_argument("--threads", default="1", help="torch/BLAS/numba threads (set before import)")
    run = harness.cli(ap, argv, case="attention")
    a = run.args
    text = "\n\n".join(load_text(t) for t in ("pydoc", "gpl3", "pydoc-exec", "py-argparse"))
    rows = []
    for name in a.models.split(","):
        lm = load_model(name)
        all_ids = tokenize(lm.tokenizer, text)
        forward(lm, all_ids[:64], 48, True)  # warm-up: kernels and the attention registration
        for n in (int(x) for x in a.tokens.split(",")):
            if n + a.new > len(all_ids):
                raise SystemExit(f"bench_attention: the texts hold {len(all_ids)} tokens, fewer than {n} + {a.new}")
            limit = max_context(lm)
            if limit is not None and n + a.new > limit:
                rows.append({"model": lm.name, "context": n, "new": a.new,
                             "skipped": f"{n + a.new} tokens exceed the model's window of {limit}"})
            else:
                rows.append(measure(lm, all_ids[: n + a.new], n, a.repeat))
            print(json.dumps(rows[-1]), flush=True)
    run.emit({"rows": rows})


if __name__ == "__main__":
    main()
