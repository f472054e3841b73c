"""Where the cold `.kvc` TTFT excess goes: the first call against later calls in one fresh process (issue 21).

Each run is a fresh interpreter that does what ``kvc ask`` does before a
request (allocator tuning, the prewarm thread, model load and warm-up; the
prewarm thread is joined so it cannot overlap), optionally first-touches
``--prefault-mb`` of heap memory in the main thread and frees it, then times
three calls of decode + the question's forward over the decoded cache (the
``.kvc`` TTFT path, :func:`kvcodec.runtime.ttft.ttft_kvc` without the file read).
Runs alternate between the prefault settings so host noise hits them alike.
If the first call's excess disappears when fresh memory was touched in
advance, the excess is first-touch page faults, not the codec.

    python benchmarks/bench_cold_firstcall.py --kvc doc.kvc --prefault-mb 0,512 --runs 2 --threads 1

Without ``--kvc`` it first encodes the first ``--tokens`` (4096) tokens of gpl3 with ``balanced``
(what ``kvc encode --text gpl3 --max-tokens 4096 --preset balanced`` writes) into a temporary file.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import harness


def child(kvc: str, prefault_mb: int, threads: int) -> None:
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()
    import numpy as np
    import torch

    from kvcodec.models.capture import tokenize
    from kvcodec.integrations.hf import greedy_from, load_cache
    from kvcodec.eval.demo import QUESTION
    from kvcodec.models.load import load_model
    from kvcodec.runtime.warmup import prewarm

    torch.set_num_threads(threads)
    th = prewarm()
    lm = load_model("smollm2")
    lm.warm_up()
    if th is not None:
        th.join()
    with harness.stopwatch(cpu=None) as sw:
        bufs = [np.ones(1 << 20) for _ in range(prefault_mb // 8)]  # 8 MB each: heap, below the tuned mmap threshold
        del bufs
    prefault_s = sw.wall
    q = np.asarray(tokenize(lm.tokenizer, QUESTION), np.int64)
    data = open(kvc, "rb").read()
    calls = []
    for _ in range(3):
        loaded = load_cache(data, lm)
        with harness.stopwatch(cpu=None) as sw:
            greedy_from(lm, loaded.cache, loaded.next_position, q, 1)
        calls.append(sw.wall)
    print(json.dumps({"prefault_mb": prefault_mb, "prefault_s": prefault_s, "calls_s": calls}))


def encode_doc(tokens: int, path: Path) -> None:
    """The first ``tokens`` tokens of gpl3, ``balanced``, as ``kvc encode --text gpl3 --max-tokens N`` writes it."""
    subprocess.run([sys.executable, "-m", "kvcodec", "encode", "--text", "gpl3", "--max-tokens", str(tokens),
                    "--preset", "balanced", "-o", str(path)], check=True, stdout=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kvc", default=None, help="the .kvc file (default: encode --tokens tokens of gpl3, balanced)")
    ap.add_argument("--tokens", type=int, default=4096, help="context of the file encoded when --kvc is not given")
    ap.add_argument("--prefault-mb", default="0,512")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    if "--child" in (sys.argv[1:] if argv is None else argv):
        a = ap.parse_args(argv)
        child(a.kvc, int(a.prefault_mb), a.threads)
        return
    run = harness.cli(ap, argv, case="cold_firstcall")
    a = run.args
    if a.kvc is None:
        a.kvc = str(Path(tempfile.mkdtemp(prefix="kvc-firstcall-")) / f"gpl3-{a.tokens}.kvc")
        encode_doc(a.tokens, Path(a.kvc))
    rows = []
    print("| prefault MB | prefault s | first call ms | 2nd, 3rd call ms | first / later |")
    print("|---|---|---|---|---|")
    for _ in range(a.runs):
        for mb in (int(x) for x in a.prefault_mb.split(",")):
            out = subprocess.run([sys.executable, __file__, "--child", "--kvc", a.kvc, "--prefault-mb", str(mb),
                                  "--threads", str(a.threads)], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            c = r["calls_s"]
            rows.append({**r, "first_over_later": c[0] / min(c[1:])})
            print(f"| {mb} | {r['prefault_s']:.2f} | {c[0] * 1e3:.0f} | {c[1] * 1e3:.0f}, {c[2] * 1e3:.0f} | "
                  f"{c[0] / min(c[1:]):.2f}x |", flush=True)
    run.emit({"kvc_bytes": Path(a.kvc).stat().st_size, "rows": rows})


if __name__ == "__main__":
    main()
