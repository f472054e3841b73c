"""The rANS coder's compiled loops (numba): the encoder's body, the stream checks and the scalar decoder.

These walk the bytes of spec/rans-v1.md and spec/rans-v2.md one symbol or one byte at a time and
report violations as error codes; :mod:`kvcodec.entropy.rans` sizes their buffers, validates what
they cannot, and turns the codes into :class:`~kvcodec.errors.KvcFormatError` messages. The CPU
fused decoder (:mod:`kvcodec.decode.cpu.fused`) shares :func:`slot_table`.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from kvcodec.entropy.constants import (
    E_FINAL_STATE, E_FREQ_RANGE, E_FREQ_SUM, E_LEB_LONG, E_LEB_NONCANON, E_OVERRUN, E_TRUNC, E_UNDERRUN, N_LANES, OK,
    PROB_BITS, PROB_SCALE, RANS_L, SLOT_MASK, STATE_BYTES, TABLE_CUM_SHIFT, TABLE_FREQ_SHIFT, WORD_BITS, WORD_MASK,
    X_MAX_SHIFT,
)


# parse_body's violations (the caller words them)
B_HEADER_PAD, B_SIZE, B_LOW, B_IDLE, B_WORD_PAD = 1, 2, 3, 4, 5


@njit(cache=True)
def encode_body(symbols, freqs, cums, table_of, bsyms, out, start, n_words):  # pragma: no cover - numba
    """Encode every context of ``symbols`` [C, N] into ``out`` from byte ``start``.

    Symbol ``i`` of context ``c`` is coded with table ``table_of[c, i // bsyms]`` of ``freqs`` / ``cums``
    (v1: one table per context, ``table_of[c, 0] = c`` and ``bsyms >= N``). Writes, per context, 32 LE u32
    final states, the LE u16 words in stream order, zero padding to 4 bytes (``out`` is pre-zeroed).
    Returns the end offset.
    """
    C, N = symbols.shape
    nb = table_of.shape[1]
    scratch = np.empty(N, dtype=np.uint16)
    st = np.empty(N_LANES, dtype=np.int64)
    pos = start
    for c in range(C):
        for k in range(N_LANES):
            st[k] = RANS_L
        row = symbols[c]
        wp = N  # words are produced last-first: fill scratch from the end
        for b in range(nb - 1, -1, -1):
            t = table_of[c, b]
            fr = freqs[t]
            cu = cums[t]
            for i in range(min(N, (b + 1) * bsyms) - 1, b * bsyms - 1, -1):
                lane = i & (N_LANES - 1)
                s = row[i]
                f = np.int64(fr[s])
                x = st[lane]
                if x >= (f << X_MAX_SHIFT):  # x_max = ((L >> P) << WORD_BITS) * f
                    wp -= 1
                    scratch[wp] = x & WORD_MASK
                    x >>= WORD_BITS
                st[lane] = ((x // f) << PROB_BITS) + (x % f) + np.int64(cu[s])
        for k in range(N_LANES):
            x = st[k]
            out[pos] = x & 0xFF
            out[pos + 1] = (x >> 8) & 0xFF
            out[pos + 2] = (x >> 16) & 0xFF
            out[pos + 3] = (x >> 24) & 0xFF
            pos += 4
        for k in range(wp, N):
            w = scratch[k]
            out[pos] = w & 0xFF
            out[pos + 1] = w >> 8
            pos += 2
        n_words[c] = N - wp
        pos = (pos + 3) & ~3
    return pos


@njit(cache=True)
def read_table(buf, pos, row):  # pragma: no cover - numba
    """Read one table of ``row.size`` canonical LEB128 frequencies from ``pos`` into ``row``.
    Returns (OK, next offset) or (error code, offset; for E_FREQ_SUM the table's sum)."""
    n = buf.shape[0]
    total = 0
    for s in range(row.shape[0]):
        if pos >= n:
            return E_TRUNC, pos
        b0 = np.int64(buf[pos])
        if b0 < 128:
            v = b0
            pos += 1
        else:
            if pos + 1 >= n:
                return E_TRUNC, pos
            b1 = np.int64(buf[pos + 1])
            if b1 >= 128:
                return E_LEB_LONG, pos
            if b1 == 0:
                return E_LEB_NONCANON, pos
            v = (b0 & 0x7F) | (b1 << 7)
            pos += 2
        if v > PROB_SCALE:
            return E_FREQ_RANGE, pos
        row[s] = v
        total += v
    if total != PROB_SCALE:
        return E_FREQ_SUM, total
    return OK, pos


@njit(cache=True)
def parse_tables(buf, C, A, n_sym, n_words, freqs):  # pragma: no cover - numba
    """Read the per-context header entries (v1). Returns (code, context, byte offset)."""
    n = buf.shape[0]
    pos = 6
    for c in range(C):
        if pos + 8 > n:
            return E_TRUNC, c, pos
        v = np.int64(0)
        for k in range(4):
            v |= np.int64(buf[pos + k]) << (8 * k)
        n_sym[c] = v
        v = np.int64(0)
        for k in range(4):
            v |= np.int64(buf[pos + 4 + k]) << (8 * k)
        n_words[c] = v
        code, pos = read_table(buf, pos + 8, freqs[c])
        if code != OK:
            return code, c, pos
    return OK, C, pos


@njit(cache=True)
def parse_body(b, pos, body, ns, nw, data_off, states):  # pragma: no cover - numba
    """The checks after the frequency tables, in one pass (numpy did them in ~20 small array ops,
    most of a chunk's parse time): zero header padding ``b[pos:body]``; each context's block of
    ``STATE_BYTES + 2 * n_words`` bytes padded to 4 (its offset into ``data_off``), the blocks
    ending exactly at the buffer's end; final states (into ``states``) >= L, exactly L for lanes
    that get no symbol; zero padding after each context's words. Returns (OK, 0, 0) or
    (code, context or described size, lane) of the first violation, in that order of checks."""
    n = b.size
    for i in range(pos, body):
        if b[i] != 0:
            return B_HEADER_PAD, 0, 0
    C = ns.size
    off = np.int64(body)
    for c in range(C):
        data_off[c] = off
        off += (STATE_BYTES + 2 * nw[c] + 3) & ~3
    if off != n:
        return B_SIZE, off, 0
    for c in range(C):
        for k in range(N_LANES):
            o = data_off[c] + 4 * k
            states[c, k] = (np.uint32(b[o]) | np.uint32(b[o + 1]) << 8 | np.uint32(b[o + 2]) << 16
                            | np.uint32(b[o + 3]) << 24)
    for c in range(C):
        for k in range(N_LANES):
            if states[c, k] < RANS_L:
                return B_LOW, c, k
    for c in range(C):
        for k in range(N_LANES):
            if k >= ns[c] and states[c, k] != RANS_L:
                return B_IDLE, c, k
    for c in range(C):
        ps = data_off[c] + STATE_BYTES + 2 * nw[c]
        pe = data_off[c] + ((STATE_BYTES + 2 * nw[c] + 3) & ~3)
        if pe > ps and (b[ps] | b[ps + 1]) != 0:
            return B_WORD_PAD, c, 0
    return OK, 0, 0


@njit(cache=True)
def parse_bank(buf, pos, freqs):  # pragma: no cover - numba
    """Read K x A canonical LEB128 frequencies from ``pos`` (v2). Returns (code, table, byte offset or sum)."""
    for t in range(freqs.shape[0]):
        code, pos = read_table(buf, pos, freqs[t])
        if code != OK:
            return code, t, pos
    return OK, freqs.shape[0], pos


@njit(cache=True)
def slot_table(freqs, cums, t, tab):  # pragma: no cover - numba
    """tab[slot] = sym | (f - 1) << 8 | (slot - cum) << 20 for table ``t``."""
    for s in range(freqs.shape[1]):
        f = np.int64(freqs[t, s])
        cm = np.int64(cums[t, s])
        for k in range(f):
            tab[cm + k] = np.uint32(s | ((f - 1) << TABLE_FREQ_SHIFT) | (k << TABLE_CUM_SHIFT))


@njit(cache=True)
def decode_kernel(freqs, cums, table_of, bsyms, states, n_symbols, sym_offsets, n_words, word_start, words, out,
                   err):  # pragma: no cover - numba
    """Scalar decoder. Processing symbols in index order is exactly the spec's
    step-by-step, ascending-lane refill order; symbol i of context c uses table
    ``table_of[c, i // bsyms]`` (its slot table is rebuilt when the table changes).
    Returns 0 or an error code with the failing context in err[0]."""
    C = states.shape[0]
    nb = table_of.shape[1]
    tab = np.empty(PROB_SCALE, dtype=np.uint32)
    st = np.empty(N_LANES, dtype=np.int64)
    last = words.shape[0] - 1
    cur = -1
    for c in range(C):
        for k in range(N_LANES):
            st[k] = states[c, k]
        n = n_symbols[c]
        o = sym_offsets[c]
        p = word_start[c]
        pend = p + n_words[c]
        for b in range(nb):
            t = table_of[c, b]
            if t != cur:
                slot_table(freqs, cums, t, tab)
                cur = t
            for i in range(b * bsyms, min(n, (b + 1) * bsyms)):
                lane = i & (N_LANES - 1)
                x = st[lane]
                e = np.int64(tab[x & (PROB_SCALE - 1)])
                out[o + i] = e & 0xFF
                x = (((e >> TABLE_FREQ_SHIFT) & SLOT_MASK) + 1) * (x >> PROB_BITS) + (e >> TABLE_CUM_SHIFT)
                if x < RANS_L:
                    q = p if p < last else last  # never read outside `words`; overrun is checked below
                    x = (x << WORD_BITS) | np.int64(words[q])
                    p += 1
                st[lane] = x
        if p > pend:
            err[0] = c
            return E_OVERRUN
        if p < pend:
            err[0] = c
            return E_UNDERRUN
        for k in range(N_LANES):
            if st[k] != RANS_L:
                err[0] = c
                return E_FINAL_STATE
    return OK
