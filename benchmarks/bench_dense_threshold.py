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
regrouped into heads of 64, 128 and 256 channels (bench_head_dims.py's construction). Every
threshold decodes bit-identically (tests/decode/test_fastdecode.py); only the time differs.
Single thread.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import io  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import kvcodec.decode.cpu.fused as F  # noqa: E402
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
    """Seconds per threshold: the sum over calls of each call's best time (the kernel's last argument is the threshold)."""
    best = {v: [float("inf")] * len(calls) for v in values}
    for _ in range(repeat):
        for i, a in enumerate(calls):
            for v in values:
                args = [*a[:-1], v]
                t0 = time.perf_counter()
                F._decode_kernel(*args)
                best[v][i] = min(best[v][i], time.perf_counter() - t0)
    return {v: sum(b) for v, b in best.items()}


def real_files(presets: list[str], tokens: int) -> list[tuple[str, Path]]:
    from bench_speed import get_cache

    from kvcodec.format.writer import WriteOptions, write_kvc
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import get_plan

    cache = get_cache("gpl3", tokens)
    lm = load_model("smollm2")
    d = Path(tempfile.mkdtemp(prefix="kvc-dense-ab-"))
    out = []
    for p in presets:
        plan = get_plan(p, cache, lm=lm)
        buf = io.BytesIO()
        write_kvc(cache, buf, plan.pipelines, WriteOptions.for_plan(plan))
        (d / f"{p}.kvc").write_bytes(buf.getvalue())
        out.append((p, d / f"{p}.kvc"))
    return out


def synthetic_calls(D: int, tokens: int) -> tuple[list[list], float]:
    import bench_head_dims as B

    from kvcodec.codecs.rans import RansStage
    from kvcodec.codecs.transform import KeepStage, QuantizeStage, RopeStage, TransformStage
    from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline

    x = B.real_channels("gpl3", tokens)
    heads = max(1, 256 // D)
    chunks = B.chunks_for(x, D, heads)[:8]
    rows = []
    for ch in chunks:
        bs, ms = zip(*(B.pca(ch[h].astype(np.float64)) for h in range(heads)))
        rows.append((np.stack(bs).astype(np.float16), np.stack(ms).astype(np.float16)))
    att = {"pca.basis": np.stack([r[0] for r in rows] + [rows[0][0]]), "pca.mean": np.stack([r[1] for r in rows] + [rows[0][1]])}
    step = 0.05
    for _ in range(3):  # about 2 bits per element
        pipe = Pipeline([RopeStage(theta=10000.0, dim=D), KeepStage(sink=4), TransformStage(k=None),
                         QuantizeStage(mode="step", step=step, max_bits=8), RansStage(channel_group=8)])
        ctxs = [ChunkContext(layer=j // 2, kind="k" if j % 2 == 0 else "v", attachments=att) for j in range(len(chunks))]
        enc = [pipe.encode(c, ctx) for c, ctx in zip(chunks, ctxs)]
        got = sum(len(p) for p, _, _ in enc) * 8 / sum(c.size for c in chunks)
        step *= 2.0 ** (got - 2.0)
    spec = ArraySpec(chunks[0].shape, "float16")
    calls = record(lambda: [F.decode(pipe, p, s, z, spec, ctx) for (p, s, z), ctx in zip(enc, ctxs)])
    return calls, sum(c.nbytes for c in chunks) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--values", default="9,5,3,0", help="thresholds in eighths (9: never dense, 0: always)")
    ap.add_argument("--presets", default="balanced,small,near-lossless")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=11)
    ap.add_argument("--no-synthetic", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    values = [int(v) for v in a.values.split(",")]
    print(f"load average {os.getloadavg()[0]:.1f}; MB/s of fp16 out, kernel only, best per call of {a.repeat}")
    for name, path in real_files([p for p in a.presets.split(",") if p], a.tokens):
        def dec(path=path):
            with KvcReader(path, attachment_resolver=default_resolver) as r:
                c = r.read_cache(backend="cpu")
            return sum(2 * t.numel() for t in (*c.keys, *c.values)) / 1e6
        mb: list[float] = []
        calls = record(lambda: mb.append(dec()))
        t = ab(calls, values, a.repeat)
        print(f"{name:14s} " + "  ".join(f"dense>={v}/8 {mb[0] / t[v]:6.1f}" for v in values), flush=True)
    if not a.no_synthetic:
        for D in (64, 128, 256):
            calls, mb_s = synthetic_calls(D, 1024)
            t = ab(calls, values, a.repeat)
            print(f"synthetic D={D:<4d}" + "  ".join(f"dense>={v}/8 {mb_s / t[v]:6.1f}" for v in values), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
