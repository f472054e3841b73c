"""Decode speed of near-lossless (quantize v2's 16-bit codes) vs balanced: fused CPU decoder vs the reference.

gpl3, 1024 tokens, SmolLM2, fp32 and fp16 caches; every chunk of each file is decoded by the
``reference`` and the ``numba-fused`` backends (best of 3, MB/s of fp16-equivalent bytes) and the
two outputs are compared bit for bit. Run with one thread::

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/bench_wide_decode.py [--text gpl3] [--tokens 1024] [--repeat 3]
"""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np
import torch

import harness
from kvcodec.decode.registry import backend
from kvcodec.models.capture import select_context, tokenize
from kvcodec.eval.curve import cached_capture, default_capture_dir
from kvcodec.format import KvcReader
from kvcodec.models.load import load_model
from kvcodec.plan.presets import get_plan
from kvcodec.format import encode_kvc_bytes
from kvcodec.texts import load_text


def chunks_of(data: bytes) -> list[tuple[Any, ...]]:
    """Every chunk's (pipeline, payload, sides, sizes, spec, ctx): what a backend decodes."""
    with KvcReader(data) as r:
        return [r.chunk_inputs(j) for j in range(r.num_chunks)]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3, help="decodes per backend (the best is reported)")
    run = harness.cli(ap, argv, case="wide_decode")
    a = run.args
    torch.set_num_threads(1)
    lm = load_model("smollm2")
    ids = select_context(tokenize(lm.tokenizer, load_text(a.text)), a.tokens, min_follow=256)
    rows = []
    cache = cached_capture(lm, ids, default_capture_dir())
    for dtype in (torch.float32, torch.float16):
        c = cache.to(dtype)
        for preset, step0 in (("near-lossless", 0.004), ("balanced", 0.33)):
            plan = get_plan(preset, c, lm=lm, step0=step0)
            data = encode_kvc_bytes(c, plan, meta={"plan": plan.params})
            chunks = chunks_of(data)
            res = {}
            for name in ("reference", "numba-fused"):
                b = backend(name)
                assert all(b.supports(ch[0], ch[4]) for ch in chunks), name
                t = harness.timeit(lambda: [b.decode(*ch) for ch in chunks], a.repeat, cpu=None)
                res[name] = (t.value, t.min)
            same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(f).view(np.uint8))
                       for a, f in zip(res["reference"][0], res["numba-fused"][0]))
            mb = {k: round(c.num_elements * 2 / v[1] / 1e6, 1) for k, v in res.items()}
            rows.append({"dtype": str(dtype), "preset": preset, "step0": step0, "bits_per_element": len(data) * 8 / c.num_elements,
                         "mb_s": mb, "identical": same})
            print(f"{str(dtype):14s} {preset:14s} bits/el {len(data) * 8 / c.num_elements:6.3f}  MB/s {mb}  identical {same}",
                  flush=True)
    run.emit({"text": a.text, "tokens": cache.num_tokens, "rows": rows})


if __name__ == "__main__":
    main()
