"""benchmarks/bench_gpu_decode.py stays runnable: its --smoke mode under TRITON_INTERPRET=1 runs
every measured path (batched rANS, decode_chunk_gpu, decode_chunk_into with the fused chain,
copies) on a tiny real cache on the CPU. No timing is checked: there is no GPU here."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.triton, pytest.mark.model, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_smoke():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_gpu_decode.py"), "--smoke"], capture_output=True, text=True,
                       env=env, timeout=900, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = r.stdout.splitlines()
    assert any("pipeline chain" in x for x in lines)
    row = next(x.split() for x in lines if x.strip().startswith("64 "))
    assert len(row) == 9  # tokens, MB, ratio and six throughput columns, all printed
    assert "not GPU measurements" in r.stdout
