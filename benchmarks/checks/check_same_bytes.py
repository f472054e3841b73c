"""Encode one real cache with every preset, override and baseline and print each file's sha256 and size.

Run it on two checkouts and diff the outputs: a refactor must leave every byte the writer produces unchanged,
the quality check's choices included (``--guarded``: the lossy presets with the model, so the encode-time
check picks step0 on the real model).

    python benchmarks/checks/check_same_bytes.py --guarded > after.txt
    (cd /path/to/old/checkout && python /path/to/this/check_same_bytes.py --guarded) > before.txt
    diff before.txt after.txt

It imports either layout (the package layout of issue 32, or the flat one before it), so the same script runs
on both checkouts. The cache is the 256-token gpl3 SmolLM2 cache of bench_speed.py
(``$KVC_BENCH_CACHE/speed-gpl3-256.h5``, captured here when missing); the token importance for tokenscale is
computed once with the model and kept next to it.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
from pathlib import Path

import numpy as np
import torch

try:  # the package layout (issue 32)
    from kvcodec.core.kvcache import load_h5, save_h5
    from kvcodec.format.writer import write_kvc
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.plan.baseline_plans import BASELINES, get_baseline_plan
    try:
        from kvcodec.models.importance import cache_importance
    except ImportError:  # before issue 56 moved the measurement next to the model
        from kvcodec.plan.importance import cache_importance  # type: ignore[no-redef]
    from kvcodec.api import make_plan
    from kvcodec.plan.presets import get_plan
    from kvcodec.texts import load_text

    NEW = True
except ImportError:  # the flat layout before it
    from kvcodec.baselines.plans import BASELINES, get_baseline_plan  # type: ignore[no-redef]
    from kvcodec.capture import capture, tokenize  # type: ignore[no-redef]
    from kvcodec.format.writer import write_kvc  # type: ignore[no-redef]
    from kvcodec.kvcache import load_h5, save_h5  # type: ignore[no-redef]
    from kvcodec.model import load_model  # type: ignore[no-redef]
    from kvcodec.plans import get_plan  # type: ignore[no-redef]
    from kvcodec.quant.importance import cache_importance  # type: ignore[no-redef]
    from kvcodec.texts import load_text  # type: ignore[no-redef]

    NEW = False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--guarded", action="store_true", help="also the lossy presets with the model (the quality check's choices)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cache_dir = Path(os.environ.get("KVC_BENCH_CACHE", "/tmp/kvc-cache"))
    cache_dir.mkdir(parents=True, exist_ok=True)
    lm = None
    path = cache_dir / "speed-gpl3-256.h5"
    if not path.exists():
        lm = load_model("smollm2")
        save_h5(capture(lm, token_ids=tokenize(lm.tokenizer, load_text("gpl3"))[:256]), path)
    cache = load_h5(path)
    imp_path = cache_dir / "importance-gpl3-256.npy"
    if not imp_path.exists():
        lm = lm or load_model("smollm2")
        np.save(imp_path, cache_importance(lm, cache, window=512))
    imp = np.load(imp_path)
    out = {}

    def h(name, plan, **kw):
        buf = io.BytesIO()
        if NEW:  # the writer takes the plan
            write_kvc(cache, buf, plan, **kw)
        else:  # the plan split into pipelines + write options
            from kvcodec.format.writer import WriteOptions

            write_kvc(cache, buf, plan.pipelines, WriteOptions.for_plan(plan, **kw))
        out[name] = hashlib.sha256(buf.getvalue()).hexdigest()[:16] + f" {len(buf.getvalue())}"

    for p in ["lossless", "fp16", "zstd", "raw", "near-lossless", "balanced", "small"]:
        h(p, get_plan(p, cache))
    h("balanced+imp", get_plan("balanced", cache, importance=imp))
    h("small+imp", get_plan("small", cache, importance=imp))
    h("balanced+hadamard+imp", get_plan("balanced", cache, basis="hadamard", importance=imp))
    h("balanced+embedded", get_plan("balanced", cache, calibration="embedded"))
    h("small+deadzone", get_plan("small", cache, deadzone=0.3, step0=0.5))
    h("lossless+level9", get_plan("lossless", cache, level=9))
    for b in BASELINES:
        p = get_baseline_plan(b, cache)
        h("bl:" + b, p, chunk_tokens=p.chunk_tokens)
    if a.guarded:
        lm = lm or load_model("smollm2")
        for p in ["near-lossless", "balanced", "small"]:
            plan = make_plan(cache, p, model=lm)
            h(f"{p}+model", plan)
            out[f"{p}+model"] += f" step0={plan.params.get('step0')}"
    for k, v in out.items():
        print(f"{k:28s} {v}")


if __name__ == "__main__":
    main()
