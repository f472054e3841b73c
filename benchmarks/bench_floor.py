"""Where `near-lossless` stops improving: its KL floor and what sets it (issue 15).

Encodes one text's 1024-token context with the `near-lossless` plan at several
settings, *without* the encode-time check (explicit ``step0``), and evaluates
each on the next 256 tokens against the exact cache: bits/element (file bytes),
KL, ΔPPL, top-1, greedy match (16 tokens) and the largest logit change over the
continuation. Settings are ``STEP[:CHUNK_TOKENS][:hadamard][:SINK][:MAX_BITS]`` (MAX_BITS over 8:
quantize v2's 16-bit codes); the exact run's
16 greedy top-2 margins are printed first (a flip at a margin well above 0.02
is a real miss, not a near-tie).

    python benchmarks/bench_floor.py --text apache2 0.02 0.01 0.005 0.02:64 0.005:32 0.005::hadamard 0.02:::32 0.02:::128
    python benchmarks/bench_floor.py --text apache2 0.02::::16 0.005::::16 0.002::::16
"""

from __future__ import annotations

import argparse
import io
import json

import torch

import harness
from kvcodec.models.capture import select_context, tokenize
from kvcodec.eval.curve import cached_capture, default_capture_dir
from kvcodec.models.quality import continue_logits, evaluate
from kvcodec.format.writer import write_kvc
from kvcodec.models.load import load_model
from kvcodec.plan.presets import get_plan
from kvcodec.format import KvcReader
from kvcodec.models.quality import greedy_with_margins, max_rival_gain
from kvcodec.texts import load_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("settings", nargs="*", default=["0.02", "0.005"],
                    help="STEP[:CHUNK_TOKENS][:hadamard][:SINK][:MAX_BITS] (default: 0.02 0.005)")
    ap.add_argument("--text", default="apache2")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=1)
    run = harness.cli(ap, argv, case="floor")
    args = run.args
    torch.set_num_threads(args.threads)
    lm = load_model("smollm2")
    all_ids = tokenize(lm.tokenizer, load_text(args.text))
    ids = select_context(all_ids, args.tokens, min_follow=256)
    cache = cached_capture(lm, ids, default_capture_dir())
    cont = all_ids[len(ids):len(ids) + 256]
    exact = continue_logits(lm, cache, cont)
    greedy, margins = greedy_with_margins(lm, cache, int(cont[0]), 16)
    print(json.dumps({"text": args.text, "exact_top2_margins": [round(m, 3) for m in margins]}))
    rows = []
    for s in args.settings:
        parts = (s.split(":") + ["", "", "", ""])[:5]
        step, chunk, basis = float(parts[0]), int(parts[1]) if parts[1] else None, parts[2] or "pca"
        kw = {"basis": basis} if basis != "pca" else {}
        if parts[3]:
            kw["sink"] = int(parts[3])  # tokens kept exact at the start of the context
        if parts[4]:
            kw["max_bits"] = int(parts[4])
        plan = get_plan("near-lossless", cache, lm=lm, step0=step, **kw)
        buf = io.BytesIO()
        write_kvc(cache, buf, plan, chunk_tokens=chunk)
        data = buf.getvalue()
        dec = KvcReader(data).read_cache()
        q = evaluate(lm, cache, dec, cont, exact_logits=exact, exact_greedy=greedy).to_json()
        rows.append({"step0": step, "chunk_tokens": chunk, "basis": basis, "sink": kw.get("sink", 4),
                     "max_bits": kw.get("max_bits", 8),
                     "bits_per_element": round(len(data) * 8 / cache.num_elements, 3),
                     **{k: q[k] for k in ("kl_mean", "dppl_percent", "top1_agreement", "greedy_match")},
                     "max_abs_logit_change": round(float((continue_logits(lm, dec, cont) - exact).abs().max()), 4),
                     "max_rival_gain": round(max_rival_gain(exact, continue_logits(lm, dec, cont)), 4)})
        print(json.dumps(rows[-1]), flush=True)
    run.emit({"text": args.text, "exact_top2_margins": [round(m, 3) for m in margins], "rows": rows})


if __name__ == "__main__":
    main()
