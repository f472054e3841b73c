"""benchmarks/gpu_check stays runnable (issue 36): its ``--quick`` mode runs every step under TRITON_INTERPRET=1
on the CPU with tiny sizes, in a subprocess as a GPU session would start it, and writes its one results file.
No timing is checked: there is no GPU here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvcodec.plan.presets import PRESETS as PRESET_TABLE

pytestmark = [pytest.mark.model, pytest.mark.slow]
ROOT = Path(__file__).resolve().parents[2]
PRESETS = list(PRESET_TABLE)  # every preset, in the table's order


def test_gpu_check_quick_runs_every_step(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "gpu_check.json"
    env = dict(os.environ, PYTHON=sys.executable, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_check"), "--quick", "--result", str(out)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    doc = json.loads(out.read_text())
    assert doc["schema"] == "kvcodec-bench/1" and doc["case"] == "gpu_check" and doc["quick"] is True
    res = doc["results"]
    assert res["status"] == "passed" and res["quick"] is True
    steps = res["steps"]
    assert set(steps) == {"tests", "decode", "ttft", "vllm", "sglang"}
    assert steps["tests"]["status"] == "passed" and steps["tests"]["counts"].get("passed", 0) >= 3
    rows = {row["preset"]: row for row in steps["decode"]["rows"]}
    assert list(rows) == PRESETS and all(row["status"] == "passed" and row["gbps"] > 0 for row in rows.values())
    models = steps["ttft"]["models"]
    assert set(models) == {"smollm2", "gemma3-270m"}
    for name, m in models.items():
        assert m["status"] in ("passed", "skipped"), (name, m)
        for row in m["rows"]:
            assert row["first_token_identical"] is True and row["kvc_s"] > 0 and row["prefill_s"] > 0
    assert models["smollm2"]["status"] == "passed"
    assert steps["vllm"]["status"] in ("passed", "skipped") and (steps["vllm"]["status"] == "passed" or steps["vllm"]["why"])
    assert steps["sglang"]["status"] == "skipped" and steps["sglang"]["why"]  # HiCache needs CUDA
    table = "\n".join(res["table"])
    assert "(e)" in table and "(a)" in table and "(b)" in table and "(c)" in table and "(d)" in table
    assert table in r.stdout  # the same short table is printed
