"""Triton kernels for the inverse lossy stages (spec/codec-v1.md) and the KV output layouts.

GPU twins of the CPU decodes in :mod:`kvcodec.codecs.transform`, bit for bit:

* ``quantize`` step mode:   x = float32(unzigzag(s)) * float32(step[h, c])
* ``quantize`` minmax mode: x = float32(s) * scale + zero (asymmetric, product
  and sum rounded separately) or float32(s - 2**(b-1)) * scale (symmetric)
* ``transform``: x[h,t,d] = (sum_{k=0..K-1} y[h,t,k] * B[h,d,k]) + mean[h,d], k ascending,
  acc starting at +0.0, every product and add rounded separately
* ``rope``: x = y*cos + rotate_half(y)*sin on the first ``dim`` channels, cos/sin
  from :func:`kvcodec.codecs.rope_tables.rope_tables` (CPU float64, rounded once)
* ``keep``: re-insert kept tokens (torch.cat on the device; no arithmetic)
* ``tokenscale``: x = y * mult[class[t]] (one float32 multiply; torch on the device)
* final cast to the stage's input dtype (round to nearest even), fused into the
  last kernel that writes the tensor.

For the transform-codec chain of every lossy preset (:mod:`kvcodec.decode.chain`)
:func:`fused_decode` runs all of the above in ONE kernel (``fused_inverse``): per
program a tile of tokens x all channels of one head, the RoPE partner channel
accumulated alongside (the same sums in the same order, so it is the same value
the per-stage path computes), the chunk-dtype rounding, then the cast into the
destination layout (the chunk itself, an HF per-layer tensor or a paged cache).

All kernels must be compiled with ``enable_fp_fusion=False`` (passed at every
launch below) so no product/sum pair becomes an FMA on a real GPU; the
interpreter never fuses. Side data is validated on the host with the same
checks and messages as the CPU stage (the matrices/tables helpers of the CPU
stages are reused directly).

Layout writers (:func:`store_hf`, :func:`store_paged`) cast a decoded
(H, T, D) tensor into a caller-provided HF per-layer tensor (1, H, T_cap, D)
or a vLLM-like paged cache (num_blocks, block_size, H, D) with a block table.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import torch
import triton
import triton.language as tl

from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.lru import BoundedLRU
from kvcodec.decode.device import interpret_mode
from kvcodec.decode.triton.rans_kernel import check_interpreter

BLOCK = 512
FUSED_BT = 16  # tokens per program of the fused kernel (x all channels of one head)


# --------------------------------------------------------------------------- kernels


def _dq_step_kernel(sym_ptr, step_ptr, out_ptr, N, TC, C, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    h = i // TC
    c = i % C
    s = tl.load(sym_ptr + i, mask=m, other=0).to(tl.int32)
    q = (s >> 1) ^ (0 - (s & 1))
    st = tl.load(step_ptr + h * C + c, mask=m, other=0.0)
    tl.store(out_ptr + i, q.to(tl.float32) * st, mask=m)


def _dq_minmax_kernel(sym_ptr, scale_ptr, zero_ptr, hb_ptr, out_ptr, N, T, C, G, NG, AXIS_CHANNEL: tl.constexpr,
                      SYMMETRIC: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    TC = T * C
    h = i // TC
    r = i - h * TC
    t = r // C
    c = r - t * C
    if AXIS_CHANNEL:  # scale [H, NG = ceil(T/G), C]
        gi = (h * NG + t // G) * C + c
    else:  # scale [H, T, NG = ceil(C/G)]
        gi = (h * T + t) * NG + c // G
    s = tl.load(sym_ptr + i, mask=m, other=0).to(tl.int32)
    sc = tl.load(scale_ptr + gi, mask=m, other=0.0)
    if SYMMETRIC:
        b = tl.load(hb_ptr + h, mask=m, other=1)
        x = (s - (1 << (b - 1))).to(tl.float32) * sc
    else:
        ze = tl.load(zero_ptr + gi, mask=m, other=0.0)
        x = s.to(tl.float32) * sc + ze
    tl.store(out_ptr + i, x, mask=m)


def _inv_transform_kernel(y_ptr, bt_ptr, mean_ptr, out_ptr, T, K, D, BT: tl.constexpr, BD: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    d = tl.program_id(2) * BD + tl.arange(0, BD)
    tm = t < T
    dm = d < D
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for k in range(0, K):
        yk = tl.load(y_ptr + (h * T + t) * K + k, mask=tm, other=0.0)
        bk = tl.load(bt_ptr + (h * K + k) * D + d, mask=dm, other=0.0)
        acc = acc + yk[:, None] * bk[None, :]
    mu = tl.load(mean_ptr + h * D + d, mask=dm, other=0.0)
    x = acc + mu[None, :]
    tl.store(out_ptr + (h * T + t[:, None]) * D + d[None, :], x.to(out_ptr.dtype.element_ty), mask=tm[:, None] & dm[None, :])


@triton.jit
def _flip_sign(x, where):
    """``-x`` where ``where``, else ``x``, bit-exactly (the sign bit of a float32 flipped)."""
    return (x.to(tl.int32, bitcast=True) ^ tl.where(where, -2147483648, 0)).to(tl.float32, bitcast=True)


def _rope_kernel(y_ptr, cos_ptr, sin_ptr, out_ptr, N, T, D, DIM, HALF, CS_HEAD_STRIDE, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    d = i % D
    ht = i // D
    h = ht // T
    t = ht - h * T
    y = tl.load(y_ptr + i, mask=m, other=0.0)
    rot = m & (d < DIM)
    lo = d < HALF
    partner = tl.where(lo, i + HALF, i - HALF)
    yp = tl.load(y_ptr + partner, mask=rot, other=0.0)
    # rotate_half: -yp on the low half, as a sign-bit flip. Not -yp: Triton 3.6 lowers float negation to
    # 0 - x, which is +0.0 for +0.0 where numpy's negation (the CPU definition) gives -0.0.
    rh = _flip_sign(yp, lo)
    cs = h * CS_HEAD_STRIDE + t * DIM + d
    co = tl.load(cos_ptr + cs, mask=rot, other=0.0)
    si = tl.load(sin_ptr + cs, mask=rot, other=0.0)
    t1 = y * co
    t2 = rh * si
    x = tl.where(rot, t1 + t2, y)
    tl.store(out_ptr + i, x.to(out_ptr.dtype.element_ty), mask=m)


def _store_kernel(src_ptr, dst_ptr, bt_ptr, N, T, D, t0, s_h, s_t, s_d, BS, s_blk, PAGED: tl.constexpr, BF16: tl.constexpr,
                  BLOCK: tl.constexpr):
    """dst[layout(h, t0 + t, d)] = cast(src[h, t, d]). HF: base + h*s_h + pos*s_t + d*s_d;
    paged: block = bt[pos // BS], base + block*s_blk + (pos % BS)*s_t + h*s_h + d*s_d."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < N
    d = i % D
    ht = i // D
    h = ht // T
    pos = ht - h * T + t0
    v = tl.load(src_ptr + i, mask=m, other=0.0)
    h = h.to(tl.int64)
    d = d.to(tl.int64)
    pos = pos.to(tl.int64)
    if PAGED:
        blk = tl.load(bt_ptr + pos // BS, mask=m, other=0).to(tl.int64)
        off = blk * s_blk + (pos % BS) * s_t + h * s_h + d * s_d
    else:
        off = h * s_h + pos * s_t + d * s_d
    if BF16:  # float32 -> bfloat16, round to nearest even done in integers (the interpreter's cast truncates)
        u = v.to(tl.float32).to(tl.uint32, bitcast=True)
        r = (u + 32767 + ((u >> 16) & 1)) >> 16
        # a NaN that is not an exact bfloat16 -> 0x7FC0; an exact one (a lossless bfloat16 file's) keeps its bits
        # (r is u >> 16 then), as core.dtypes.f32_to_bf16 on the CPU
        r = tl.where(((u & 0x7FFFFFFF) > 0x7F800000) & ((u & 0xFFFF) != 0), 0x7FC0, r)
        tl.store(dst_ptr + off, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m)
    else:
        tl.store(dst_ptr + off, v.to(dst_ptr.dtype.element_ty), mask=m)


def _fused_inverse_kernel(sym_ptr, step_ptr, ts_ptr, bt_ptr, mean_ptr, kept_ptr, cos_ptr, sin_ptr, dst_ptr, blk_ptr,
                          T, K, D, NS, NR, DIM, HALF, CS_HEAD_STRIDE, t0, s_h, s_t, s_d, BS, s_blk,
                          HAS_TS: tl.constexpr, ROPE: tl.constexpr, OUT16: tl.constexpr, PAGED: tl.constexpr,
                          BF16: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    """The whole inverse chain of a transform-codec chunk for BT tokens x all D channels of head h:
    y = f32(unzigzag(sym)) * step[h, k] (* ts[t]); acc = acc + y * B[h, k, d] (k ascending);
    x = acc + mean[h, d]; kept rows (t < NS or t >= T - NR) = kept[h, ., d]; RoPE on d < DIM
    with the partner channel computed alongside (accp: the same sums for column d +- HALF);
    round to float16 (OUT16: the chunk dtype); cast and store into the destination layout."""
    h = tl.program_id(0).to(tl.int64)
    t = tl.program_id(1) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    tm = t < T
    dm = d < D
    TC = T - NS - NR
    tc = t - NS
    coded = tm & (tc >= 0) & (tc < TC)
    rot = dm & (d < DIM)
    lo = d < HALF
    pd = tl.where(rot, tl.where(lo, d + HALF, d - HALF), d)
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    accp = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_TS:
        ts = tl.load(ts_ptr + tc, mask=coded, other=1.0)
    for k in range(0, K):
        s = tl.load(sym_ptr + (h * TC + tc) * K + k, mask=coded, other=0).to(tl.int32)
        q = (s >> 1) ^ (0 - (s & 1))
        y = q.to(tl.float32) * tl.load(step_ptr + h * K + k)
        if HAS_TS:
            y = y * ts
        b = tl.load(bt_ptr + (h * K + k) * D + d, mask=dm, other=0.0)
        acc = acc + y[:, None] * b[None, :]
        if ROPE:
            bp = tl.load(bt_ptr + (h * K + k) * D + pd, mask=rot, other=0.0)
            accp = accp + y[:, None] * bp[None, :]
    x = acc + tl.load(mean_ptr + h * D + d, mask=dm, other=0.0)[None, :]
    kept = (tm & (tc < 0)) | (tm & (tc >= TC))
    kt = tl.where(t < NS, t, t - (T - NR) + NS)
    krow = (h * (NS + NR) + kt[:, None]) * D
    km = kept[:, None] & dm[None, :]
    x = tl.where(km, tl.load(kept_ptr + krow + d[None, :], mask=km, other=0.0), x)
    if ROPE:
        xp = accp + tl.load(mean_ptr + h * D + pd, mask=rot, other=0.0)[None, :]
        kpm = kept[:, None] & rot[None, :]
        xp = tl.where(kpm, tl.load(kept_ptr + krow + pd[None, :], mask=kpm, other=0.0), xp)
        rh = _flip_sign(xp, lo[None, :])  # not -xp (see _rope_kernel)
        rm = tm[:, None] & rot[None, :]
        cs = h * CS_HEAD_STRIDE + t[:, None] * DIM + d[None, :]
        co = tl.load(cos_ptr + cs, mask=rm, other=0.0)
        si = tl.load(sin_ptr + cs, mask=rm, other=0.0)
        t1 = x * co
        t2 = rh * si
        x = tl.where(rm, t1 + t2, x)
    if OUT16:
        x = x.to(tl.float16).to(tl.float32)
    pos = (t + t0).to(tl.int64)
    if PAGED:
        blk = tl.load(blk_ptr + pos // BS, mask=tm, other=0).to(tl.int64)
        row = blk * s_blk + (pos % BS) * s_t + h * s_h
    else:
        row = h * s_h + pos * s_t
    off = row[:, None] + d.to(tl.int64)[None, :] * s_d
    m2 = tm[:, None] & dm[None, :]
    if BF16:  # float32 -> bfloat16, round to nearest even in integers (as _store_kernel)
        u = x.to(tl.uint32, bitcast=True)
        r = (u + 32767 + ((u >> 16) & 1)) >> 16
        r = tl.where(((u & 0x7FFFFFFF) > 0x7F800000) & ((u & 0xFFFF) != 0), 0x7FC0, r)  # as _store_kernel
        tl.store(dst_ptr + off, r.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=m2)
    else:
        tl.store(dst_ptr + off, x.to(dst_ptr.dtype.element_ty), mask=m2)


_KERNELS: dict[bool, dict[str, Any]] = {}
_FNS = {
    "dq_step": _dq_step_kernel, "dq_minmax": _dq_minmax_kernel, "inv_transform": _inv_transform_kernel,
    "rope": _rope_kernel, "store": _store_kernel, "fused_inverse": _fused_inverse_kernel,
}


def kernels(interpret: bool | None = None) -> dict[str, Any]:
    mode = interpret_mode() if interpret is None else interpret
    if mode not in _KERNELS:
        if mode:
            check_interpreter()
            from triton.runtime.interpreter import InterpretedFunction as make
        else:
            from triton.runtime.jit import JITFunction as make
        _KERNELS[mode] = {k: make(f) for k, f in _FNS.items()}
    return _KERNELS[mode]


def _launch(name: str, grid: tuple[int, ...], *args: Any, **kw: Any) -> None:
    kw.setdefault("num_warps", 4)
    if not interpret_mode():
        kw["enable_fp_fusion"] = False  # no FMA contraction: products and sums round separately, like numpy
    kernels()[name][grid](*args, **kw)


def compile_variants() -> list[tuple[str, str, Any, dict, dict, dict]]:
    """(kernel, variant, jit fn, signature, constexprs, options) for compile_check."""
    k = kernels(interpret=False)
    o = {"num_warps": 4}
    out = [
        ("dq_step", "dq_step", k["dq_step"], {"sym_ptr": "*u8", "step_ptr": "*fp32", "out_ptr": "*fp32", "N": "i32", "TC": "i32", "C": "i32", "BLOCK": "constexpr"}, {"BLOCK": BLOCK}, o),
    ]
    sig = {"sym_ptr": "*u8", "scale_ptr": "*fp32", "zero_ptr": "*fp32", "hb_ptr": "*i32", "out_ptr": "*fp32", "N": "i32", "T": "i32", "C": "i32",
           "G": "i32", "NG": "i32", "AXIS_CHANNEL": "constexpr", "SYMMETRIC": "constexpr", "BLOCK": "constexpr"}
    for ax in (True, False):
        for sym in (False, True):
            out.append(("dq_minmax", f"dq_minmax[{'channel' if ax else 'token'},{'sym' if sym else 'asym'}]", k["dq_minmax"], sig,
                        {"AXIS_CHANNEL": ax, "SYMMETRIC": sym, "BLOCK": BLOCK}, o))
    for od in ("fp32", "fp16"):
        out.append(("inv_transform", f"inv_transform[out={od},BT=32,BD=64]", k["inv_transform"],
                    {"y_ptr": "*fp32", "bt_ptr": "*fp32", "mean_ptr": "*fp32", "out_ptr": f"*{od}", "T": "i32", "K": "i32", "D": "i32", "BT": "constexpr", "BD": "constexpr"},
                    {"BT": 32, "BD": 64}, o))
    for od in ("fp32", "fp16"):
        out.append(("rope", f"rope[out={od}]", k["rope"],
                    {"y_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32", "out_ptr": f"*{od}", "N": "i32", "T": "i32", "D": "i32", "DIM": "i32",
                     "HALF": "i32", "CS_HEAD_STRIDE": "i32", "BLOCK": "constexpr"}, {"BLOCK": BLOCK}, o))
    for paged in (False, True):
        for od in ("fp16", "bf16"):
            out.append(("store", f"store[{'paged' if paged else 'hf'},out={od}]", k["store"],
                        {"src_ptr": "*fp32", "dst_ptr": f"*{od}", "bt_ptr": "*i32", "N": "i32", "T": "i32", "D": "i32", "t0": "i32", "s_h": "i32",
                         "s_t": "i32", "s_d": "i32", "BS": "i32", "s_blk": "i32", "PAGED": "constexpr", "BLOCK": "constexpr"},
                        {"PAGED": paged, "BF16": od == "bf16", "BLOCK": BLOCK}, o))
    fsig = {"sym_ptr": "*u8", "step_ptr": "*fp32", "ts_ptr": "*fp32", "bt_ptr": "*fp32", "mean_ptr": "*fp32", "kept_ptr": "*fp32",
            "cos_ptr": "*fp32", "sin_ptr": "*fp32", "dst_ptr": "*fp16", "blk_ptr": "*i32", "T": "i32", "K": "i32", "D": "i32",
            "NS": "i32", "NR": "i32", "DIM": "i32", "HALF": "i32", "CS_HEAD_STRIDE": "i32", "t0": "i32", "s_h": "i32", "s_t": "i32",
            "s_d": "i32", "BS": "i32", "s_blk": "i32", "HAS_TS": "constexpr", "ROPE": "constexpr", "OUT16": "constexpr",
            "PAGED": "constexpr", "BF16": "constexpr", "BT": "constexpr", "BD": "constexpr"}
    for rope, paged, od, bd in ((True, False, "fp16", 64), (False, False, "fp16", 64), (True, True, "bf16", 64), (True, False, "fp16", 128)):
        out.append(("fused_inverse", f"fused_inverse[{'rope' if rope else 'norope'},{'paged' if paged else 'hf'},out={od},BT={FUSED_BT},BD={bd}]",
                    k["fused_inverse"], dict(fsig, dst_ptr=f"*{od}"),
                    {"HAS_TS": True, "ROPE": rope, "OUT16": True, "PAGED": paged, "BF16": od == "bf16", "BT": FUSED_BT, "BD": bd}, o))
    return out


# --------------------------------------------------------------------------- stage implementations

_TORCH = {"float16": torch.float16, "float32": torch.float32, "bfloat16": torch.bfloat16, "uint8": torch.uint8}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _dev(a: np.ndarray, device: torch.device, dtype: Any = None) -> torch.Tensor:
    t = torch.from_numpy(np.ascontiguousarray(a if dtype is None else a.astype(dtype)))
    return t.to(device)


def gpu_quantize(stage: Any, x: torch.Tensor, side: dict, spec: Any, ctx: Any) -> Any:
    if stage.version != 1:  # v2's 16-bit byte planes: no kernel, the backend runs the CPU definition
        return NotImplemented
    H, T, C = spec.shape
    if tuple(x.shape) != (H, T, C) or x.dtype != torch.uint8:
        raise KvcFormatError(f"codec 'quantize': got {str(x.dtype).removeprefix('torch.')}{tuple(x.shape)}, expected uint8{spec.shape}")
    dev = x.device
    out = torch.empty((H, T, C), dtype=torch.float32, device=dev)
    N = H * T * C
    if stage.mode == "step":
        step, bits = stage.step_side(side, spec)
        _check_step_symbols(x, bits)
        if N:
            _launch("dq_step", (_cdiv(N, BLOCK),), x, _dev(step, dev, np.float32), out, N, T * C, C, BLOCK=BLOCK)
    else:
        hb, gshape, scale, zero = stage.minmax_side(side, spec)
        if T and C and bool((x.amax(dim=(1, 2)).to(torch.int64) > _dev((1 << hb) - 1, dev, np.int64)).any()):
            raise KvcFormatError("codec 'quantize': symbol exceeds the bit width")
        if N:
            sc = _dev(scale, dev, np.float32)
            ze = _dev(zero, dev, np.float32) if zero is not None else sc
            _launch("dq_minmax", (_cdiv(N, BLOCK),), x, sc, ze, _dev(hb, dev, np.int32), out, N, T, C, stage.group, gshape[1] if stage.axis == "channel" else gshape[2],
                    AXIS_CHANNEL=stage.axis == "channel", SYMMETRIC=stage.symmetric, BLOCK=BLOCK)
    return _cast(out, spec.dtype)


def _check_step_symbols(x: torch.Tensor, bits: np.ndarray) -> None:
    """The CPU decode's check: every symbol of channel (h, c) is below 2**bits[h, c]."""
    if x.shape[1] and bool((x.amax(dim=1).to(torch.int32) >= (1 << _dev(bits, x.device, np.int32))).any()):
        raise KvcFormatError("codec 'quantize': symbol outside its channel's bit width")


def _cast(x: torch.Tensor, dtype: str) -> torch.Tensor:
    want = _TORCH[dtype]
    return x if x.dtype == want else x.to(want)


_MAT_CACHE: BoundedLRU[tuple[torch.Tensor, torch.Tensor]] = BoundedLRU(256, max_bytes=1 << 30)


def _digest(*arrays: np.ndarray) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(str((a.dtype, a.shape)).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _device_matrices(b: np.ndarray, m: np.ndarray, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(B transposed [H, K, D], mean [H, D]) float32 on ``dev``, cached by content."""
    key = (str(dev), _digest(b, m))
    hit = _MAT_CACHE.get(key)
    if hit is not None:
        return hit
    bt_d = _dev(np.swapaxes(b, 1, 2), dev, np.float32)
    m_d = _dev(m, dev, np.float32)
    _MAT_CACHE.put(key, (bt_d, m_d))
    return bt_d, m_d


def gpu_transform(stage: Any, y: torch.Tensor, side: dict, spec: Any, ctx: Any) -> torch.Tensor:
    from kvcodec.codecs.common import no_extra

    no_extra(side, "transform", set())
    H, T, D = spec.shape
    b, m = stage.matrices(H, D, ctx)  # CPU validation of the attachments, float32 [H, D, K], [H, D]
    K = b.shape[2]
    if tuple(y.shape) != (H, T, K) or y.dtype != torch.float32:
        raise KvcFormatError(f"codec 'transform': got {str(y.dtype).removeprefix('torch.')}{tuple(y.shape)}, expected float32{(H, T, K)}")
    dev = y.device
    bt_d, m_d = _device_matrices(b, m, dev)
    out = torch.empty((H, T, D), dtype=_TORCH[spec.dtype], device=dev)
    if H * T * D:
        BT, BD = 32, 64
        _launch("inv_transform", (H, _cdiv(T, BT), _cdiv(D, BD)), y.contiguous(), bt_d, m_d, out, T, K, D, BT=BT, BD=BD)
    return out


def gpu_tokenscale(stage: Any, y: torch.Tensor, side: dict, spec: Any, ctx: Any) -> torch.Tensor:
    """x = y * mult[class[t]]: one float32 multiply per element (exact on any device, no fusion possible)."""
    H, T, C = spec.shape
    if tuple(y.shape) != (H, T, C) or y.dtype != torch.float32:
        raise KvcFormatError(f"codec 'tokenscale': got {str(y.dtype).removeprefix('torch.')}{tuple(y.shape)}, expected float32{spec.shape}")
    m = _dev(stage.multipliers(side, T), y.device)
    return _cast(y * m[None, :, None], spec.dtype)


def gpu_keep(stage: Any, x: torch.Tensor, side: dict, spec: Any, ctx: Any) -> torch.Tensor:
    H, T, D = spec.shape
    s, r = stage.counts(T)
    kept = stage.kept_side(side, spec)
    if tuple(x.shape) != (H, T - s - r, D):
        raise KvcFormatError(f"codec 'keep': got {tuple(x.shape)}, expected {(H, T - s - r, D)}")
    k32 = _dev(kept, x.device).to(torch.float32)
    out = torch.cat([k32[:, :s], x.to(torch.float32), k32[:, s:]], dim=1)
    return _cast(out, spec.dtype)


_ROPE_CACHE: BoundedLRU[tuple[np.ndarray, torch.Tensor, torch.Tensor]] = BoundedLRU(64, max_bytes=1 << 30)


def _device_rope_tables(stage: Any, H: int, T: int, ctx: Any, dev: torch.device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(cos, sin, head stride) float32 on ``dev``, [1 or H, T, dim]: the CPU decoders' cached tables
    (:func:`kvcodec.decode.cpu.fused.rope_tables_cached`), copied once per device."""
    from kvcodec.decode.cpu.fused import rope_tables_cached
    from kvcodec.codecs.rope_tables import positions_for

    cos, sin = rope_tables_cached(positions_for(ctx.positions, ctx.layer, H, T, ctx.token_start), stage.theta, stage.dim)
    key = (str(dev), id(cos))
    hit = _ROPE_CACHE.get(key)
    if hit is None or hit[0] is not cos:
        hit = (cos, _dev(cos, dev), _dev(sin, dev))
        _ROPE_CACHE.put(key, hit)
    return hit[1], hit[2], 0 if cos.shape[0] == 1 else T * stage.dim


def gpu_rope(stage: Any, y: torch.Tensor, side: dict, spec: Any, ctx: Any) -> torch.Tensor:
    from kvcodec.codecs.common import no_extra

    no_extra(side, "rope", set())
    H, T, D = spec.shape
    if tuple(y.shape) != (H, T, D) or y.dtype != torch.float32:
        raise KvcFormatError(f"codec 'rope': got {str(y.dtype).removeprefix('torch.')}{tuple(y.shape)}, expected float32{spec.shape}")
    dev = y.device
    cos_d, sin_d, hs = _device_rope_tables(stage, H, T, ctx, dev)
    if stage.dim > D:
        raise KvcFormatError(f"codec 'rope': dim {stage.dim} exceeds {D} channels")
    out = torch.empty((H, T, D), dtype=_TORCH[spec.dtype], device=dev)
    N = H * T * D
    if N:
        _launch("rope", (_cdiv(N, BLOCK),), y.contiguous(), cos_d, sin_d, out, N, T, D, stage.dim, stage.dim // 2, hs, BLOCK=BLOCK)
    return out


# stage name -> fn(stage, x: torch.Tensor, side, spec, ctx) -> torch.Tensor (or NotImplemented for a config it lacks)
GPU_STAGES: dict[str, Any] = {"quantize": gpu_quantize, "tokenscale": gpu_tokenscale, "transform": gpu_transform,
                              "keep": gpu_keep, "rope": gpu_rope}


# --------------------------------------------------------------------------- the fused chain


def fused_decode(chain: Any, sym: torch.Tensor, sides: list[dict], specs: list[Any], spec: Any, ctx: Any,
                 dst: torch.Tensor | None = None, token_start: int = 0, block_table: torch.Tensor | None = None) -> torch.Tensor:
    """Inverse stages of a :class:`kvcodec.decode.chain.TransformChain` in one kernel launch.

    ``sym``: the rANS symbols uint8 (H, Tc, K) on the device; ``sides``/``specs``: the pipeline's
    side data and stage input specs; ``spec``: the chunk's (H, T, D). Side data is validated on the
    host first, in the CPU decode's stage order and with its messages. Writes into ``dst`` (HF
    (1, H, T_cap, D) from ``token_start``, or a paged (num_blocks, block_size, H, D) cache through
    ``block_table``; float16, bfloat16 or float32, each value = the chunk's decoded value cast to
    ``dst.dtype``) or, without ``dst``, returns a new (H, T, D) tensor of the chunk dtype.
    """
    H, T, D = spec.shape
    ch = chain
    ix = ch.index()
    i_q = ix["quantize"]
    qspec = specs[i_q]
    Tc, K = qspec.shape[1], qspec.shape[2]
    if tuple(sym.shape) != (H, Tc, K) or sym.dtype != torch.uint8:
        raise KvcFormatError(f"codec 'quantize': got {str(sym.dtype).removeprefix('torch.')}{tuple(sym.shape)}, expected uint8{qspec.shape}")
    dev = sym.device
    # validation in the CPU decode order: quantize, tokenscale, transform, keep, rope
    step, bits = ch.quantize.step_side(sides[i_q], qspec)
    _check_step_symbols(sym, bits)
    ts = _dev(ch.tokenscale.multipliers(sides[ix["tokenscale"]], Tc), dev) if ch.tokenscale is not None else None
    from kvcodec.codecs.common import no_extra

    no_extra(sides[ix["transform"]], "transform", set())
    b, m = ch.transform.matrices(H, D, ctx)
    if b.shape[2] != K:
        raise KvcFormatError(f"codec 'transform': got float32{(H, Tc, K)}, expected float32{(H, Tc, b.shape[2])}")
    bt_d, m_d = _device_matrices(b, m, dev)
    ns = nr = 0
    kept = None
    if ch.keep is not None:
        ns, nr = ch.keep.counts(T)
        kept = _dev(ch.keep.kept_side(sides[ix["keep"]], specs[ix["keep"]]), dev, np.float32)
    dim = 0
    cos_d = sin_d = None
    hs = 0
    if ch.rope is not None:
        no_extra(sides[ix["rope"]], "rope", set())
        cos_d, sin_d, hs = _device_rope_tables(ch.rope, H, T, ctx, dev)
        if ch.rope.dim > D:
            raise KvcFormatError(f"codec 'rope': dim {ch.rope.dim} exceeds {D} channels")
        dim = ch.rope.dim
    out = None
    if dst is None:
        out = dst = torch.empty((1, H, T, D), dtype=_TORCH[spec.dtype], device=dev)
        token_start = 0
    paged = block_table is not None
    blk, strides = _layout(dst, H, T, D, token_start, block_table, dev)
    if H * T * D:
        f32 = _dev(np.zeros(1, np.float32), dev)
        _launch("fused_inverse", (H, _cdiv(T, FUSED_BT)), sym.contiguous(), _dev(step, dev, np.float32),
                ts if ts is not None else f32, bt_d, m_d, kept if kept is not None else f32,
                cos_d if cos_d is not None else f32, sin_d if sin_d is not None else f32, dst, blk,
                T, K, D, ns, nr, dim, dim // 2, hs, token_start, *strides,
                HAS_TS=ts is not None, ROPE=dim > 0, OUT16=spec.dtype == "float16", PAGED=paged,
                BF16=dst.dtype == torch.bfloat16, BT=FUSED_BT, BD=triton.next_power_of_2(D))
    return out[0] if out is not None else dst


# --------------------------------------------------------------------------- output layouts


def _layout(dst: torch.Tensor, H: int, T: int, D: int, token_start: int, block_table: torch.Tensor | None,
            device: torch.device) -> tuple[torch.Tensor, tuple[int, int, int, int, int]]:
    """Validate a destination for tokens token_start.. of an (H, T, D) chunk; return the block table
    (int32 on ``device``; a dummy for HF) and the kernels' (s_h, s_t, s_d, block_size, s_blk).
    HF: dst (1, H, T_cap, D), any strides. Paged (``block_table`` given): dst (num_blocks, block_size, H, D)."""
    if block_table is None:
        if dst.dim() != 4 or dst.shape[0] != 1 or dst.shape[1] != H or dst.shape[3] != D or token_start < 0 or token_start + T > dst.shape[2]:
            raise KvcInputError(f"HF destination {tuple(dst.shape)} cannot hold ({H}, {token_start}+{T}, {D})")
        return _dev(np.zeros(1, np.int32), device), (dst.stride(1), dst.stride(2), dst.stride(3), 1, 0)
    nb, bs, ch, cd = dst.shape
    if ch != H or cd != D:
        raise KvcInputError(f"paged cache {tuple(dst.shape)} does not hold {H} heads x {D} channels")
    if token_start < 0 or _cdiv(token_start + T, bs) > block_table.numel():
        raise KvcInputError("block table too short for the tokens written")
    blk = block_table.to(device=device, dtype=torch.int32).contiguous()
    used = blk[token_start // bs : _cdiv(token_start + T, bs)]
    if used.numel() and (int(used.min()) < 0 or int(used.max()) >= nb):
        raise KvcInputError("block table entry outside the paged cache")
    return blk, (dst.stride(2), dst.stride(1), dst.stride(3), bs, dst.stride(0))


def store_hf(x: torch.Tensor, dst: torch.Tensor, token_start: int = 0) -> None:
    """dst[0, :, token_start:token_start+T, :] = x cast to dst.dtype (dst: (1, H, T_cap, D), any strides)."""
    _store(x, dst, token_start, None)


def store_paged(x: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor, token_start: int = 0) -> None:
    """Write x (H, T, D) for tokens token_start.. into cache (num_blocks, block_size, H, D):
    token pos goes to cache[block_table[pos // block_size], pos % block_size]."""
    _store(x, cache, token_start, block_table)


def _store(x: torch.Tensor, dst: torch.Tensor, token_start: int, block_table: torch.Tensor | None) -> None:
    H, T, D = x.shape
    blk, strides = _layout(dst, H, T, D, token_start, block_table, x.device)
    N = H * T * D
    if N:
        _launch("store", (_cdiv(N, BLOCK),), x.contiguous(), dst, blk, N, T, D, token_start, *strides,
                PAGED=block_table is not None, BF16=dst.dtype == torch.bfloat16, BLOCK=BLOCK)
