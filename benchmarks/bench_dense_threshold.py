"""Interleaved A/B of the fused decoder's dense-row threshold (issue 21; kvcodec.decode.cpu.fused.DENSE_OF_8).

    python benchmarks/bench_dense_threshold.py                         # balanced/small/near-lossless + synthetic heads
    python benchmarks/bench_dense_threshold.py --values 9,5,3,0 --repeat 11 --no-synthetic

Why interleaved in one process: this shared VM's speed drifts by +-30 % between runs, more
than the effect measured. The script encodes a real 2048-token gpl3 cache of the embedded
model with each preset (model plan, as `kvc encode` does), decodes it once through the reader
while recording every call of the fused kernel (its exact arguments), then replays those calls
``--repeat`` times, each call once per threshold value in turn, keeping the best time per
call. A threshold of 9 means never dense (always compact the nonzero coefficients), 0 always
dense. With ``--synthetic`` (default) it does the same on 2-bit chunks of the real cache
regrouped into heads of 64, 128 and 256 channels (bench_head_dims.py's construction: common.synthetic_chunks). Every
threshold decodes bit-identically (tests/decode/test_fastdecode.py); only the time differs.
Single thread.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import inspect  # noqa: E402
import io  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness  # noqa: E402
import kvcodec.decode.cpu.fused as F  # noqa: E402
from common import get_cache, real_channels, synthetic_chunks  # noqa: E402
from kvcodec.calibration.store import default_resolver  # noqa: E402
from kvcodec.format.reader import KvcReader  # noqa: E402


def record(fn) -> list[list]:
    """The fused kernel's calls (arguments copied) while ``fn()`` runs."""
    calls: list[list] = []
    orig = F._decode_kernel

    def spy(*a):
        calls.append([np.copy(v) if isinstance(v, np.ndarray) else v for v in a])
        return orig(*a)

    F._decode_kernel = spy
    try:
        fn()
    finally:
        F._decode_kernel = orig
    return calls


def ab(calls: list[list], values: list[int], repeat: int) -> dict[int, float]:
    """Seconds per threshold: the sum over calls of each call's best time (the threshold is the kernel's ``dense8`` argument).

    Timed call by call, interleaved across thresholds (not with harness.timeit, which times one function's
    repeats back to back): the interleaving is what makes the A/B fair on a drifting machine."""
    at = list(inspect.signature(F._decode_kernel.py_func).parameters).index("dense8")
    best = {v: [float("inf")] * len(calls) for v in values}
    for _ in range(repeat):
        for i, a in enumerate(calls):
            for v in values:
                args = [*a[:at], v, *a[at + 1:]]
                t0 = time.perf_counter()
                F._decode_kernel(*args)
                best[v][i] = min(best[v][i], time.perf_counter() - t0)
    return {v: sum(b) for v, b in best.items()}


def real_files(presets: list[str], tokens: int) -> list[tuple[str, Path]]:
    from kvcodec.format.writer import write_kvc
    from kvcodec.models.load import load_model
    from kvcodec.api import make_plan

    cache = get_cache("gpl3", tokens)
    lm = load_model("smollm2")
    d = Path(tempfile.mkdtemp(prefix="kvc-dense-ab-"))
    out = []
    for p in presets:
        plan = make_plan(cache, p, model=lm)
        buf = io.BytesIO()
        write_kvc(cache, buf, plan)
        (d / f"{p}.kvc").write_bytes(buf.getvalue())
        out.append((p, d / f"{p}.kvc"))
    return out


def synthetic_calls(D: int, tokens: int) -> tuple[list[list], float]:
    """The kernel's calls decoding 8 chunks of 2-bit synthetic heads of D (whole-head PCA bases)."""
    x = real_channels("gpl3", tokens)
    pipe, enc, ctxs, spec, chunks, _ = synthetic_chunks(x, D, max(1, 256 // D), 2.0, blocks=False, max_chunks=8)
    calls = record(lambda: [F.decode(pipe, p, s, z, spec, ctx) for (p, s, z), ctx in zip(enc, ctxs)])
    return calls, sum(c.nbytes for c in chunks) / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", default="9,5,3,0", help="thresholds in eighths (9: never dense, 0: always)")
    ap.add_argument("--presets", default="balanced,small,near-lossless")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--no-synthetic", action="store_true")
    run = harness.cli(ap, argv, case="dense_threshold")
    a = run.args
    torch.set_num_threads(1)
    values = [int(v) for v in a.values.split(",")]
    rows: list[dict] = []
    print(f"load average {os.getloadavg()[0]:.1f}; MB/s of fp16 out, kernel only, best per call of {a.repeat}")
    for name, path in real_files([p for p in a.presets.split(",") if p], a.tokens):
        def dec(path=path):
            with KvcReader(path, attachment_resolver=default_resolver) as r:
                c = r.read_cache(backend="cpu")
            return sum(2 * t.numel() for t in (*c.keys, *c.values)) / 1e6
        mb: list[float] = []
        calls = record(lambda: mb.append(dec()))
        t = ab(calls, values, a.repeat)
        rows.append({"file": name, "fp16_mb": mb[0], "mb_s": {str(v): mb[0] / t[v] for v in values}})
        print(f"{name:14s} " + "  ".join(f"dense>={v}/8 {mb[0] / t[v]:6.1f}" for v in values), flush=True)
    if not a.no_synthetic:
        for D in (64, 128, 256):
            calls, mb_s = synthetic_calls(D, 1024)
            t = ab(calls, values, a.repeat)
            rows.append({"file": f"synthetic D={D}", "fp16_mb": mb_s, "mb_s": {str(v): mb_s / t[v] for v in values}})
            print(f"synthetic D={D:<4d}" + "  ".join(f"dense>={v}/8 {mb_s / t[v]:6.1f}" for v in values), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    run.emit({"thresholds": values, "unit": "MB/s of fp16 out, kernel only, sum of each call's best", "rows": rows})


if __name__ == "__main__":
    main()
