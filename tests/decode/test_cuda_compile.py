"""Compile every Triton kernel for sm_80 and sm_90 without a GPU; no spills in the rANS decoder or the fused chain.

Runs ``python -m kvcodec.decode.triton.compile_check`` in a subprocess (with
TRITON_INTERPRET unset: interpreted kernels cannot be compiled, and the
interpreter tests set it for the whole pytest process). ptxas is the one
Triton bundles; registers and spills come from ``ptxas -v``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.triton


def test_compile_sm80_sm90_no_spills():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-m", "kvcodec.decode.triton.compile_check", "--json"], capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout)
    print("\n" + "\n".join(f"{x['variant']:44s} sm_{x['arch']} regs={x['registers']:3d} spills={x['spill_stores']}/{x['spill_loads']} fma={x['fma_f32']}" for x in res))
    assert {x["arch"] for x in res} == {80, 90}
    kernels = {x["kernel"] for x in res}
    assert {"rans_decode", "build_table", "dq_step", "dq_minmax", "inv_transform", "rope", "store", "fused_inverse"} <= kernels
    for x in res:
        assert x["fma_f32"] == 0, x
        if x["kernel"] in ("rans_decode", "fused_inverse"):
            assert x["spill_stores"] == 0 and x["spill_loads"] == 0 and x["stack_bytes"] == 0, x
