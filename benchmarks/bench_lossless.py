"""Lossless stages on real KV: raw vs zstd vs shuffle+zstd, sizes in bits per KV element.

    python benchmarks/bench_lossless.py [--capture FILE.h5] [--text gpl3] [--tokens 2048] [--levels 3,9]

Sizes are whole `.kvc` files (header, index, token ids and padding included),
for the capture's own dtype (float32 for the embedded model) and for the
same cache cast to float16 and bfloat16. No timing claims: the box is shared.
"""

from __future__ import annotations

import argparse
import json

import torch

import harness
from kvcodec.format import encode_kvc_bytes, lossless_pipeline, raw_pipeline


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--capture", help="an existing .h5/.safetensors capture (else capture --text on smollm2)")
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--levels", default="3")
    ap.add_argument("--json", action="store_true")
    run = harness.cli(ap, argv, case="lossless")
    args = run.args
    if args.capture:
        from kvcodec.core.kvcache import load_capture

        cache = load_capture(args.capture)
    else:
        from kvcodec.models.capture import capture
        from kvcodec.models.load import load_model
        from kvcodec.texts import load_text

        cache = capture(load_model("smollm2"), text=load_text(args.text), max_tokens=args.tokens)
    rows = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        c = cache if cache.dtype == dt else cache.to(dt)
        name = str(dt).removeprefix("torch.")
        variants = [("raw", raw_pipeline(name))]
        for lv in (int(x) for x in args.levels.split(",")):
            variants += [(f"zstd-{lv}", lossless_pipeline(name, lv, shuffle=False)),
                         (f"shuffle+zstd-{lv}", lossless_pipeline(name, lv))]
        for label, p in variants:
            n = len(encode_kvc_bytes(c, p))
            rows.append({"dtype": name, "pipeline": label, "bytes": n, "bits_per_element": n * 8 / c.num_elements,
                         "ratio_vs_fp16": c.nbytes_fp16 / n})
    run.emit({"tokens": cache.num_tokens, "layers": cache.num_layers, "elements": cache.num_elements, "rows": rows})
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(f"{cache.num_tokens} tokens x {cache.num_layers} layers, {cache.num_elements:,} KV elements")
    print(f"{'dtype':9s} {'pipeline':18s} {'bytes':>12s} {'bits/elem':>10s} {'vs fp16':>8s}")
    for r in rows:
        print(f"{r['dtype']:9s} {r['pipeline']:18s} {r['bytes']:>12,} {r['bits_per_element']:>10.3f} {r['ratio_vs_fp16']:>7.3f}x")


if __name__ == "__main__":
    main()
