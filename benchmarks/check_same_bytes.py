"""Encode one real cache with every preset, override and baseline and print each file's sha256 and size.

Run it on two checkouts and diff the outputs: a refactor must leave every byte the writer produces unchanged.

    python benchmarks/check_same_bytes.py > after.txt
    (cd /path/to/old/checkout && PYTHONPATH=. python /path/to/check_same_bytes.py) > before.txt; diff before.txt after.txt

The cache is the 256-token gpl3 SmolLM2 cache of bench_speed.py (``$KVC_BENCH_CACHE/speed-gpl3-256.h5``); the
token importance for tokenscale is computed once with the model and kept next to it.
"""

from __future__ import annotations

import hashlib
import io
import os
from pathlib import Path
import numpy as np
import torch

from kvcodec.plan.baseline_plans import BASELINES, get_baseline_plan
from kvcodec.format.writer import write_kvc
from kvcodec.core.kvcache import load_h5

try:
    from kvcodec.plan.presets import get_plan
except ImportError:  # a checkout from before kvcodec/plan/presets.py (issue 18)
    from kvcodec.format.presets import get_plan

torch.set_num_threads(1)
CACHE_DIR = Path(os.environ.get("KVC_BENCH_CACHE", "/tmp/kvc-cache"))
cache = load_h5(CACHE_DIR / "speed-gpl3-256.h5")
imp_path = CACHE_DIR / "importance-gpl3-256.npy"
if not imp_path.exists():
    from kvcodec.models.load import load_model
    from kvcodec.plan.importance import cache_importance
    lm = load_model("smollm2")
    np.save(imp_path, cache_importance(lm, cache, window=512))
imp = np.load(imp_path)
out = {}
def h(name, plan, **kw):
    buf = io.BytesIO()
    try:  # encoder inputs (tokenscale's classes) travel in the write options since issue 18's pure-config stages
        from kvcodec.format.writer import WriteOptions
    except ImportError:  # an older checkout: the stages carry them
        write_kvc(cache, buf, plan.pipelines, attachments=plan.attachments, preset=plan.preset, **kw)
    else:
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
for k, v in out.items():
    print(f"{k:28s} {v}")
