"""Fused CPU decode throughput at every head_dim the fast path supports (issue 19).

    python benchmarks/bench_head_dims.py                     # 1024 tokens of gpl3, best of 5
    python benchmarks/bench_head_dims.py --tokens 512 --repeat 9 --json
    python benchmarks/bench_head_dims.py --basis full        # one PCA per whole head (kvc calibrate --basis full)

``--basis blocks`` (the default) builds each head's PCA block-diagonal over
:func:`kvcodec.codecs.blocks.channel_blocks`, as calibration does for head_dim > 64; the fused
decoder then decodes those heads block by block. ``--basis full`` is the whole-head basis.

Why synthetic head sizes from a real cache: the machine has real models with
head_dim 64 (SmolLM2) and 256 (Gemma 3) only. The K/V values here are the
embedded model's real cache (``--tokens`` of ``--text``, float16), all layers'
K and V channels concatenated per token and regrouped into heads of ``D``
channels, so the value statistics are real at every ``D``; each head gets its
own PCA basis (from the data, as calibration would) and the chunks go through
the transform pipeline of the lossy presets (rope -> keep(4 sink) -> PCA
transform -> quantize(step) -> rANS), with the step set so every ``D`` codes
at about ``--bits`` bits per element (the balanced preset's range).

Measured single-thread (``NUMBA_NUM_THREADS=1``, ``torch`` 1 thread), best of
``--repeat``: MB/s of fp16 K/V out of the fused decoder
(:func:`kvcodec.decode.cpu.fused.decode`, chunk decode only: no file I/O,
CRCs or torch tensors -- ``bench_speed.py`` measures the whole reader on a real
file) against the generic, normative ``Pipeline.decode`` of the same chunks in
the same run (``speedup``). Each figure is also given per second of the thread's
own CPU time (``time.thread_time``): on a machine shared with other jobs the wall
time includes waiting for a core, the CPU time does not (it still suffers shared
caches and memory bandwidth), so it is the better estimate of a quiet core's
speed -- but an estimate; quote it as such. Every fused output is checked bit-identical to the
generic one before it is timed. On a shared machine the best-of-N is the
least-disturbed run; say so when quoting it.
"""

from __future__ import annotations

import os

os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import argparse  # noqa: E402
import json  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import harness  # noqa: E402
from common import real_channels, synthetic_chunks  # noqa: E402
from kvcodec.decode.cpu import fused as F  # noqa: E402


def bench_dim(x: np.ndarray, D: int, heads: int, bits: float, repeat: int, blocks: bool = False) -> dict:
    pipe, enc, ctxs, spec, chunks, got = synthetic_chunks(x, D, heads, bits, blocks)
    T = chunks[0].shape[1]
    for (p, s, z), ctx in zip(enc, ctxs):
        fast = F.decode(pipe, p, s, z, spec, ctx) if F.supports(pipe, spec) else None
        ref = pipe.decode(p, s, z, spec, ctx)
        assert fast is not None, f"fused path declined head_dim {D}"
        assert np.array_equal(fast.view(np.uint16), ref.view(np.uint16)), f"head_dim {D}: fused != generic"

    def run(fn) -> tuple[float, float]:
        """(best wall seconds, best thread-CPU seconds) over ``repeat`` runs."""
        t = harness.timeit(lambda: [fn(p, s, z, spec, ctx) for (p, s, z), ctx in zip(enc, ctxs)], repeat, cpu="thread")
        return t.min, t.cpu_min

    mb = sum(c.nbytes for c in chunks) / 1e6
    t_fast, c_fast = run(lambda *a: F.decode(pipe, *a))
    t_gen, c_gen = run(lambda *a: pipe.decode(*a))
    return {"head_dim": D, "chunks": len(chunks), "heads_per_chunk": heads, "tokens": T, "fp16_mb": mb, "bits_per_element": got,
            "fused_s": t_fast, "fused_mb_s": mb / t_fast, "fused_cpu_s": c_fast, "fused_mb_per_cpu_s": mb / c_fast,
            "generic_s": t_gen, "generic_mb_s": mb / t_gen, "generic_mb_per_cpu_s": mb / c_gen, "speedup": t_gen / t_fast}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--bits", type=float, default=2.0, help="target bits per element of the coded chunks")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--head-dims", default=",".join(str(d) for d in F.HEAD_DIMS))
    ap.add_argument("--basis", choices=("full", "blocks"), default="blocks",
                    help="PCA over the whole head, or block-diagonal over its channel blocks (what calibration builds)")
    ap.add_argument("--json", action="store_true")
    run = harness.cli(ap, argv, case="head_dims")
    a = run.args
    torch.set_num_threads(1)
    x = real_channels(a.text, a.tokens)
    res = {"text": a.text, "tokens": a.tokens, "repeat": a.repeat, "basis": a.basis, "loadavg_start": os.getloadavg()[0], "dims": []}
    for D in (int(d) for d in a.head_dims.split(",")):
        heads = max(1, 256 // D)  # ~ the same bytes per chunk at every D
        res["dims"].append(bench_dim(x, D, heads, a.bits, a.repeat, a.basis == "blocks"))
        if not a.json:
            r = res["dims"][-1]
            print(f"head_dim {D:4d}: {r['bits_per_element']:.2f} bits/el, fused {r['fused_mb_s']:7.1f} MB/s "
                  f"({r['fused_mb_per_cpu_s']:.1f} MB per thread-CPU s), "
                  f"generic {r['generic_mb_s']:6.1f} MB/s ({r['speedup']:.1f}x), {r['chunks']} chunks of {heads}x{r['tokens']}x{D}",
                  flush=True)
    res["loadavg_end"] = os.getloadavg()[0]
    run.emit(res)
    if a.json:
        print(json.dumps(res, indent=2))
    else:
        print(f"load average {res['loadavg_start']:.1f} -> {res['loadavg_end']:.1f} (best of {a.repeat}, single thread)")


if __name__ == "__main__":
    main()
