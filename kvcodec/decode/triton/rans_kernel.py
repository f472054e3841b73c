"""Triton decoder for the interleaved 32-lane rANS v1 stream (spec/rans-v1.md).

One warp decodes one context: the 32 lanes of the stream are the 32 threads
of the warp (a ``[CB, 32]`` tile, one row per warp, ``CB`` contexts per
program). Every step decodes all active lanes, then hands the next words of
the context's single word stream to the lanes that need a refill in
ascending lane order (``tl.cumsum`` over the refill flags = ballot+popcount).
Symbols are written straight into the stage's (H, T, D) uint8 layout, so no
``from_contexts`` transpose follows.

Symbol lookup (two bit-identical variants, a constexpr ``TABLE``):

* ``TABLE=False`` ("search", default for alphabets <= 16): branchless binary
  search over the context's packed ``freq | cum << 16`` array (``A`` <= 256
  entries, <= 1 KiB, L1-resident): ``ceil(log2 A)`` gathers per symbol, no
  table build.
* ``TABLE=True`` ("table"): a 4096-entry slot -> ``sym | (f-1) << 8 |
  (slot-cum) << 20`` table per context, built on the device by
  :func:`_build_table_kernel` into a scratch buffer (16 KiB per context,
  L1/L2-resident while its warp runs): one gather per symbol.

The host side (:func:`decode_streams`) validates every stream with the CPU
reference's :func:`kvcodec.entropy.rans.parse_header` before launching, so a
malformed header raises exactly the CPU path's ``KvcFormatError``; data errors
(word overrun / unread words / wrong final state) are detected in the kernel,
written per context to an error buffer and raised by the host after the
launch with the CPU decoder's message.

Kernels are created lazily (:func:`kernels`) in the mode the environment asks
for at first use: ``TRITON_INTERPRET=1`` gives interpreted kernels that run on
CPU tensors bit-exactly; otherwise JIT kernels for a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from kvcodec.entropy import constants as K
from kvcodec.entropy import rans
from kvcodec.decode.device import interpret_mode
from kvcodec.errors import KvcBackendError, KvcFormatError

N_LANES = K.N_LANES
DEFAULT_CB = 4  # contexts per program (= warps per program)

# The bitstream's constants, from the one module that states them (kvcodec/entropy/constants.py),
# as Triton compile-time constants (a @jit function may read a global only if it is a constexpr).
_LANES = tl.constexpr(K.N_LANES)
_M = tl.constexpr(K.PROB_SCALE)
_P = tl.constexpr(K.PROB_BITS)
_SLOT = tl.constexpr(K.SLOT_MASK)
_L = tl.constexpr(K.RANS_L)
_W = tl.constexpr(K.WORD_BITS)
_FC_FREQ = tl.constexpr((1 << K.FC_CUM_SHIFT) - 1)  # the freq bits of a binary-search entry
_TF = tl.constexpr(K.TABLE_FREQ_SHIFT)
_TC = tl.constexpr(K.TABLE_CUM_SHIFT)
_FC = tl.constexpr(K.FC_CUM_SHIFT)
_FC_SENTINEL = tl.constexpr(K.FC_SENTINEL)
_E_OVERRUN = tl.constexpr(K.E_OVERRUN)
_E_UNDERRUN = tl.constexpr(K.E_UNDERRUN)
_E_FINAL = tl.constexpr(K.E_FINAL_STATE)


# --------------------------------------------------------------------------- kernels (plain functions; see kernels())


def _rans_decode_kernel(
    fc_ptr,  # int32 [n_tables, A]: freq | cum << 16 (TABLE=False)
    tab_ptr,  # int32 [n_tables, 4096]: sym | (f-1) << 8 | (slot-cum) << 20 (TABLE=True)
    tsel_ptr,  # int32 [*]: table of each (context, block); context c's blocks start at tbase_ptr[c]
    tbase_ptr,  # int64 [C]
    state_ptr,  # int32 [C, 32] (bit pattern of uint32 states)
    nsym_ptr,  # int32 [C]
    nwords_ptr,  # int32 [C]
    wstart_ptr,  # int64 [C]: index of the context's first word in words_ptr
    obase_ptr,  # int64 [C]: output offset of the context's symbol 0
    words_ptr,  # int16 [W] (bit pattern of little-endian uint16 words)
    out_ptr,  # uint8 [*]
    err_ptr,  # int32 [C]: 0 ok, 6 overrun, 7 unread words, 8 wrong final state
    C,  # number of contexts
    A,  # alphabet size (table length)
    G,  # symbols per row of a context in the output (channel group)
    ROW,  # output stride between consecutive rows of a context (D)
    BSYM,  # symbols per block (rans v2: a multiple of 32, so a step lies in one block; v1: >= every context's)
    LOG2A: tl.constexpr,  # ceil(log2(A))
    TABLE: tl.constexpr,
    CB: tl.constexpr,
):
    pid = tl.program_id(0)
    ctx = pid * CB + tl.arange(0, CB)
    cmask = ctx < C
    lanes = tl.arange(0, _LANES)
    ctx64 = ctx.to(tl.int64)
    x = tl.load(state_ptr + ctx64[:, None] * _LANES + lanes[None, :], mask=cmask[:, None], other=_L).to(tl.uint32, bitcast=True)
    n = tl.load(nsym_ptr + ctx, mask=cmask, other=0)
    nw = tl.load(nwords_ptr + ctx, mask=cmask, other=0)
    wst = tl.load(wstart_ptr + ctx, mask=cmask, other=0)
    obase = tl.load(obase_ptr + ctx, mask=cmask, other=0)
    tsb = tl.load(tbase_ptr + ctx, mask=cmask, other=0)
    steps = tl.max((n + _LANES - 1) // _LANES, axis=0)
    p = tl.zeros([CB], dtype=tl.int32)
    for j in range(0, steps):
        idx = j * _LANES + lanes[None, :]  # [1, 32] symbol index within the context
        active = idx < n[:, None]  # [CB, 32]
        tid = tl.load(tsel_ptr + tsb + (j * _LANES) // BSYM, mask=cmask & (j * _LANES < n), other=0).to(tl.int64)
        if TABLE:
            tbase = tid * _M
            fc0 = tl.zeros([CB], dtype=tl.uint32)
        else:
            tbase = tid * A
            fc0 = tl.load(fc_ptr + tbase, mask=cmask, other=0).to(tl.uint32, bitcast=True)
        slot = x & _SLOT
        if TABLE:
            e = tl.load(tab_ptr + tbase[:, None] + slot.to(tl.int32), mask=active, other=0).to(tl.uint32, bitcast=True)
            sym = e & 255
            xn = (((e >> _TF) & _SLOT) + 1) * (x >> _P) + (e >> _TC)
        else:
            # largest s < A with cum_s <= slot (cum_0 = 0 always qualifies)
            s = tl.zeros([CB, _LANES], dtype=tl.int32)
            fcs = tl.broadcast_to(fc0[:, None], [CB, _LANES])
            for b in tl.static_range(LOG2A):
                t = s + (1 << (LOG2A - 1 - b))
                fct = tl.load(fc_ptr + tbase[:, None] + t, mask=active & (t < A), other=_FC_SENTINEL).to(tl.uint32, bitcast=True)
                acc = (fct >> _FC) <= slot
                s = tl.where(acc, t, s)
                fcs = tl.where(acc, fct, fcs)
            sym = s
            xn = (fcs & _FC_FREQ) * (x >> _P) + slot - (fcs >> _FC)
        row = idx // G
        off = obase[:, None] + row.to(tl.int64) * ROW + (idx - row * G)
        tl.store(out_ptr + off, sym.to(tl.uint8), mask=active)
        need = active & (xn < _L)
        ni = need.to(tl.int32)
        rank = tl.cumsum(ni, axis=1) - ni
        widx = p[:, None] + rank
        w = tl.load(words_ptr + wst[:, None] + widx, mask=need & (widx < nw[:, None]), other=0)
        w32 = w.to(tl.uint16, bitcast=True).to(tl.uint32)
        xn = tl.where(need, (xn << _W) | w32, xn)
        x = tl.where(active, xn, x)
        p += tl.sum(ni, axis=1)
    bad_state = tl.max((x != _L).to(tl.int32), axis=1)
    code = tl.where(p > nw, _E_OVERRUN, tl.where(p < nw, _E_UNDERRUN, tl.where(bad_state > 0, _E_FINAL, 0)))
    tl.store(err_ptr + ctx, code, mask=cmask)


def _build_table_kernel(
    fc_ptr,  # int32 [n_tables, A]: freq | cum << 16
    tab_ptr,  # int32 [n_tables, 4096] out
    A,
    LOG2A: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64)
    slot = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    base = c * A
    s = tl.zeros([BLOCK], dtype=tl.int32)
    fcs = tl.load(fc_ptr + base + s).to(tl.uint32, bitcast=True)
    for b in tl.static_range(LOG2A):
        t = s + (1 << (LOG2A - 1 - b))
        fct = tl.load(fc_ptr + base + t, mask=t < A, other=_FC_SENTINEL).to(tl.uint32, bitcast=True)
        acc = (fct >> _FC) <= slot.to(tl.uint32)
        s = tl.where(acc, t, s)
        fcs = tl.where(acc, fct, fcs)
    e = s.to(tl.uint32) | (((fcs & _FC_FREQ) - 1) << _TF) | ((slot.to(tl.uint32) - (fcs >> _FC)) << _TC)
    tl.store(tab_ptr + c * _M + slot, e.to(tl.int32, bitcast=True))


_KERNELS: dict[bool, dict[str, object]] = {}


def check_interpreter() -> None:
    """The interpreter only works if TRITON_INTERPRET=1 was set before triton was imported."""
    from triton.runtime.interpreter import InterpretedFunction

    if not isinstance(tl.cumsum, InterpretedFunction):
        from kvcodec.errors import KvcBackendError

        raise KvcBackendError("TRITON_INTERPRET=1 was set after triton was imported; set it before starting Python")


def kernels(interpret: bool | None = None) -> dict[str, object]:
    """The Triton kernels of this module, JIT (GPU) or interpreted (CPU tensors)."""
    mode = interpret_mode() if interpret is None else interpret
    if mode not in _KERNELS:
        if mode:
            check_interpreter()
            from triton.runtime.interpreter import InterpretedFunction as make
        else:
            from triton.runtime.jit import JITFunction as make
        _KERNELS[mode] = {
            "rans_decode": make(_rans_decode_kernel),
            "build_table": make(_build_table_kernel),
        }
    return _KERNELS[mode]


# --------------------------------------------------------------------------- host side


@dataclass
class RansItem:
    """One rANS stage payload to decode: the stream, the (H, T, D) shape, channel group and, for a rans v2
    stream, its block of tokens (None: v1)."""

    data: bytes | memoryview | np.ndarray
    shape: tuple[int, int, int]
    channel_group: int | None = None
    block_tokens: int | None = None


_V1_BLOCK = 2**31 - 1  # a v1 context is one block (contexts of 2**31 - 64 symbols or more are refused)


def _log2ceil(a: int) -> int:
    return max(0, (int(a) - 1).bit_length())


def _parse(it: RansItem) -> tuple[rans.RansStream, int, int, int]:
    """The item's stream validated exactly as its CPU stage does, and (n_contexts, symbols per context, g)."""
    from kvcodec.codecs.rans import RansBankStage, RansStage
    from kvcodec.core.stage import ArraySpec

    g = it.channel_group
    st = RansStage(channel_group=g) if it.block_tokens is None else RansBankStage(g, block_tokens=it.block_tokens)
    H, T, D = st._check_spec(it.shape, np.uint8)
    n_ctx, n_sym = st.expected_counts((H, T, D))
    return st.parse(it.data, ArraySpec((H, T, D), "uint8")), n_ctx, n_sym, (D if g is None else int(g))


def choose_lookup(alphabet: int, symbols_per_context: int) -> bool:
    """Heuristic: True = slot table, False = binary search (both bit-identical)."""
    return alphabet > 16 and symbols_per_context >= 4096


def _empty(it: RansItem) -> bool:
    H, T, D = it.shape
    return H * T * D == 0


def decode_streams(
    items: Sequence[RansItem],
    device: torch.device | str,
    outs: Sequence[torch.Tensor] | None = None,
    table: bool | None = None,
    cb: int = DEFAULT_CB,
    launches: list | None = None,
) -> list[torch.Tensor]:
    """Decode several rANS stage payloads in one launch (per alphabet size).

    Returns one uint8 (H, T, D) tensor per item on ``device`` (or fills the
    contiguous uint8 tensors ``outs``). ``launches``, if given, receives one
    callable per launch group that re-runs only the kernels on the staged
    device buffers (for benchmarks). Raises :class:`KvcFormatError` with the
    CPU decoder's message for the first malformed item, in item order.
    """
    device = torch.device(device)
    streams: list[rans.RansStream] = []
    metas = []
    for it in items:
        st, n_ctx, n_sym, g = _parse(it)  # same validation + errors as the CPU path
        if n_sym >= 2**31 - 64 or int(st.n_words.max(initial=0)) >= 2**31:
            raise KvcFormatError("rans: context too large for the GPU decoder")
        streams.append(st)
        metas.append((n_ctx, n_sym, g))
    given = outs is not None
    if not given:
        outs = [torch.empty(tuple(it.shape), dtype=torch.uint8, device=device) if _empty(it) else None for it in items]
    else:
        outs = list(outs)
        for it, o in zip(items, outs):
            if tuple(o.shape) != tuple(it.shape) or o.dtype != torch.uint8 or not o.is_contiguous():
                raise KvcBackendError(f"rans: output must be a contiguous uint8 tensor of shape {tuple(it.shape)}")
    # group items by (alphabet, G, D, lookup, block) -> one launch each (v1: one block per context)
    groups: dict[tuple[int, int, int, bool, int], list[int]] = {}
    for i, (st, (n_ctx, n_sym, g)) in enumerate(zip(streams, metas)):
        if n_ctx == 0 or n_sym == 0:
            continue
        D = int(items[i].shape[2])
        use_table = choose_lookup(st.alphabet, n_sym) if table is None else bool(table)
        bsym = st.block_symbols if st.version == 2 else _V1_BLOCK
        groups.setdefault((st.alphabet, g, D, use_table, bsym), []).append(i)
    errors: dict[int, tuple[int, int]] = {}
    k = kernels()
    for (A, g, D, use_table, bsym), idxs in groups.items():
        # one flat output buffer per group; per-context base offsets place every symbol
        fc_l, st_l, ns_l, nw_l, ws_l, ob_l, words_l, ts_l, tb_l = [], [], [], [], [], [], [], [], []
        word_off = 0
        out_off = 0
        n_tables = 0
        n_sel = 0
        for i in idxs:
            st = streams[i]
            H, T, _ = items[i].shape
            fc = (st.freqs.astype(np.int64) | (st.cums.astype(np.int64) << K.FC_CUM_SHIFT)).astype(np.int32)
            fc_l.append(fc)
            ts_l.append(st.table_of.reshape(-1) + n_tables)
            tb_l.append(n_sel + np.arange(st.n_contexts, dtype=np.int64) * st.table_of.shape[1])
            n_tables += fc.shape[0]
            n_sel += st.table_of.size
            st_l.append(st.states.view(np.int32))
            ns_l.append(st.n_symbols)
            nw_l.append(st.n_words)
            ws_l.append(st.word_start + word_off)
            c = np.arange(st.n_contexts, dtype=np.int64)
            h, j = c // (D // g), c % (D // g)
            ob_l.append(out_off + h * T * D + j * g)
            w = st.words.view(np.int16)
            words_l.append(w)
            word_off += w.size
            out_off += H * T * D
        fc_h = np.ascontiguousarray(np.concatenate(fc_l))
        n_ctx_total = sum(streams[i].n_contexts for i in idxs)
        to = lambda a, dt: torch.from_numpy(np.ascontiguousarray(np.concatenate(a)).astype(dt, copy=False)).to(device)  # noqa: E731
        fc_d = torch.from_numpy(fc_h).to(device)
        states_d = to(st_l, np.int32)
        ns_d = to(ns_l, np.int32)
        nw_d = to(nw_l, np.int32)
        ws_d = to(ws_l, np.int64)
        ob_d = to(ob_l, np.int64)
        tsel_d = to(ts_l, np.int32)
        tbase_d = to(tb_l, np.int64)
        words_d = to(words_l, np.int16) if word_off else torch.zeros(1, dtype=torch.int16, device=device)
        if given and len(idxs) == 1:
            out_buf = outs[idxs[0]].view(-1)
        else:
            out_buf = torch.empty(out_off, dtype=torch.uint8, device=device)
        err_d = torch.zeros(n_ctx_total, dtype=torch.int32, device=device)
        log2a = _log2ceil(A)
        tab_d = torch.empty((n_tables, K.PROB_SCALE), dtype=torch.int32, device=device) if use_table else fc_d

        def run(fc_d=fc_d, tab_d=tab_d, tsel_d=tsel_d, tbase_d=tbase_d, states_d=states_d, ns_d=ns_d, nw_d=nw_d,
                ws_d=ws_d, ob_d=ob_d, words_d=words_d, out_buf=out_buf, err_d=err_d, n=n_ctx_total, nt=n_tables, A=A,
                g=g, D=D, bsym=bsym, log2a=log2a, use_table=use_table):
            if use_table:
                k["build_table"][(nt, K.PROB_SCALE // 1024)](fc_d, tab_d, A, LOG2A=log2a, BLOCK=1024, num_warps=4)
            k["rans_decode"][(triton.cdiv(n, cb),)](
                fc_d, tab_d, tsel_d, tbase_d, states_d, ns_d, nw_d, ws_d, ob_d, words_d, out_buf, err_d,
                n, A, g, D, bsym, LOG2A=log2a, TABLE=use_table, CB=cb, num_warps=cb,
            )

        run()
        if launches is not None:
            launches.append(run)
        if not (given and len(idxs) == 1):
            pos = 0
            for i in idxs:
                nb = int(np.prod(items[i].shape))
                if given:
                    outs[i].view(-1).copy_(out_buf[pos : pos + nb])
                else:
                    outs[i] = out_buf[pos : pos + nb].view(tuple(items[i].shape))
                pos += nb
        err = err_d.cpu().numpy()
        bad = np.flatnonzero(err)
        if bad.size:
            # map the first failing flat context back to (item, context)
            starts = np.cumsum([0] + [streams[i].n_contexts for i in idxs])
            for b in bad:
                it_pos = int(np.searchsorted(starts, b, side="right") - 1)
                i = idxs[it_pos]
                c = int(b - starts[it_pos])
                if i not in errors or c < errors[i][0]:
                    errors[i] = (c, int(err[b]))
    if errors:
        i = min(errors)
        c, code = errors[i]
        raise KvcFormatError(f"rans: context {c} {rans.DECODE_ERRORS[code]}")
    return list(outs)


def decode_stage(
    data: bytes | memoryview | np.ndarray,
    shape: tuple[int, int, int],
    channel_group: int | None,
    device: torch.device | str,
    out: torch.Tensor | None = None,
    table: bool | None = None,
    block_tokens: int | None = None,
) -> torch.Tensor:
    """GPU equivalent of ``RansStage(channel_group).decode(data, {}, ArraySpec(shape, "uint8"), ctx)`` (with
    ``block_tokens``: of ``RansBankStage(channel_group, block_tokens)``'s)."""
    return decode_streams([RansItem(data, tuple(shape), channel_group, block_tokens)], device,
                          None if out is None else [out], table=table)[0]
