"""Build numba's on-disk JIT cache of the CPU codec kernels once, at setup (issue 21).

Why: the rANS coder, the fused transform decoder and the encoder's hot loops
are numba functions with ``cache=True``. The first process that uses them
compiles them (tens of seconds on a small CPU) and writes the machine code
next to the sources; every later process only loads it. A user's first
``kvc ask`` or ``kvc demo`` should not be that process, so ``.ci/setup`` runs
``python -m kvcodec.warmup`` once. numba keys its cache on the argument types,
so the warm-up runs the real encode and decode paths (every preset family, the
HF lazy loader) on a small real cache of the embedded model, which also
converts that model once.
"""

from __future__ import annotations

import sys
import time

import numpy as np


def warm(model: str = "smollm2", tokens: int = 64) -> dict[str, float]:
    """Encode and decode a ``tokens``-token real cache with each preset family; seconds per step."""
    import torch

    from .capture import capture
    from .format import KvcReader, encode_kvc_bytes, get_plan
    from .hf import load_cache
    from .model import load_model
    from .texts import load_text

    t0 = time.perf_counter()
    out: dict[str, float] = {}
    lm = load_model(model)
    out["model_s"] = time.perf_counter() - t0
    cache = capture(lm, text=load_text("gpl3"), max_tokens=tokens)
    q = np.asarray([int(cache.token_ids[-1])], np.int64)
    for preset in ("lossless", "near-lossless", "balanced"):  # small uses balanced's kernels
        t1 = time.perf_counter()
        plan = get_plan(preset, cache, lm=lm)
        data = encode_kvc_bytes(cache, plan.pipelines, attachments=plan.attachments, preset=plan.preset)
        with KvcReader(data) as r:
            r.read_cache()
        loaded = load_cache(data, lm)
        with torch.inference_mode():
            lm.model(input_ids=torch.as_tensor(q)[None], past_key_values=loaded.cache,
                     position_ids=torch.tensor([[loaded.next_position]]), use_cache=True, logits_to_keep=1)
        out[f"{preset}_s"] = time.perf_counter() - t1
    out["total_s"] = time.perf_counter() - t0
    return out


def convert_shipped() -> list[str]:
    """Convert every installed shipped model other than the embedded one (kvcodec.model.SHIPPED) once,
    so the model matrix's first test or command does not pay the conversion; returns their names."""
    import importlib.util

    from .model import DEFAULT_MODEL, SHIPPED, resolve_model_dir

    done = []
    for name, m in SHIPPED.items():
        if name != DEFAULT_MODEL and importlib.util.find_spec(m.module) is not None:
            resolve_model_dir(name)
            done.append(name)
    return done


if __name__ == "__main__":  # python -m kvcodec.warmup
    others = convert_shipped()
    if others:
        print(f"kvc: converted shipped models: {', '.join(others)}", file=sys.stderr)
    res = warm()
    print(f"kvc: warm-up done in {res['total_s']:.0f} s (model {res['model_s']:.0f} s; JIT cache of the codec kernels built)",
          file=sys.stderr)
