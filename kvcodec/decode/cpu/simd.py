"""Explicit 16-lane vector steps for the fused CPU decoder (numba intrinsics emitting LLVM IR).

Why intrinsics: the decoder's two hot loops need vector instructions that
numba's auto-vectorizer never emits -- a table gather and an expand-load of
renormalisation words for 16 rANS lanes at once, and register-resident
accumulators for the inverse transform. LLVM lowers every operation used here
(``masked.gather``, ``masked.expandload``, ``masked.compressstore``, vector
integer and ``fmul``/``fadd`` ops) on any target: to single instructions with
AVX-512 (``vpgatherqd``, ``vpexpandd``, ``vcompressps``), to shorter vectors or
scalar code elsewhere (tested with numba's ``generic`` and ``haswell`` targets). Without
AVX-512 the rANS step does not use the expand-load (LLVM would branch per lane on its
mask) but an all-lanes gather at prefix-summed offsets, the same words. The results are the same everywhere:

* integer steps are exact;
* every float op is a single IEEE-754 binary32 operation with no fast-math flags,
  so LLVM neither fuses a multiply-add nor reassociates: each product and each
  sum rounds exactly as spec/codec-v1.md says, in its order (k ascending);
* the cast to float16 is round-to-nearest-even in integer ops (:func:`_f16_bits`),
  the spec's cast, with no dependence on F16C.

numba's on-disk cache of the kernels that call these intrinsics is keyed on
the contents of the calling module (kvcodec/decode/cpu/fused.py), not on this
one: after editing this file, update ``SIMD_SHA256`` there (the test suite
checks the pin), or a stale kernel would load from the cache.

Skipping zero terms in the transform is exact: ``acc`` starts at +0 and
can never become -0 (x + y is -0 in round-to-nearest only if both are -0),
so ``acc + y * b`` with ``y = 0`` and a finite ``b`` (bases are validated
finite), or with ``b = ±0`` and a finite ``y``, leaves ``acc`` unchanged: a row skips
its zero coefficients, and a block-diagonal basis's block skips the columns that are
zero on it (:mod:`kvcodec.codecs.blocks`).
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from kvcodec.codecs.blocks import channel_blocks

__all__ = ["rans16", "row", "f16_bits16"]

W = 16
_I1, _I16, _I32, _I64 = ir.IntType(1), ir.IntType(16), ir.IntType(32), ir.IntType(64)
_F32 = ir.FloatType()


def _v(t: ir.Type, n: int = W) -> ir.VectorType:
    return ir.VectorType(t, n)


def _splat(b: ir.IRBuilder, val: ir.Value, n: int = W) -> ir.Value:
    vt = _v(val.type, n)
    one = b.insert_element(ir.Constant(vt, ir.Undefined), val, _I32(0))
    return b.shuffle_vector(one, ir.Constant(vt, ir.Undefined), ir.Constant(_v(_I32, n), [0] * n))


def _ci(val: int, t: ir.IntType = _I32) -> ir.Constant:
    return ir.Constant(_v(t), [val] * W)


def _decl(b: ir.IRBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    f = b.module.globals.get(name)
    return f if f is not None else ir.Function(b.module, ir.FunctionType(ret, args), name=name)


def _ptr(context, b: ir.IRBuilder, aty, aval) -> ir.Value:
    return context.make_array(aty)(context, b, aval).data


def _load(b: ir.IRBuilder, ptr: ir.Value, off: ir.Value, vt: ir.VectorType) -> ir.Value:
    return b.load(b.bitcast(b.gep(ptr, [off]), vt.as_pointer()), align=4)


def _store(b: ir.IRBuilder, val: ir.Value, ptr: ir.Value, off: ir.Value) -> None:
    b.store(val, b.bitcast(b.gep(ptr, [off]), val.type.as_pointer()), align=2)


def _f16_bits(b: ir.IRBuilder, x: ir.Value) -> ir.Value:
    """<16 x i16> float16 bits of <16 x float> ``x``, round to nearest even, exactly numpy's
    ``astype(float16)`` (overflow to inf, subnormals, NaN keeps its top payload bits and stays NaN),
    in integer ops only. Not ``fptrunc``: without F16C LLVM lowers that to a runtime call
    (``__truncsfhf2``) the JIT cannot resolve."""
    u = b.bitcast(x, _v(_I32))
    sign = b.and_(b.lshr(u, _ci(16)), _ci(0x8000))
    a = b.and_(u, _ci(0x7FFFFFFF))
    # NaN: 0x7C00 + top mantissa bits, never 0x7C00 itself
    nan = b.add(_ci(0x7C00), b.lshr(b.and_(a, _ci(0x7FFFFF)), _ci(13)))
    nan = b.select(b.icmp_unsigned("==", nan, _ci(0x7C00)), _ci(0x7C01), nan)
    # normal half: rebias the exponent, round the 13 dropped mantissa bits to nearest even
    normal = b.lshr(b.add(b.add(b.sub(a, _ci(0x38000000)), _ci(0xFFF)), b.and_(b.lshr(a, _ci(13)), _ci(1))), _ci(13))
    # |x| < 2**-14: round(m * 2**(e - 126)) with the implicit bit, shift s = 126 - e clamped to 25 (-> 0)
    e = b.lshr(a, _ci(23))
    m = b.or_(b.and_(a, _ci(0x7FFFFF)), _ci(0x800000))
    sh = b.sub(_ci(126), e)
    sh = b.select(b.icmp_unsigned(">", sh, _ci(25)), _ci(25), sh)
    half = b.sub(b.shl(_ci(1), b.sub(sh, _ci(1))), _ci(1))
    sub = b.lshr(b.add(b.add(m, half), b.and_(b.lshr(m, sh), _ci(1))), sh)
    r = b.select(b.icmp_unsigned(">=", a, _ci(0x38800000)), normal, sub)
    r = b.select(b.icmp_unsigned(">=", a, _ci(0x477FF000)), _ci(0x7C00), r)
    r = b.select(b.icmp_unsigned(">", a, _ci(0x7F800000)), nan, r)
    return b.trunc(b.or_(sign, r), _v(_I16))


def _f16_to_f32(b: ir.IRBuilder, h: ir.Value, f16c: bool) -> ir.Value:
    """<16 x float> of <16 x i16> float16 bits: exact (every float16 is a float32). With F16C one
    ``vcvtph2ps``; without it LLVM would call a runtime helper the JIT cannot resolve, so integer
    ops: normal and inf/NaN by rebiasing the exponent, subnormals as ``mantissa * 2**-24``."""
    if f16c:
        return b.fpext(b.bitcast(h, _v(ir.HalfType())), _v(_F32))
    u = b.zext(h, _v(_I32))
    sign = b.shl(b.and_(u, _ci(0x8000)), _ci(16))
    a = b.and_(u, _ci(0x7FFF))
    normal = b.add(b.shl(a, _ci(13)), _ci((127 - 15) << 23))
    special = b.or_(_ci(0x7F800000), b.shl(b.and_(a, _ci(0x3FF)), _ci(13)))
    sub = b.bitcast(b.fmul(b.sitofp(a, _v(_F32)), ir.Constant(_v(_F32), [2.0 ** -24] * W)), _v(_I32))
    r = b.select(b.icmp_unsigned(">=", a, _ci(0x7C00)), special, normal)
    r = b.select(b.icmp_unsigned("<", a, _ci(0x400)), sub, r)
    return b.bitcast(b.or_(sign, r), _v(_F32))


@intrinsic
def f16_bits16(typingctx, x, xoff, out, ooff):
    """out[ooff:ooff+16] = float16 bits of x[xoff:xoff+16] (float32), as the row writer rounds them."""
    sig = types.void(x, xoff, out, ooff)

    def codegen(context, b, signature, args):
        v = _load(b, _ptr(context, b, signature.args[0], args[0]), args[1], _v(_F32))
        _store(b, _f16_bits(b, v), _ptr(context, b, signature.args[2], args[2]), args[3])
        return context.get_dummy_value()

    return sig, codegen


def _popcount(b: ir.IRBuilder, mask: ir.Value) -> ir.Value:
    ctpop = _decl(b, "llvm.ctpop.i16", _I16, [_I16])
    return b.zext(b.call(ctpop, [b.bitcast(mask, _I16)]), _I64)


@intrinsic
def rans16(typingctx, st, lane0, tab, words, p, stepv, limv, voff, bad, y, yoff, g, ystride):
    """Decode symbols ``i0 .. i0 + 15`` of one rANS context (lanes ``lane0 .. lane0 + 15`` of
    ``st``, uint32[32]); returns the new word position.

    ``tab`` (uint32[4096]) packs ``sym | (freq - 1) << 8 | (slot - cum) << 20``; ``words`` (the
    stream's 16-bit words, widened to uint32) must hold 16 readable entries past ``p``. Each lane: ``x = freq * (x >> 12) + slot - cum``; lanes with
    ``x < 2**16`` take the next words in lane order (``x = x << 16 | word``). The value
    ``f32(unzigzag(sym)) * stepv[voff + k]`` goes to ``y`` (float32, rows of ``ystride``):
    for ``g >= 16`` lanes ``0..15`` at ``y[yoff + k]``, for ``g`` in {1, 2, 4, 8} lane ``k`` at
    ``y[yoff + (k // g) * ystride + k % g]``. ``bad`` (int32[16]) ``|= sym >= limv[voff + k]``.
    """
    sig = types.int64(st, lane0, tab, words, p, stepv, limv, voff, bad, y, yoff, g, ystride)

    def codegen(context, b, signature, args):
        a_st, a_lane0, a_tab, a_words, a_p, a_stepv, a_limv, a_voff, a_bad, a_y, a_yoff, a_g, a_ystride = args
        ty = signature.args
        stp = _ptr(context, b, ty[0], a_st)
        x = _load(b, stp, a_lane0, _v(_I32))
        slot = b.zext(b.and_(x, _ci(4095)), _v(_I64))
        tabp = _ptr(context, b, ty[2], a_tab)
        addr = b.add(_splat(b, b.ptrtoint(tabp, _I64)), b.shl(slot, _ci(2, _I64)))
        pty = _v(ir.PointerType(_I32))
        gather = _decl(b, "llvm.masked.gather.v16i32.v16p0", _v(_I32), [pty, _I32, _v(_I1), _v(_I32)])
        e = b.call(gather, [b.inttoptr(addr, pty), _I32(4), ir.Constant(_v(_I1), [1] * W), ir.Constant(_v(_I32), ir.Undefined)])
        sym = b.and_(e, _ci(0xFF))
        freq = b.add(b.and_(b.lshr(e, _ci(8)), _ci(0xFFF)), _ci(1))
        x2 = b.add(b.mul(freq, b.lshr(x, _ci(12))), b.lshr(e, _ci(20)))
        need = b.icmp_unsigned("<", x2, _ci(1 << 16))
        wp = b.gep(_ptr(context, b, ty[3], a_words), [a_p])
        if "+avx512f" in getattr(context.codegen(), "_tm_features", ""):
            # words widened to uint32 by the caller: AVX-512F expands 32-bit lanes in one instruction
            # (vpexpandd); a 16-bit expand needs VBMI2
            expand = _decl(b, "llvm.masked.expandload.v16i32", _v(_I32), [ir.PointerType(_I32), _v(_I1), _v(_I32)])
            w = b.call(expand, [wp, need, ir.Constant(_v(_I32), [0] * W)])
        else:
            # Without AVX-512 LLVM lowers an expand (and any gather whose mask is not constant) to one
            # branch per lane on the mask bit, mispredicted ~a third of the time: that was half of the
            # rANS time on an AVX2 Zen 3. The same words without branches: lane k reads word p +
            # (needing lanes before k) -- an exclusive prefix sum in four shift-and-add steps -- by an
            # all-lanes gather (the caller pads ``words`` with 16 readable words), and keeps it where needed.
            ni = b.zext(need, _v(_I32))
            inc = ni
            for sh in (1, 2, 4, 8):
                moved = b.shuffle_vector(inc, ir.Constant(_v(_I32), [0] * W),
                                         ir.Constant(_v(_I32), [k - sh if k >= sh else W for k in range(W)]))
                inc = b.add(inc, moved)
            waddr = b.add(_splat(b, b.ptrtoint(wp, _I64)), b.shl(b.zext(b.sub(inc, ni), _v(_I64)), _ci(2, _I64)))
            w = b.call(gather, [b.inttoptr(waddr, pty), _I32(4), ir.Constant(_v(_I1), [1] * W), ir.Constant(_v(_I32), [0] * W)])
        x3 = b.select(need, b.or_(b.shl(x2, _ci(16)), w), x2)
        b.store(x3, b.bitcast(b.gep(stp, [a_lane0]), _v(_I32).as_pointer()), align=4)
        # dequantize: f32(zigzag^-1(sym)) * step, one rounding
        q = b.xor(b.lshr(sym, _ci(1)), b.sub(_ci(0), b.and_(sym, _ci(1))))
        v = b.fmul(b.sitofp(q, _v(_F32)), _load(b, _ptr(context, b, ty[5], a_stepv), a_voff, _v(_F32)))
        lim = _load(b, _ptr(context, b, ty[6], a_limv), a_voff, _v(_I32))
        badp = _ptr(context, b, ty[8], a_bad)
        old = _load(b, badp, _I64(0), _v(_I32))
        _store(b, b.or_(old, b.zext(b.icmp_unsigned(">=", sym, lim), _v(_I32))), badp, _I64(0))
        yp = _ptr(context, b, ty[9], a_y)
        with b.if_else(b.icmp_signed(">=", a_g, _I64(W))) as (wide, narrow):
            with wide:
                _store(b, v, yp, a_yoff)
            with narrow:
                for gs in (8, 4, 2, 1):
                    with b.if_then(b.icmp_signed("==", a_g, _I64(gs))):
                        for piece in range(W // gs):
                            part = b.shuffle_vector(v, v, ir.Constant(_v(_I32, gs), list(range(piece * gs, piece * gs + gs))))
                            _store(b, part, yp, b.add(a_yoff, b.mul(a_ystride, _I64(piece))))
        return b.add(a_p, _popcount(b, need))

    return sig, codegen


def _emit_row(nb: int, context, b: ir.IRBuilder, ty, args) -> None:
    """IR of one token row for ``D = 16 * nb`` (see :func:`row`)."""
    D = W * nb
    (a_y, a_yoff, a_kp, a_kc, a_ts, a_idx, a_val, a_bt, a_bh, a_half, a_btoff, a_mean, a_moff, a_rope, a_cos, a_sin,
     a_csoff, a_out, a_ooff, a_dense8, a_plist, a_ploff, a_pcnt, a_pcoff) = args
    yp, idxp, valp = (_ptr(context, b, ty[i], a) for i, a in ((0, a_y), (5, a_idx), (6, a_val)))
    cf = _decl(b, "llvm.masked.compressstore.v16f32", ir.VoidType(), [_v(_F32), ir.PointerType(_F32), _v(_I1)])
    ci = _decl(b, "llvm.masked.compressstore.v16i32", ir.VoidType(), [_v(_I32), ir.PointerType(_I32), _v(_I1)])
    tsv = _splat(b, a_ts)
    zero = ir.Constant(_v(_F32), [0.0] * W)
    nblk = b.sdiv(a_kp, _I64(W))
    accs = [cgutils.alloca_once(b, _v(_F32)) for _ in range(nb)]
    for acc in accs:
        b.store(zero, acc)
    btp, bhp = _ptr(context, b, ty[7], a_bt), _ptr(context, b, ty[8], a_bh)
    f16c = "+f16c" in getattr(context.codegen(), "_tm_features", "")

    def accumulate(k: ir.Value, yv: ir.Value, use_half: bool, blocks: range = range(nb)) -> None:
        base = b.add(a_btoff, b.mul(k, _I64(D)))
        for j in blocks:
            off = b.add(base, _I64(W * j))
            if use_half:
                bv = _f16_to_f32(b, _load(b, bhp, off, _v(_I16)), f16c)
            else:
                bv = _load(b, btp, off, _v(_F32))
            b.store(b.fadd(b.load(accs[j]), b.fmul(yv, bv)), accs[j])

    def by_blocks() -> None:
        """Block by block: block j's accumulators take, k ascending, the coefficients whose basis
        column is nonzero on it (``plist[ploff + j * kc:]``, ``pcnt[pcoff + j]`` of them), zeros
        included; every other coefficient would add an exact zero there."""
        plp, pcp = _ptr(context, b, ty[20], a_plist), _ptr(context, b, ty[22], a_pcnt)
        with b.if_else(b.icmp_signed("!=", a_half, _I64(0))) as (half, single):
            for use_half, blk in ((True, half), (False, single)):
                with blk:
                    for j, (c0, c1) in enumerate(channel_blocks(D)):
                        base = b.add(a_ploff, b.mul(_I64(j), a_kc))
                        with cgutils.for_range(b, b.load(b.gep(pcp, [b.add(a_pcoff, _I64(j))]))) as loop:
                            k = b.zext(b.load(b.gep(plp, [b.add(base, loop.index)])), _I64)
                            y1 = b.fmul(b.load(b.gep(yp, [b.add(a_yoff, k)])), a_ts)
                            accumulate(k, _splat(b, y1), use_half, range(c0 // W, c1 // W))

    def flat() -> None:
        # dense rows (most coefficients nonzero) skip the compaction: its compress-stores, and the
        # loads that read them straight back, cost more than multiplying the few zeros
        cnt_ptr = cgutils.alloca_once(b, _I64)
        b.store(_I64(0), cnt_ptr)
        with cgutils.for_range(b, nblk) as loop:
            v = b.fmul(_load(b, yp, b.add(a_yoff, b.mul(loop.index, _I64(W))), _v(_F32)), tsv)
            b.store(b.add(b.load(cnt_ptr), _popcount(b, b.fcmp_unordered("!=", v, zero))), cnt_ptr)
        dense = b.icmp_signed(">=", b.mul(b.load(cnt_ptr), _I64(8)), b.mul(a_kc, a_dense8))
        n_ptr = cgutils.alloca_once(b, _I64)
        b.store(_I64(0), n_ptr)
        with b.if_then(b.not_(dense)), cgutils.for_range(b, nblk) as loop:
            off = b.mul(loop.index, _I64(W))
            v = b.fmul(_load(b, yp, b.add(a_yoff, off), _v(_F32)), tsv)
            nz = b.fcmp_unordered("!=", v, zero)
            n = b.load(n_ptr)
            b.call(cf, [v, b.gep(valp, [n]), nz])
            ks = b.add(ir.Constant(_v(_I32), list(range(W))), _splat(b, b.trunc(off, _I32)))
            b.call(ci, [ks, b.gep(idxp, [n]), nz])
            b.store(b.add(n, _popcount(b, nz)), n_ptr)
        with b.if_else(b.icmp_signed("!=", a_half, _I64(0))) as (half, single):
            for use_half, blk in ((True, half), (False, single)):
                with blk, b.if_else(dense) as (all_k, nonzero_k):
                    # the row's kc coefficients (not the padded kp: B has kc rows), zeros included: exact,
                    # see the module doc
                    with all_k, cgutils.for_range(b, a_kc) as loop:
                        y1 = b.fmul(b.load(b.gep(yp, [b.add(a_yoff, loop.index)])), a_ts)
                        accumulate(loop.index, _splat(b, y1), use_half)
                    with nonzero_k, cgutils.for_range(b, b.load(n_ptr)) as loop:
                        k = b.zext(b.load(b.gep(idxp, [loop.index])), _I64)
                        accumulate(k, _splat(b, b.load(b.gep(valp, [loop.index]))), use_half)
    if len(channel_blocks(D)) == 1:
        flat()
    else:  # pcnt[pcoff] < 0: the head's basis has no block structure to skip
        first = b.load(b.gep(_ptr(context, b, ty[22], a_pcnt), [a_pcoff]))
        with b.if_else(b.icmp_signed(">=", first, _I64(0))) as (blocked, whole):
            with blocked:
                by_blocks()
            with whole:
                flat()
    meanp = _ptr(context, b, ty[11], a_mean)
    xs = [b.fadd(b.load(accs[j]), _load(b, meanp, b.add(a_moff, _I64(W * j)), _v(_F32))) for j in range(nb)]
    for j in range(nb):
        b.store(xs[j], accs[j])
    if nb % 2 == 0:  # odd nb (head_dim 80): D/2 is mid-vector, so the caller rotates in its scalar loop
        with b.if_then(b.icmp_signed("!=", a_rope, _I64(0))):
            cp, sp = _ptr(context, b, ty[14], a_cos), _ptr(context, b, ty[15], a_sin)
            h = nb // 2
            for j in range(nb):
                c = _load(b, cp, b.add(a_csoff, _I64(W * j)), _v(_F32))
                s = _load(b, sp, b.add(a_csoff, _I64(W * j)), _v(_F32))
                other = b.fneg(xs[j + h]) if j < h else xs[j - h]
                b.store(b.fadd(b.fmul(xs[j], c), b.fmul(other, s)), accs[j])
    outp = _ptr(context, b, ty[17], a_out)
    for j in range(nb):
        r = b.load(accs[j])
        if ty[17].dtype == types.uint16:
            r = _f16_bits(b, r)
        _store(b, r, outp, b.add(a_ooff, _I64(W * j)))


#: Supported row widths in 16-lane blocks: head_dim 32, 64, 80, 96, 128, 256 (every size real models use).
ROW_BLOCKS = (2, 4, 5, 6, 8, 16)


def _emit_dispatch(nbs: list[int], context, b: ir.IRBuilder, a_nb: ir.Value, ty, rest) -> None:
    """``if nb == nbs[0]: row(nbs[0]) elif ...``; the last entry is the fall-through (callers pass only
    supported widths). Each width is its own straight-line IR: the accumulators stay in registers."""
    if len(nbs) == 1:
        _emit_row(nbs[0], context, b, ty, rest)
        return
    with b.if_else(b.icmp_signed("==", a_nb, _I64(nbs[0]))) as (hit, other):
        with hit:
            _emit_row(nbs[0], context, b, ty, rest)
        with other:
            _emit_dispatch(nbs[1:], context, b, a_nb, ty, rest)


@intrinsic
def row(typingctx, nb, y, yoff, kp, kc, ts, idx, val, bt, bh, half, btoff, mean, moff, rope, cos, sin, csoff, out, ooff, dense8,
        plist, ploff, pcnt, pcoff):
    """One token row of ``D = 16 * nb`` values (``nb`` in :data:`ROW_BLOCKS`: head_dim 32 to 256).

    The row's coefficients are ``y[yoff + k] * ts`` for ``k < kc`` (B has ``kc`` rows; columns
    ``kc <= k < kp``, ``kp`` a multiple of 16, must be 0). When at least ``dense8`` eighths of them
    are nonzero, all ``kc`` go through the sum in order; otherwise the nonzero ones are compacted into
    ``idx``/``val`` first. With ``pcnt[pcoff] >= 0`` (a head of several channel blocks whose basis is
    block-structured, :func:`kvcodec.codecs.blocks.channel_blocks`) instead each block ``j`` sums, in
    order, the ``pcnt[pcoff + j]`` coefficients listed at ``plist[ploff + j * kc:]`` (the columns nonzero
    on that block, zeros included). ``acc = acc + y_k * B[k]`` over them (B rows at ``bt[btoff + k * D:]``, float32,
    or with ``half`` != 0 at ``bh[btoff + k * D:]``, the same values as float16 bits: half the bytes
    to stream from L2 per coefficient, widened exactly),
    k ascending, product and sum rounded separately, then ``+ mean[moff:]``; with ``rope`` != 0
    (RoPE over all ``D``, tables at ``cos/sin[csoff:]``; only for even ``nb``, where ``D/2`` falls on a
    vector boundary -- the caller rotates odd widths such as 80 in its scalar loop) ``x[d] * cos + (-x[d + D/2]) * sin`` /
    ``x[d] * cos + x[d - D/2] * sin``; written to ``out[ooff:]`` as float16 bits (uint16 ``out``)
    or float32. One intrinsic for all sizes: a numba-level dispatch function would take
    array references (atomic refcounts) on every row.
    """
    sig = types.void(nb, y, yoff, kp, kc, ts, idx, val, bt, bh, half, btoff, mean, moff, rope, cos, sin, csoff, out, ooff, dense8,
                     plist, ploff, pcnt, pcoff)

    def codegen(context, b, signature, args):
        a_nb, rest, ty = args[0], args[1:], signature.args[1:]
        _emit_dispatch(list(ROW_BLOCKS), context, b, a_nb, ty, rest)
        return context.get_dummy_value()

    return sig, codegen
