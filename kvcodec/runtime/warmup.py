"""Build numba's on-disk JIT cache of the CPU codec kernels once, at setup (issue 21).

Why: the rANS coder, the fused transform decoder and the encoder's hot loops
are numba functions with ``cache=True``. The first process that uses them
compiles them (tens of seconds on a small CPU) and writes the machine code
next to the sources; every later process only loads it. A user's first
``kvc ask`` or ``kvc demo`` should not be that process, so ``.ci/setup`` runs
``python -m kvcodec.runtime.warmup`` once. numba keys its cache on the argument types,
so the warm-up runs the real encode and decode paths (every preset family, the
HF lazy loader) on a small real cache of the embedded model, which also
converts that model once. It also keeps one small `.kvc` per preset family in
``cache_root()/warmup`` for :func:`prewarm`.

:func:`prewarm` is the per-process half (issue 21). A fresh ``kvc ask`` pays,
before its first token, for importing the codec stack (numba, the quant
stages: about 1.5 s of CPU here) and for loading the cached kernels on the
first layer decode (about 0.6 s), and for first-touching the pages its decoded
K/V will occupy (about 0.3 s at 4K tokens). None of this depends on the entry's
contents, so the CLI starts :func:`prewarm` in a background thread before it
loads the model (seconds): by the time ``ask`` opens the entry, those costs
have been paid in parallel with the model load instead of in front of the
first token.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from pathlib import Path

import numpy as np

from kvcodec.errors import json_loads
from kvcodec.paths import cache_root

log = logging.getLogger(__name__)
PRESETS = ("lossless", "near-lossless", "faithful", "balanced")  # small uses balanced's kernels


def warmup_dir() -> Path:
    """Where :func:`warm` keeps its small `.kvc` files for :func:`prewarm`."""
    return cache_root() / "warmup"


def warm(model: str = "smollm2", tokens: int = 64) -> dict[str, float]:
    """Encode and decode a ``tokens``-token real cache with each preset family; seconds per step."""
    import torch

    from kvcodec.models.capture import capture
    from kvcodec.atomic import atomic_write_bytes, ensure_output_dir
    from kvcodec.api import encode_cache
    from kvcodec.format import KvcReader
    from kvcodec.integrations.hf import load_cache
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    t0 = time.perf_counter()
    out: dict[str, float] = {}
    lm = load_model(model)
    out["model_s"] = time.perf_counter() - t0
    cache = capture(lm, text=load_text("gpl3"), max_tokens=tokens)
    q = np.asarray([int(cache.token_ids[-1])], np.int64)
    ensure_output_dir(warmup_dir())
    for preset in PRESETS:
        t1 = time.perf_counter()
        # compiles the kernels: rate control only adds work, and a missing calibration is an error here, not a build
        data = encode_cache(cache, preset, model=lm, rate="fixed", build_calibration=False).data
        assert data is not None
        with KvcReader(data) as r:
            r.read_cache()
        atomic_write_bytes(warmup_dir() / f"{preset}.kvc", data)
        loaded = load_cache(data, lm)
        with torch.inference_mode():
            lm.model(input_ids=torch.as_tensor(q)[None], past_key_values=loaded.cache,
                     position_ids=torch.tensor([[loaded.next_position]]), use_cache=True, logits_to_keep=1)
        out[f"{preset}_s"] = time.perf_counter() - t1
    from kvcodec.decode.registry import warm_cpu

    t1 = time.perf_counter()
    warm_cpu()  # every decode path a KDN worker warms, files of older versions included (rans v1: no preset writes it)
    out["paths_s"] = time.perf_counter() - t1
    out["total_s"] = time.perf_counter() - t0
    return out


def _prewarm(files: list[Path], prefault_bytes: int) -> None:
    from kvcodec.runtime.allocator import prefault

    prefault(prefault_bytes)
    try:
        from kvcodec.format import KvcReader  # the codec stack is imported by the first file's stages

        for path in files:
            with KvcReader(str(path)) as r:
                for i in range(r.header.num_layers):
                    r.read_layer(i)
    except Exception as exc:  # an optimisation only: a missing calibration or a stale file costs speed, never output
        log.debug("prewarm stopped: %s", exc)


def context_bytes(model_dir: Path, tokens: int) -> int:
    """About how many bytes of fresh memory a request over ``tokens`` tokens of context touches: its
    K/V as the attention reads them (float32, every query head after ``repeat_kv``). For the
    embedded model that is 138 KB a token, as measured (~128,000-149,000 page faults at 4K tokens,
    BENCHMARKS.md). 0 when the config cannot be read (then :func:`prewarm` faults nothing in)."""
    try:
        cfg = json_loads((model_dir / "config.json").read_text())
        cfg = cfg.get("text_config", cfg)
        heads = int(cfg["num_attention_heads"])
        head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
        per_token = int(cfg["num_hidden_layers"]) * 2 * heads * head_dim * 4
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return 0
    return per_token * max(0, tokens)


def prewarm(prefault_bytes: int = 0) -> threading.Thread | None:
    """Pay a fresh process's one-time costs in a background (daemon) thread.

    First faults ``prefault_bytes`` of heap pages in (:func:`kvcodec.runtime.allocator.prefault`; size it
    with :func:`context_bytes`), then decodes the small `.kvc` files :func:`warm` left (importing
    the codec stack and loading the compiled kernels as a side effect). Results are discarded,
    and failures are logged at debug level only: the real decode redoes every check. Returns the
    thread, or None when there is nothing to do.
    """
    d = warmup_dir()
    files = [d / f"{p}.kvc" for p in PRESETS if (d / f"{p}.kvc").is_file()]
    if not files and prefault_bytes <= 0:
        return None
    t = threading.Thread(target=_prewarm, args=(files, prefault_bytes), name="kvc-prewarm", daemon=True)
    t.start()
    return t


if __name__ == "__main__":  # python -m kvcodec.runtime.warmup (.ci/setup)
    # Only the embedded model: another shipped model converts on its first use (kvcodec.models.load.resolve_model_dir),
    # so the README's first command does not pay for models the demo never loads.
    res = warm()
    print(f"kvc: warm-up done in {res['total_s']:.0f} s (model {res['model_s']:.0f} s; JIT cache of the codec kernels built)",
          file=sys.stderr)
