"""How much the test suite's torch work loses to background processes: the check behind `.ci/run`'s one-worker
background installs (issue 56, CI time).

    python benchmarks/checks/omp_contention.py [--samples 4] [--repeats 3]

The work is what the slowest early tests run: the calibration's Fisher estimate on SmolLM2 (one forward, then one
backward pass per sample, over a 256-token cache and a 32-token continuation), with torch's default threads (one
per CPU). It is timed alone and beside busy background processes, started niced as `.ci/run` starts its installs:

- ``none``: nothing beside it;
- ``nice1``: one niced busy process (an install limited to one worker);
- ``nice2``: two niced busy processes (ninja's and uv's default: one worker per CPU).

Every setting is run ``--repeats`` times, interleaved, and each line is the wall seconds of one run: the minimum and
the median per setting are printed at the end. A busy process is a shell loop, so the figures measure CPU contention
only (no disk or network). Why it matters: torch's OpenMP threads give their CPU away at every barrier to any other
runnable process, however niced, so with a second busy process beside them a backward pass waits for it again and
again.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time

import numpy as np

BUSY = "while :; do :; done"


def start(setting: str) -> subprocess.Popen | None:
    n = {"none": 0, "nice1": 1, "nice2": 2}[setting]
    if n == 0:
        return None
    loops = " & ".join(f"({BUSY})" for _ in range(n)) + " & wait"
    return subprocess.Popen(["nice", "-n", "19", "sh", "-c", loops], start_new_session=True)


def stop(p: subprocess.Popen | None) -> None:
    if p is not None:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--samples", type=int, default=4, help="Fisher samples (backward passes) per run")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()

    import torch

    from kvcodec.calibration.build import measure_sensitivity
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    lm = load_model("smollm2")
    ids = tokenize(lm.tokenizer, load_text("gpl3"))
    cache, cont = capture(lm, token_ids=ids[:256]), np.asarray(ids[256:288])
    measure_sensitivity(lm, cache, cont, samples=1, seed=1)  # first-call costs
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs; "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}", flush=True)
    got: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for setting in ("none", "nice1", "nice2"):
            p = start(setting)
            try:
                time.sleep(0.3)
                t0 = time.perf_counter()
                measure_sensitivity(lm, cache, cont, samples=args.samples, seed=1)
                dt = time.perf_counter() - t0
            finally:
                stop(p)
            got.setdefault(setting, []).append(dt)
            print(f"{setting:6s} {dt:7.2f} s", flush=True)
    base = statistics.median(got["none"])
    for setting, ts in got.items():
        print(f"{setting:6s} min {min(ts):7.2f} s  median {statistics.median(ts):7.2f} s  "
              f"({statistics.median(ts) / base:.1f}x alone)")


if __name__ == "__main__":
    main()
