"""Compile every kvcodec Triton kernel for sm_80 and sm_90 without a GPU.

``python -m kvcodec.decode.triton.compile_check [--arch 80 90] [--json]`` lowers each
kernel variant through Triton (TTIR -> TTGIR -> LLVM -> PTX -> cubin with the
``ptxas`` Triton bundles), then re-runs that ``ptxas`` with ``-v`` on the PTX to
read registers, spill stores/loads and stack frame per kernel (Triton only
learns ``n_regs``/``n_spills`` when loading the cubin on a real device).
Exit status 1 if a kernel listed in :data:`NO_SPILL` spills.

All kernels are compiled with ``enable_fp_fusion=False`` (ptxas ``--fmad=false``)
so that float products and sums are never fused into FMAs, matching numpy.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

NO_SPILL = ("rans_decode", "fused_inverse")  # kernels that must not spill (prefix match on the variant name)


@dataclass
class CompileResult:
    kernel: str
    variant: str
    arch: int
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    fma_f32: int  # fused multiply-adds in the PTX (must be 0: numpy never fuses)
    seconds: float

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads


def _variants() -> list[tuple[str, str, object, dict, dict, dict]]:
    """(kernel, variant, jit fn, signature, constexprs, options) for every kernel we ship."""
    from kvcodec.decode.triton.rans_kernel import kernels

    k = kernels(interpret=False)
    out = []
    rans_sig = {
        "fc_ptr": "*i32", "tab_ptr": "*i32", "tsel_ptr": "*i32", "tbase_ptr": "*i64", "state_ptr": "*i32",
        "nsym_ptr": "*i32", "nwords_ptr": "*i32", "wstart_ptr": "*i64", "obase_ptr": "*i64", "words_ptr": "*i16",
        "out_ptr": "*u8", "err_ptr": "*i32", "C": "i32", "A": "i32", "G": "i32", "ROW": "i32", "BSYM": "i32",
        "LOG2A": "constexpr", "TABLE": "constexpr", "CB": "constexpr",
    }
    for table in (False, True):
        for log2a in ((4, 8) if not table else (8,)):
            name = f"rans_decode[{'table' if table else 'search'},A<=2^{log2a},CB=4]"
            out.append(("rans_decode", name, k["rans_decode"], rans_sig, {"LOG2A": log2a, "TABLE": table, "CB": 4}, {"num_warps": 4}))
    bt_sig = {"fc_ptr": "*i32", "tab_ptr": "*i32", "A": "i32", "LOG2A": "constexpr", "BLOCK": "constexpr"}
    out.append(("build_table", "build_table[A<=2^8,BLOCK=1024]", k["build_table"], bt_sig, {"LOG2A": 8, "BLOCK": 1024}, {"num_warps": 4}))
    from kvcodec.decode.triton import dequant_kernels

    if hasattr(dequant_kernels, "compile_variants"):
        out.extend(dequant_kernels.compile_variants())
    return out


_RE_REGS = re.compile(r"Used (\d+) registers")
_RE_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_RE_STACK = re.compile(r"(\d+) bytes stack frame")
_RE_SMEM = re.compile(r"(\d+) bytes smem")


def _ptxas_stats(ptx: str, arch: int) -> tuple[int, int, int, int, int]:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    ptxas = get_ptxas(arch).path
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        cmd = [ptxas, "-v", "--fmad=false", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o", os.path.join(d, "k.o")]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
    log = r.stdout + r.stderr
    found = _RE_REGS.search(log)
    if found is None:
        raise RuntimeError(f"no register count in the compiler's output: {log[-400:]}")
    regs = int(found.group(1))
    m = _RE_SPILL.search(log)
    ss, sl = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
    m = _RE_STACK.search(log)
    stack = int(m.group(1)) if m else 0
    m = _RE_SMEM.search(log)
    smem = int(m.group(1)) if m else 0
    return regs, ss, sl, stack, smem


def compile_all(archs: tuple[int, ...] = (80, 90)) -> list[CompileResult]:
    import triton
    from triton.backends.compiler import GPUTarget

    results = []
    for kernel, variant, fn, sig, const, opts in _variants():
        for arch in archs:
            t0 = time.time()
            src = triton.compiler.ASTSource(fn, sig, constexprs=const)
            ck = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(opts, enable_fp_fusion=False))
            assert ck.metadata.enable_fp_fusion is False
            ptx = ck.asm["ptx"]
            regs, ss, sl, stack, smem = _ptxas_stats(ptx, arch)
            fma = len(re.findall(r"\bfma\.rn\.f(?:32|16)", ptx))
            results.append(CompileResult(kernel, variant, arch, regs, ss, sl, stack, max(smem, int(ck.metadata.shared)), fma, time.time() - t0))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcodec.decode.triton.compile_check", description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    res = compile_all(tuple(args.arch))
    if args.json:
        print(json.dumps([asdict(r) for r in res], indent=1))
    else:
        print(f"{'kernel variant':44s} {'arch':>5s} {'regs':>5s} {'spill st/ld':>12s} {'stack':>6s} {'smem':>6s} {'fma':>4s} {'s':>5s}")
        for r in res:
            print(f"{r.variant:44s} sm_{r.arch:<3d} {r.registers:5d} {r.spill_stores:6d}/{r.spill_loads:<5d} {r.stack_bytes:6d} {r.shared_bytes:6d} {r.fma_f32:4d} {r.seconds:5.1f}")
    bad = [r for r in res if r.kernel.startswith(NO_SPILL) and r.spills]
    for r in bad:
        print(f"FAIL: {r.variant} spills on sm_{r.arch} ({r.spill_stores} B stores, {r.spill_loads} B loads)", file=sys.stderr)
    fused = [r for r in res if r.fma_f32]
    for r in fused:
        print(f"FAIL: {r.variant} on sm_{r.arch} has {r.fma_f32} fused multiply-adds (enable_fp_fusion must be False)", file=sys.stderr)
    return 1 if bad or fused else 0


if __name__ == "__main__":
    raise SystemExit(main())
