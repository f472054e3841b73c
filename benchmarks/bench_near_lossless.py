"""`near-lossless` on held-out texts: greedy-identical by construction, and what it costs (issue 15).

Per text: the guarded ``near-lossless`` plan (16-bit codes, ``quantize`` v2; the guard
bounds the probe's rival-token logit gain by NEAR_TIE, see kvcodec/plan/check.py) and,
side by side on the same cache, ``fp16`` (cast + shuffle + zstd, what engines keep) and
the previous ``near-lossless`` (8-bit codes, ``max_bits=8``, its fixed step0 0.02). Each is
a real .kvc file (bits/element = file bytes x 8 / K+V elements, calibration external),
decoded and continued on the 256 held-out tokens after the context: KL, ΔPPL, top-1,
16 greedy tokens, the largest rival gain over the continuation, and the exact run's
smallest top-2 margin among the 16 greedy steps (a flip below 0.02 is a near-tie the
promise exempts). Decode MB/s is fp16-equivalent bytes over the best of 3 decodes,
numba-fused backend, one thread.

    python benchmarks/bench_near_lossless.py [--model smollm2] [--texts apache2,...] [--out benchmarks/results/near_lossless/near_lossless.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import harness
from kvcodec.models.capture import select_context, tokenize
from kvcodec.eval.curve import cached_capture, default_capture_dir
from kvcodec.models.quality import continue_logits, evaluate
from kvcodec.format import KvcReader
from kvcodec.models.load import load_model
from kvcodec.api import make_plan
from kvcodec.plan.presets import get_plan
from kvcodec.format import encode_kvc_bytes
from kvcodec.models.quality import greedy_with_margins, max_rival_gain
from kvcodec.texts import HELD_OUT, load_text


def decode_mb_s(data: bytes, nbytes_fp16: int) -> tuple[float, object]:
    """(fp16 MB/s of the best of 3 whole-file decodes, the decoded cache)."""
    def dec():
        with KvcReader(data) as r:
            return r.read_cache()

    t = harness.timeit(dec, 3, cpu=None)
    return nbytes_fp16 / t.min / 1e6, t.value


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--texts", default=",".join(HELD_OUT))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/near_lossless/near_lossless.json"))
    run = harness.cli(ap, argv, case="near_lossless")
    args = run.args
    torch.set_num_threads(1)
    lm = load_model(args.model)
    rows = []
    for text in args.texts.split(","):
        all_ids = tokenize(lm.tokenizer, load_text(text))
        ids = select_context(all_ids, args.tokens, min_follow=256)
        cache = cached_capture(lm, ids, default_capture_dir())
        cont = all_ids[len(ids):len(ids) + 256]
        exact = continue_logits(lm, cache, cont)
        greedy, margins = greedy_with_margins(lm, cache, int(cont[0]), 16)
        for method, plan_fn in (("near-lossless", lambda: make_plan(cache, "near-lossless", model=lm)),
                                ("fp16", lambda: get_plan("fp16", cache)),
                                ("near-lossless 8-bit codes (before)", lambda: get_plan("near-lossless", cache, lm=lm, step0=0.02, max_bits=8))):
            with harness.stopwatch(cpu=None) as sw:
                plan = plan_fn()
                data = encode_kvc_bytes(cache, plan, meta={"plan": plan.params})
            enc_s = sw.wall
            mb_s, dec = decode_mb_s(data, cache.num_elements * 2)
            q = evaluate(lm, cache, dec, cont, exact_logits=exact, exact_greedy=greedy).to_json()
            g = plan.params.get("guard", {})
            row = {"model": args.model, "text": text, "method": method, "bits_per_element": round(len(data) * 8 / cache.num_elements, 3),
                   **{k: q[k] for k in ("kl_mean", "dppl_percent", "top1_agreement", "greedy_match")},
                   "rival_gain": round(max_rival_gain(exact, continue_logits(lm, dec, cont)), 4),
                   "min_greedy_margin": round(min(margins), 3), "step0": plan.params.get("step0"),
                   "guard_tries": len(g.get("tries", [])) or None, "encode_s": round(enc_s, 1), "decode_mb_s": round(mb_s, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rows": rows, "cpu_threads": 1}, indent=1) + "\n")
    run.emit({"rows": rows, "cpu_threads": 1})


if __name__ == "__main__":
    main()
