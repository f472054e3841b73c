"""Time-to-first-token of the two ways to answer after a document: prefill it, or load its `.kvc`.

Both paths compute only the last position's logits (``logits_to_keep=1``):
the full-vocabulary projection of every prefill position is work nobody reads
and would inflate the prefill side of the race.

*Warm* TTFT is measured in a process that has already done the same work
(median of repeats after a warm-up). *Cold* TTFT is the first call in a fresh
interpreter, after loading the model -- what every ``kvc ask`` pays: loading
numba's compiled kernels, resolving the calibration, torch's first forward
pass. :func:`cold_ttft` spawns ``python -m kvcodec.runtime.ttft`` for that; the model
load itself is excluded (both paths pay it equally), and is reported apart.
The `.kvc` child starts :func:`kvcodec.runtime.warmup.prewarm` before loading the
model, exactly as ``kvc ask`` does; whatever of it is still running when the
timer starts is paid inside the measured TTFT.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np


def ttft_prefill(lm: Any, ids: np.ndarray, question: np.ndarray) -> int:
    """First token after prefilling document + question (last-position logits only)."""
    import torch

    with torch.inference_mode():
        x = torch.as_tensor(np.concatenate([ids, question]).astype(np.int64)).unsqueeze(0)
        return int(lm.model(input_ids=x, logits_to_keep=1).logits[0, -1].argmax())


def ttft_kvc(lm: Any, source: Any, question: np.ndarray) -> int:
    """First token after loading the document's `.kvc` (path or bytes), layer by layer, then the question."""
    from kvcodec.integrations.hf import greedy_from, load_cache

    loaded = load_cache(Path(source).read_bytes() if isinstance(source, (str, Path)) else source, lm)
    return greedy_from(lm, loaded.cache, loaded.next_position, question, 1)[0][0]


def median_time(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    """(median seconds of ``repeats`` calls after one warm-up call, last result)."""
    fn()
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def cold_ttft(kind: str, model: str, ids: np.ndarray, question: np.ndarray, kvc: Path | None = None,
              threads: int | None = None) -> dict[str, Any]:
    """TTFT of the first ``kind`` ("prefill" or "kvc") call in a fresh interpreter.

    Returns {"ttft_s", "token", "model_load_s", "process_s"} (process_s: spawn
    to exit, imports included).
    """
    with tempfile.TemporaryDirectory(prefix="kvc-cold-") as d:
        spec = Path(d) / "job.json"
        spec.write_text(json.dumps({"kind": kind, "model": model, "ids": np.asarray(ids).tolist(),
                                    "question": np.asarray(question).tolist(), "kvc": str(kvc) if kvc else None,
                                    "threads": threads}))
        t0 = time.perf_counter()
        out = subprocess.run([sys.executable, "-m", "kvcodec.runtime.ttft", str(spec)], capture_output=True, text=True)
        wall = time.perf_counter() - t0
    if out.returncode != 0:
        from kvcodec.errors import KvcError

        raise KvcError(f"cold TTFT child failed: {(out.stderr.strip().splitlines() or ['?'])[-1]}")
    res = json.loads(out.stdout)
    res["process_s"] = wall
    return res


def _child(spec_path: str) -> None:
    t_start = time.perf_counter()
    spec = json.loads(Path(spec_path).read_text())
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()  # as the `kvc` command does, so cold and warm (kvc demo's own process) are tuned alike
    import torch

    from kvcodec.models.load import load_model, resolve_model_dir
    from kvcodec.runtime.warmup import context_bytes, prewarm

    if spec["threads"]:
        torch.set_num_threads(int(spec["threads"]))
    t0 = time.perf_counter()
    if spec["kind"] == "kvc":  # as `kvc ask` does
        prewarm(context_bytes(resolve_model_dir(spec["model"]), len(spec["ids"])))
    lm = load_model(spec["model"])
    lm.fingerprint  # noqa: B018 - computed once per process by both paths; not part of TTFT
    lm.warm_up()  # both paths, as `kvc ask` does after loading the model: part of model load
    t1 = time.perf_counter()
    q = np.asarray(spec["question"], np.int64)
    if spec["kind"] == "prefill":
        tok = ttft_prefill(lm, np.asarray(spec["ids"], np.int64), q)
    else:
        tok = ttft_kvc(lm, spec["kvc"], q)
    t2 = time.perf_counter()
    print(json.dumps({"ttft_s": t2 - t1, "token": tok, "model_load_s": t1 - t0, "imports_s": t0 - t_start}))


if __name__ == "__main__":  # python -m kvcodec.runtime.ttft JOB.json (used by cold_ttft)
    _child(sys.argv[1])
