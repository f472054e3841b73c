"""Decode whole `.kvc` files in a loop, one thread, and print the seconds: the body of an interleaved A/B of two
checkouts (BENCHMARKS.md, "The package re-layout did not change decode speed").

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/checks/decode_loop.py A.kvc [B.kvc ...] REPEATS

Each file is decoded once first (the JIT cache loads), then REPEATS times each. It uses only
``KvcReader(bytes).read_cache(backend="cpu")``, which every checkout since the container's first version has.
"""

from __future__ import annotations

import os
import sys
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("NUMBA_NUM_THREADS", "1")

import torch  # noqa: E402

from kvcodec.format import KvcReader  # noqa: E402


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    paths, reps = sys.argv[1:-1], int(sys.argv[-1])
    torch.set_num_threads(1)
    datas = [open(p, "rb").read() for p in paths]
    for d in datas:
        KvcReader(d).read_cache(backend="cpu")
    t0 = time.perf_counter()
    for _ in range(reps):
        for d in datas:
            KvcReader(d).read_cache(backend="cpu")
    print(f"{time.perf_counter() - t0:.3f}")


if __name__ == "__main__":
    main()
