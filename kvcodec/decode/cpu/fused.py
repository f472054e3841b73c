"""Fused CPU chunk decoder for the transform-codec pipelines (bit-identical fast path).

The ``numba-fused`` backend of the decoder registry (kvcodec/decode/registry.py): :func:`supports`
says statically which pipelines and chunk specs it decodes, :func:`decode` decodes them and
raises on anything malformed; the registry then runs the reference ``Pipeline.decode`` -- the
normative definition, spec/codec-v1.md -- which raises its own, exact error (or, if it
decodes the chunk, reports the fused decoder's failure as a bug).

Supported (array stages in this order, each optional unless noted)::

    [rope] -> [keep] -> [tokenscale] -> transform (required) -> quantize(step) (required) -> rans

(``quantize`` v1, or v2's 16-bit codes in two byte planes, which the kernel joins after rANS)

and, for the lossless preset, ``raw -> [shuffle] -> zstd``.

Further limits of the fused path: head_dim in :data:`HEAD_DIMS` (32, 64, 80, 96, 128,
256: every size real models use); rANS channel groups of 1, 2, 4, 8 or a multiple of
16. Anything else takes the generic decode. With head_dim 80 the RoPE rotation takes
the scalar loop (its half, 40, is not on a 16-lane boundary).

One numba kernel (``nogil``: the reader's prefetch thread overlaps the model)
decodes a whole chunk head by head, with the 16-lane vector steps of
:mod:`kvcodec.decode.cpu.simd`: rANS for 16 lanes at a time (table gather,
expand-load of the renormalisation words) -> zigzag -> dequant into per-head
coefficient rows; then per token row the coefficients (times the token's
scale; in a sparse row only the nonzero ones, compacted first, see
:data:`DENSE_OF_8`; with a block-diagonal basis, block by block only the columns
nonzero on that block, see :data:`BLOCKED_WORK`) go through the inverse transform, which accumulates
``acc = acc + y[k] * B[d, k]`` (B read as float16 when every value is one) over them, k ascending, product and sum rounded
separately, in vector registers, mean added last; RoPE with the cached float32
tables (``t1 = x*cos``, ``t2 = r*sin``, ``t1 + t2``) and the cast to float16
(IEEE round-to-nearest-even, in integer ops). Kept sink/recent rows and partial
RoPE take a scalar loop with the same float operations. No fastmath anywhere: LLVM then neither
contracts a multiply-add into an FMA nor reassociates, so every float32 op
rounds exactly as the spec says. Skipping zero coefficients is exact (see
:mod:`kvcodec.decode.cpu.simd`).
"""

from __future__ import annotations

import threading
from typing import Any, NamedTuple

import numpy as np
from numba import njit

from kvcodec.errors import KvcBackendError, KvcError, KvcFormatError
from kvcodec.lru import BoundedLRU, weak
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline, SideData
from kvcodec.codecs.blocks import channel_blocks
from kvcodec.decode.cpu.simd import ROW_BLOCKS, f16_bits16, rans16, row
from kvcodec.entropy.rans_kernels import slot_table

__all__ = ["supports", "decode", "rope_tables_cached", "f32_to_f16_bits", "HEAD_DIMS"]

_L = 1 << 16
_PROB_BITS = 12
_M = 1 << _PROB_BITS
_LANES = 32
#: sha256 of simd.py's bytes followed by blocks.py's (the intrinsics' code depends on both). numba
#: keys its on-disk cache of the kernel on this file's contents only (numba 0.68: a hash of the
#: source, not its mtime), so an edit of either must change this file too, or a stale kernel loads;
#: tests/decode/test_fastdecode.py checks the pin.
SIMD_SHA256 = "0f441620fa66ae6b7c639826387a3cb82ae7f8bf0241d76806b36d46edc2a9c6"

#: A token row takes the dense loop (every coefficient, no compaction) when at least this many
#: eighths of its coefficients are nonzero. Balanced rows are ~70 % nonzero at head_dim 64;
#: benchmarks/bench_dense_threshold.py (an interleaved A/B of 9 = never / 5 / 3 / 0 = always on
#: the kernel calls of real files and 2-bit synthetic heads) measured 5 best or tied everywhere.
DENSE_OF_8 = 5

#: A head of more than one channel block (:func:`kvcodec.codecs.blocks.channel_blocks`) decodes block
#: by block, every listed coefficient included, when that is at most this fraction of a whole row's
#: K x D multiply-adds: a whole row skips its zero coefficients, 30-50 % of them at the presets'
#: rates, so block-by-block pays only below that.
BLOCKED_WORK = 0.6

#: head_dims the fused kernel decodes (16-lane blocks of :data:`kvcodec.decode.cpu.simd.ROW_BLOCKS`).
HEAD_DIMS = tuple(16 * nb for nb in ROW_BLOCKS)


# --------------------------------------------------------------------------- kernels
@njit(cache=True, nogil=True)
def f32_to_f16_bits(x, out):  # pragma: no cover - numba
    """out (uint16) = float16 bits of x (float32), round-to-nearest-even; both 1-D. The row
    writer's conversion (:func:`kvcodec.decode.cpu.simd.f16_bits16`), 16 values at a time."""
    n = x.shape[0]
    n16 = n - n % 16
    for i in range(0, n16, 16):
        f16_bits16(x, i, out, i)
    if n16 < n:
        tx = np.zeros(16, dtype=np.float32)
        to = np.empty(16, dtype=np.uint16)
        tx[: n - n16] = x[n16:]
        f16_bits16(tx, 0, to, 0)
        out[n16:] = to[: n - n16]


@njit(cache=True, nogil=True)
def _decode_kernel(freqs, cums, table_of, bsyms, tabs, states, n_symbols, word_start, n_words, words, nwords, g,
                   stepf, lim, bt, bh, use_h, mean, kept, n_sink, n_recent, tscale, has_ts,
                   rope_dim, cos, sin, out16, out32, want16, ybuf, wide, hbuf, dense8, plist, pcnt):  # pragma: no cover - numba
    """Whole chunk. ``wide``: quantize v2, whose rANS contexts code 2K byte channels (high bytes
    of the K coefficient channels, then the low bytes): the high plane decodes into ``hbuf`` and
    the low plane into ``ybuf`` (as unzigzag(byte), step 1), then each code ``s = hi << 8 | lo``
    is checked against its bit width and dequantized in place, ``f32(unzigzag(s)) * step``.
    freqs / cums [n_tables, A], table_of [C, nb], bsyms: the stream's tables and which one codes each block of
    ``bsyms`` symbols of a context (rans v1: table c for all of context c); tabs: slot tables [n_tables, M] built once
    (rans v2's bank) or [1, M] rebuilt whenever the table changes (v1).
    words: uint32 (the stream's 16-bit words, widened) with 16 zero words after the ``nwords`` of the stream; g in
    {1, 2, 4, 8} or a multiple of 16; bt [H, K, D] (basis transposed, D in HEAD_DIMS) float32 and,
    with use_h, bh: the same values as float16 bits (the rows then read those), mean [H, D],
    kept f32 [H, s+r, D], tscale f32 [Tc] (has_ts), cos/sin f32 [Hr, T, rope_dim] (Hr = 1: shared),
    out16 uint16 [H, T, D] (want16) or out32 f32 [H, T, D], ybuf f32 scratch of >= Tc * ceil16(K).
    Returns 0 or an error code
    (1 overrun / underrun / final state, 2 symbol above its bit width)."""
    H, K, D = bt.shape
    T = out16.shape[1] if want16 else out32.shape[1]
    Tc = T - n_sink - n_recent
    kp = (K + 15) // 16 * 16
    nb = D // 16
    P = max(16, g)
    for t in range(Tc):  # ybuf: scratch coefficient rows of kp; columns K..kp must read 0
        for k in range(K, kp):
            ybuf[t * kp + k] = 0.0
    cache_all = tabs.shape[0] > 1 or freqs.shape[0] == 1
    if cache_all:
        for t in range(freqs.shape[0]):
            slot_table(freqs, cums, t, tabs[t])
    tab = tabs[0]
    cur = 0 if cache_all else -1
    ntb = table_of.shape[1]
    st = np.empty(_LANES, dtype=np.uint32)
    stepv = np.empty(P, dtype=np.float32)
    limv = np.empty(P, dtype=np.int32)
    bad = np.zeros(16, dtype=np.int32)
    idx = np.empty(kp, dtype=np.int32)
    val = np.empty(kp, dtype=np.float32)
    acc = np.empty(D, dtype=np.float32)
    rot = np.empty(D, dtype=np.float32)
    btf, bhf, meanf, cosf, sinf = bt.reshape(-1), bh.reshape(-1), mean.reshape(-1), cos.reshape(-1), sin.reshape(-1)
    o16, o32 = out16.reshape(-1), out32.reshape(-1)
    plf, pcf = plist.reshape(-1), pcnt.reshape(-1)
    nbk = pcnt.shape[1]
    nctx_h = (2 * K if wide else K) // g
    nplane = K // g  # contexts per byte plane (wide)
    vec_rope = 1 if rope_dim == D and nb % 2 == 0 else 0  # odd nb: D/2 mid-vector, scalar rotation
    half = rope_dim // 2
    one = np.float32(1.0)
    for h in range(H):
        for j in range(nctx_h):
            c = h * nctx_h + j
            hi_plane = wide and j < nplane
            yb = hbuf if hi_plane else ybuf
            for k in range(_LANES):
                st[k] = np.uint32(states[c, k])
            c0 = (j % nplane if wide else j) * g
            for k in range(P):
                stepv[k] = one if wide else stepf[h, c0 + k % g]
                limv[k] = 256 if wide else lim[h, c0 + k % g]
            n = n_symbols[c]
            p = word_start[c]
            pend = p + n_words[c]
            ng = n // 16
            # symbol i0 = 16 m sits at row i0 // g, column c0 + i0 % g; kept incrementally (no
            # division in the loop): g >= 16 walks the columns of a row, g < 16 takes 16 // g rows
            col = 0
            yrow = c0
            rstep = (16 // g) * kp if g < 16 else kp
            m = 0
            for b in range(ntb):  # blocks of bsyms symbols (a multiple of 32 when there are several)
                t = table_of[c, b]
                if cache_all:
                    tab = tabs[t]
                elif t != cur:
                    slot_table(freqs, cums, t, tab)
                    cur = t
                mend = min(ng, (b + 1) * bsyms // 16)
                while m < mend:
                    if p > nwords:
                        return 1
                    p = rans16(st, (m & 1) * 16, tab, words, p, stepv, limv, col, bad, yb, yrow + col, g, kp)
                    if g >= 16:
                        col += 16
                        if col == g:
                            col = 0
                            yrow += rstep
                    else:
                        yrow += rstep
                    m += 1
            for i in range(ng * 16, n):  # the last n % 16 symbols, one by one (all in the last block: tab is its table)
                lane = i & (_LANES - 1)
                x = np.int64(st[lane])
                e = np.int64(tab[x & (_M - 1)])
                sym = e & 0xFF
                x = (((e >> 8) & 0xFFF) + 1) * (x >> _PROB_BITS) + (e >> 20)
                if x < _L:
                    x = (x << 16) | np.int64(words[min(p, nwords)])
                    p += 1
                st[lane] = np.uint32(x)
                t = i // g
                ch = c0 + i - t * g
                if wide:
                    yb[t * kp + ch] = np.float32((sym >> 1) ^ -(sym & 1))
                else:
                    if sym >= lim[h, ch]:
                        bad[0] = 1
                    yb[t * kp + ch] = np.float32((sym >> 1) ^ -(sym & 1)) * stepf[h, ch]
            if p != pend:
                return 1
            for k in range(_LANES):
                if st[k] != _L:
                    return 1
        if wide:  # join the planes: s = hi << 8 | lo (both stored as unzigzag(byte), exact in float32)
            for t in range(Tc):
                for k in range(K):
                    qh = np.int64(hbuf[t * kp + k])
                    ql = np.int64(ybuf[t * kp + k])
                    sv = ((2 * qh if qh >= 0 else -2 * qh - 1) << 8) | (2 * ql if ql >= 0 else -2 * ql - 1)
                    if sv >= lim[h, k]:
                        bad[0] = 1
                    ybuf[t * kp + k] = np.float32((sv >> 1) ^ -(sv & 1)) * stepf[h, k]
        for k in range(16):
            if bad[k] != 0:
                return 2
        hr = h if cos.shape[0] > 1 else 0
        for t in range(T):
            cso = (hr * T + t) * rope_dim
            oo = (h * T + t) * D
            if t < n_sink or t >= T - n_recent:
                tk = t if t < n_sink else n_sink + t - (T - n_recent)
                for d in range(D):
                    acc[d] = kept[h, tk, d]
            else:
                tt = t - n_sink
                ts = tscale[tt] if has_ts else one
                direct = rope_dim == 0 or vec_rope  # the row writes its output itself
                if direct and want16:
                    row(nb, ybuf, tt * kp, kp, K, ts, idx, val, btf, bhf, use_h, h * K * D, meanf, h * D, vec_rope, cosf, sinf,
                        cso, o16, oo, dense8, plf, h * nbk * K, pcf, h * nbk)
                    continue
                # one float32 call site for both the direct float32 output and the scalar loop's acc: every
                # call site inlines the row code for all six widths, which is most of the kernel's compile time
                dst, doff = (o32, oo) if direct else (acc, 0)
                row(nb, ybuf, tt * kp, kp, K, ts, idx, val, btf, bhf, use_h, h * K * D, meanf, h * D, vec_rope if direct else 0,
                    cosf, sinf, cso, dst, doff, dense8, plf, h * nbk * K, pcf, h * nbk)
                if direct:
                    continue
            # kept rows, and partial RoPE: scalar RoPE and cast
            if rope_dim > 0:
                for d in range(half):
                    t1 = acc[d] * cosf[cso + d]
                    t2 = (-acc[d + half]) * sinf[cso + d]
                    rot[d] = t1 + t2
                for d in range(half, rope_dim):
                    t1 = acc[d] * cosf[cso + d]
                    t2 = acc[d - half] * sinf[cso + d]
                    rot[d] = t1 + t2
                for d in range(rope_dim, D):
                    rot[d] = acc[d]
                src = rot
            else:
                src = acc
            if want16:
                for d0 in range(0, D, 16):
                    f16_bits16(src, d0, o16, oo + d0)
            else:
                for d in range(D):
                    o32[oo + d] = src[d]
    return 0


@njit(cache=True, nogil=True)
def _unshuffle(src, out, es):  # pragma: no cover - numba
    """out[i * es + b] = src[b * m + i] (m = len // es); the tail (< es bytes) is copied."""
    n = src.shape[0]
    m = n // es
    for b in range(es):
        base = b * m
        for i in range(m):
            out[i * es + b] = src[base + i]
    for i in range(m * es, n):
        out[i] = src[i]


# --------------------------------------------------------------------------- caches
_ROPE: BoundedLRU[tuple] = BoundedLRU(64)
_MATS: BoundedLRU[tuple] = BoundedLRU(512)


def rope_tables_cached(pos: np.ndarray, theta: float, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`kvcodec.codecs.rope_tables.rope_tables` of positions (T,) or (H, T), cached per (positions, theta, dim).

    Returns read-only float32 arrays [1, T, dim] (1-D positions) or [H, T, dim].
    """
    from kvcodec.codecs.rope_tables import rope_tables

    p = np.ascontiguousarray(pos, dtype=np.int64)
    if p.ndim == 2 and p.shape[0] > 1 and (p == p[:1]).all():
        p = p[0]
    n = p.shape[-1]
    if p.ndim == 1 and n and int(p[-1]) - int(p[0]) == n - 1 and (n == 1 or bool((np.diff(p) == 1).all())):
        key: Any = ("range", int(p[0]), n, float(theta), int(dim))
    else:
        key = ("pos", p.shape, p.tobytes(), float(theta), int(dim))
    hit = _ROPE.get(key)
    if hit is None:
        c, s = rope_tables(p if p.ndim == 2 else p[None, :], theta, dim)
        c, s = np.ascontiguousarray(c, np.float32), np.ascontiguousarray(s, np.float32)
        c.flags.writeable = False
        s.flags.writeable = False
        hit = (c, s)
        _ROPE.put(key, hit)
    return hit


class _Mats(NamedTuple):
    """A transform stage's matrices as the kernel reads them (see :func:`_matrices`)."""

    bt: np.ndarray  # [H, K, D] float32: the basis transposed
    bh: np.ndarray | None  # the same values as float16 bits [H, K, D] uint16, when every one is a float16
    mean: np.ndarray  # [H, D] float32
    plist: np.ndarray  # [H, nblocks, K] int32: per channel block, the columns nonzero on it, ascending
    pcnt: np.ndarray  # [H, nblocks] int64: how many; pcnt[h, 0] = -1: decode head h's rows whole


def _block_lists(bt: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(plist, pcnt) of :class:`_Mats` for ``bt`` [H, K, D]: per head and channel block
    (:func:`kvcodec.codecs.blocks.channel_blocks`), the basis columns with a nonzero entry in the block.

    A head decodes block by block when that takes fewer multiply-adds than a whole row's
    nonzero coefficients typically do (about half of them at the presets' rates): a
    block-diagonal basis (calibration of head_dim > 64) costs a block's width per coefficient.
    """
    H, K, D = bt.shape
    blocks = channel_blocks(D)
    plist = np.zeros((H, len(blocks), K), np.int32)
    pcnt = np.full((H, len(blocks)), -1, np.int64)
    if len(blocks) == 1:
        return plist, pcnt
    for h in range(H):
        cols = [np.flatnonzero((bt[h, :, c0:c1] != 0).any(axis=1)) for c0, c1 in blocks]
        work = sum(len(c) * (c1 - c0) for c, (c0, c1) in zip(cols, blocks))
        if work <= BLOCKED_WORK * K * D:
            for j, c in enumerate(cols):
                plist[h, j, : len(c)] = c
                pcnt[h, j] = len(c)
    return plist, pcnt


def _matrices(tr: Any, H: int, D: int, ctx: ChunkContext) -> _Mats | None:
    """The kernel's matrices of a transform stage (:class:`_Mats`), cached per attachment arrays / row / heads;
    None when an attachment is missing.

    The float16 copy exists when every basis value is a float16 (calibrated bases are stored as
    float16): the kernel then streams half the bytes per coefficient, and widening is exact."""
    K = D if tr.k is None else tr.k
    if tr.basis == "hadamard":
        key: Any = ("had", H, D, K)
        ref: tuple = ()
    else:
        nb, nm = f"{tr.attachment}.basis", f"{tr.attachment}.mean"
        B, M = ctx.attachments.get(nb), ctx.attachments.get(nm)
        if B is None or M is None:
            return None
        row = 2 * ctx.layer + (0 if ctx.kind == "k" else 1)
        key = ("pca", id(B), id(M), row, ctx.kind, ctx.layer, int(ctx.extra.get("head_start", 0)), H, D, K)
        ref = (B, M)
    hit = _MATS.get(key)
    if hit is not None and all(w() is b for w, b in zip(hit[1], ref)):
        return hit[0]
    b, m = tr.matrices(H, D, ctx)  # validates (raises KvcFormatError)
    bt = np.ascontiguousarray(np.swapaxes(np.asarray(b, np.float32), 1, 2))
    m = np.ascontiguousarray(m, np.float32)
    bh16 = bt.astype(np.float16)
    bh = bh16.view(np.uint16) if np.array_equal(bh16.astype(np.float32), bt) else None
    mats = _Mats(bt, bh, m, *_block_lists(bt))
    # weak references: the cache must not keep every file's attachment arrays alive (ids are only
    # compared while the arrays still exist, so a reused id cannot alias)
    _MATS.put(key, (mats, tuple(weak(a) for a in ref)))
    return mats


# --------------------------------------------------------------------------- dispatch
def _structure(pipeline: Pipeline) -> tuple | None:
    """("lossless", shuffle | None) or ("lossy", TransformChain) for a supported pipeline, else None."""
    st = pipeline.stages
    if st and type(st[0]).__name__ == "Raw":
        from kvcodec.codecs.lossless import Raw, Shuffle, Zstd

        if (type(st[0]) is Raw and st[0].dtype is None and len(st) in (2, 3) and type(st[-1]) is Zstd
                and (len(st) == 2 or type(st[1]) is Shuffle)):
            return ("lossless", st[1] if len(st) == 3 else None)
        return None
    from kvcodec.decode.chain import match_chain  # not before: a lossless file needs none of the lossy stages

    chain = match_chain(pipeline)
    return None if chain is None else ("lossy", chain)


def supports(pipeline: Pipeline, spec: ArraySpec) -> bool:
    """Whether the fused kernel decodes chunks of ``pipeline`` with (input) spec ``spec``.

    Static only -- stage types and order, configs, shapes and dtypes, never the chunk's data --
    so the decoder registry (kvcodec/decode/registry.py) can pick this backend before decoding, and a
    failure of :func:`decode` on a chunk the reference decodes is a bug, not a fallback.
    """
    s = _structure(pipeline)
    if s is None or len(spec.shape) != 3 or spec.dtype not in ("float16", "float32"):
        return False
    if np.dtype(spec.dtype).byteorder == ">":  # pragma: no cover - big-endian hosts
        return False
    if s[0] == "lossless":
        return True
    ch = s[1]
    D = spec.shape[2]
    try:
        specs = pipeline.specs(spec)
    except KvcError:
        return False
    qspec, sspec = specs[ch.index()["quantize"]], specs[-1]
    K, S = qspec.shape[-1], sspec.shape[-1]  # coefficients, rANS channels (2K for quantize v2)
    g = ch.rans.channel_group if ch.rans.channel_group is not None else S
    return (len(qspec.shape) == 3 and 0 < K <= D and g > 0 and K % g == 0 and S % g == 0 and D in HEAD_DIMS
            and (g in (1, 2, 4, 8) or g % 16 == 0) and (ch.rope is None or ch.rope.dim <= D))


def decode(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
           ctx: ChunkContext) -> np.ndarray:
    """The decoded chunk, bit-identical to ``Pipeline.decode``, for a pipeline :func:`supports` accepts.

    Raises :class:`KvcFormatError` on anything it finds malformed; the registry then lets the
    reference decode the chunk, which raises the spec's exact error.
    """
    s = _structure(pipeline)
    if s is None:
        raise KvcBackendError("the fused CPU decoder does not support this pipeline")
    if len(sides) != len(pipeline.stages) or len(sizes) != len(pipeline.byte_stages):
        raise KvcFormatError("chunk side data does not match its codec pipeline")
    if s[0] == "lossless":
        return _lossless(s[1], payload, sides, sizes, spec)
    return _lossy(pipeline, s[1], payload, sides, spec, ctx)


def _lossless(shuffle: Any, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec) -> np.ndarray:
    from kvcodec.codecs.lossless import zstd_decompress_exact

    if any(sides):
        raise KvcFormatError("lossless chunk with side data")
    n = int(np.prod(spec.shape, dtype=np.int64))
    nbytes = n * np.dtype(spec.dtype).itemsize
    if sizes[-1] != nbytes or (shuffle is not None and sizes[0] != nbytes):
        raise KvcFormatError("lossless chunk sizes do not match its spec")
    raw = zstd_decompress_exact(payload, nbytes)  # capped at the declared size
    src = np.frombuffer(raw, dtype=np.uint8)
    if shuffle is None:
        return src.view(spec.dtype).reshape(spec.shape)
    out = np.empty(spec.shape, dtype=spec.dtype)
    _unshuffle(src, out.reshape(-1).view(np.uint8), shuffle.elementsize)
    return out


def _lossy(pipeline: Pipeline, ch: Any, payload: Any, sides: list[SideData], spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
    rope, keep, tr, ts, qz, rs = ch.rope, ch.keep, ch.transform, ch.tokenscale, ch.quantize, ch.rans
    H, T, D = spec.shape
    specs = pipeline.specs(spec)  # input spec of each array stage + the bytes stage
    ix = ch.index()
    qspec = specs[ix["quantize"]]  # quantize's input: the coefficients (v2 codes them as 2K byte channels)
    sspec = specs[-1]  # the rANS stage's input
    Hq, Tc, K = qspec.shape
    g = rs.channel_group if rs.channel_group is not None else sspec.shape[2]
    # rope: no side data; tables
    rope_dim = 0
    cos = sin = _EMPTY3
    if rope is not None:
        if sides[ix["rope"]]:
            raise KvcFormatError("codec 'rope' has no side data")
        if T:
            from kvcodec.codecs.rope_tables import positions_for

            cos, sin = rope_tables_cached(positions_for(ctx.positions, ctx.layer, H, T, ctx.token_start), rope.theta, rope.dim)
            rope_dim = rope.dim
    # keep, transform, tokenscale, quantize: the stages' own validation
    n_sink = n_recent = 0
    kept = _EMPTY3
    if keep is not None:
        n_sink, n_recent = keep.counts(T)
        kept = np.ascontiguousarray(keep.kept_side(sides[ix["keep"]], specs[ix["keep"]]), dtype=np.float32)
    if sides[ix["transform"]]:
        raise KvcFormatError("codec 'transform' has no side data")
    mats = _matrices(tr, H, D, ctx)
    if mats is None or mats.bt.shape != (H, K, D):
        raise KvcFormatError("codec 'transform': attachment missing or of the wrong shape")
    tscale = _EMPTY1
    has_ts = ts is not None
    if has_ts:
        tscale = ts.multipliers(sides[ix["tokenscale"]], Tc)
    step, bits = qz.step_side(sides[ix["quantize"]], qspec)
    stepf = step.astype(np.float32)
    lim = np.left_shift(np.int64(1), bits.astype(np.int64))
    if sides[ix["rans"]]:
        raise KvcFormatError("codec 'rans' has no side data")
    wide = qz.version == 2
    stream = rs.parse(payload, sspec)
    if stream.n_contexts != H * (sspec.shape[2] // g):
        raise KvcFormatError("codec 'rans': context count does not match the chunk")
    nwords = int(stream.words.size)
    words = np.zeros(nwords + 16, np.uint32)  # widened (see simd.rans16); 16 readable words past any position the kernel accepts
    words[:nwords] = stream.words
    want16 = spec.dtype == "float16"
    out = np.empty((H, T, D), dtype=np.uint16 if want16 else np.float32)
    o16 = out if want16 else _EMPTY3U
    o32 = _EMPTY3 if want16 else out
    n_y = Tc * (-(-K // 16) * 16)
    ybuf = _scratch(n_y)
    hbuf = np.empty(n_y, np.float32) if wide else _EMPTY1
    tabs = np.empty((stream.freqs.shape[0] if stream.version == 2 else 1, _M), np.uint32)
    code = _decode_kernel(stream.freqs, stream.cums, stream.table_of, stream.block_symbols, tabs, stream.states,
                          stream.n_symbols, stream.word_start, stream.n_words,
                          words, nwords, g, stepf, lim, mats.bt, _EMPTY3U if mats.bh is None else mats.bh, int(mats.bh is not None),
                          mats.mean, kept, n_sink, n_recent, tscale, has_ts, rope_dim, cos, sin, o16, o32, want16, ybuf, wide,
                          hbuf, DENSE_OF_8, mats.plist, mats.pcnt)
    if code != 0:
        raise KvcFormatError(f"codec 'rans': malformed stream (fused decoder code {code})")
    return out.view(np.float16) if want16 else out


_TLS = threading.local()
_SCRATCH_KEEP = 1 << 24  # floats (64 MiB): larger scratch is not kept between chunks


def _scratch(n: int) -> np.ndarray:
    """A float32 scratch buffer of >= n elements, reused per thread (fresh pages cost a fault each)."""
    buf = getattr(_TLS, "ybuf", None)
    if buf is not None and buf.size >= n:
        return buf
    buf = np.empty(max(n, 1), np.float32)
    if n <= _SCRATCH_KEEP:
        _TLS.ybuf = buf
    return buf


_EMPTY3 = np.zeros((1, 1, 1), np.float32)
_EMPTY3U = np.zeros((1, 1, 1), np.uint16)
_EMPTY1 = np.zeros(1, np.float32)
