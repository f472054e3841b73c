"""The probability model of the rANS coder: symbol counts and the 12-bit frequency tables.

Split from the coder (:mod:`kvcodec.entropy.rans`) as CompressAI separates its entropy
models from its rANS coder: this module decides *what distribution* each context is
coded with (and how many bits that ideally costs); the coder only turns symbols and a
table into a bitstream and back. The decoder accepts any valid table, so everything here
is encoder-side and free to improve without a format change.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from kvcodec.errors import KvcCodecError
from kvcodec.entropy.constants import PROB_BITS, PROB_SCALE

__all__ = ["count_symbols", "normalize_freqs", "cumulative", "empirical_entropy_bits", "table_code_length_bits", "block_counts",
           "learn_bank"]


@njit(cache=True)
def _gains(counts, out, s, add_gain, rem_gain):  # pragma: no cover - numba
    """Refresh symbol ``s``'s two gains: code shortened by one more unit, lengthened by one unit less."""
    if counts[s] > 0:
        add_gain[s] = counts[s] * math.log((out[s] + 1) / out[s])
    if out[s] > 1:
        rem_gain[s] = counts[s] * math.log(out[s] / (out[s] - 1))


@njit(cache=True)
def _normalize_one(counts, out):  # pragma: no cover - numba
    """Fill ``out`` (int64[A]) with a 12-bit table for ``counts`` (int64[A]).

    Every present symbol gets >= 1; the result maximises sum(c_s * log f_s)
    (= minimises the ideal code length) subject to sum(f) = 4096 and f_s >= 1
    for present symbols: proportional start, greedy +-1 fix-up of the sum,
    then 1-unit exchanges while one strictly shortens the code. Ties go to
    the lowest symbol index, so the result is deterministic.

    Each symbol's two gains are kept in arrays and refreshed only where a unit
    moved (the same expression, so the same floats): a step costs scans of
    comparisons instead of 2 x A logarithms. The rans v2 bank normalises every
    candidate table, whose counts (tens of thousands over ~256 symbols for
    ``near-lossless``'s 16-bit codes) sit a hundred units or more from their sum.
    """
    A = counts.shape[0]
    total = 0
    present = 0
    last = -1
    for s in range(A):
        out[s] = 0
        if counts[s] > 0:
            total += counts[s]
            present += 1
            last = s
    if present == 0:
        return
    if present == 1:
        out[last] = PROB_SCALE
        return
    fsum = 0
    for s in range(A):
        if counts[s] > 0:
            f = (counts[s] * PROB_SCALE) // total
            if f < 1:
                f = 1
            out[s] = f
            fsum += f
    add_gain = np.empty(A, np.float64)
    rem_gain = np.empty(A, np.float64)
    for s in range(A):
        _gains(counts, out, s, add_gain, rem_gain)
    # fix the sum: add where the gain is largest / remove where the loss is smallest
    while fsum < PROB_SCALE:
        best = -1
        bestv = -1.0
        for s in range(A):
            if counts[s] > 0 and add_gain[s] > bestv:
                bestv = add_gain[s]
                best = s
        out[best] += 1
        fsum += 1
        _gains(counts, out, best, add_gain, rem_gain)
    while fsum > PROB_SCALE:
        best = -1
        bestv = math.inf
        for s in range(A):
            if out[s] > 1 and rem_gain[s] < bestv:
                bestv = rem_gain[s]
                best = s
        out[best] -= 1
        fsum -= 1
        _gains(counts, out, best, add_gain, rem_gain)
    # exchange 1 unit while it strictly helps (objective strictly increases -> terminates)
    for _ in range(4 * PROB_SCALE):
        # best unit to add; best unit to take from any *other* symbol. If some
        # move t <- s helps, so does add <- s (gain(add) >= gain(t)), and s != add
        # because loss(s) > gain(s) for every s: so this test is exhaustive.
        add = -1
        addv = -1.0
        for s in range(A):
            if counts[s] > 0 and add_gain[s] > addv:
                addv = add_gain[s]
                add = s
        rem = -1
        remv = math.inf
        for s in range(A):
            if s != add and out[s] > 1 and rem_gain[s] < remv:
                remv = rem_gain[s]
                rem = s
        if rem < 0 or addv <= remv * (1.0 + 1e-12):
            break
        out[add] += 1
        out[rem] -= 1
        _gains(counts, out, add, add_gain, rem_gain)
        _gains(counts, out, rem, add_gain, rem_gain)


@njit(cache=True)
def _normalize_all(counts, out):  # pragma: no cover - numba
    for c in range(counts.shape[0]):
        _normalize_one(counts[c], out[c])


@njit(cache=True)
def _histogram(symbols, out):  # pragma: no cover - numba
    """out[c, :] += 256-bin histogram of symbols[c] (4 partial histograms to avoid store stalls)."""
    C, N = symbols.shape
    h = np.zeros((4, 256), dtype=np.int64)
    for c in range(C):
        h[:] = 0
        row = symbols[c]
        n4 = N & ~3
        for i in range(0, n4, 4):
            h[0, row[i]] += 1
            h[1, row[i + 1]] += 1
            h[2, row[i + 2]] += 1
            h[3, row[i + 3]] += 1
        for i in range(n4, N):
            h[0, row[i]] += 1
        for s in range(256):
            out[c, s] = h[0, s] + h[1, s] + h[2, s] + h[3, s]


def count_symbols(symbols: np.ndarray, alphabet: int | None = None) -> np.ndarray:
    """Histogram per context: symbols [C, N] uint8 -> counts [C, A] int64
    (``A`` defaults to max symbol + 1; symbols >= A are not counted)."""
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8)
    C, N = symbols.shape
    full = np.zeros((C, 256), dtype=np.int64)
    _histogram(symbols, full)
    if alphabet is None:
        present = np.flatnonzero(full.any(axis=0))
        alphabet = int(present[-1]) + 1 if present.size else 1
    return np.ascontiguousarray(full[:, :alphabet])


def normalize_freqs(counts: np.ndarray) -> np.ndarray:
    """12-bit frequency tables [C, A] (uint32, each row sums to 4096) from counts [C, A].

    A row with no symbols at all gets ``f_0 = 4096`` (any valid table will do).
    Deterministic; encoder-only (the decoder accepts any valid table).
    """
    counts = np.ascontiguousarray(np.asarray(counts, dtype=np.int64))
    if counts.ndim != 2 or counts.shape[1] < 1 or (counts < 0).any():
        raise KvcCodecError("rans: counts must be a non-negative [C, A] array with A >= 1")
    out = np.zeros(counts.shape, dtype=np.int64)
    _normalize_all(counts, out)
    empty = counts.sum(axis=1) == 0
    out[empty, 0] = PROB_SCALE
    return out.astype(np.uint32)


def cumulative(freqs: np.ndarray) -> np.ndarray:
    """Exclusive cumulative frequencies [C, A] of tables [C, A] (cum_0 = 0)."""
    cum = np.zeros(freqs.shape, dtype=np.uint32)
    np.cumsum(freqs[:, :-1], axis=1, out=cum[:, 1:])
    return cum


def empirical_entropy_bits(symbols: np.ndarray) -> np.ndarray:
    """Ideal code length in bits of each context of ``symbols`` [C, N] under its
    own empirical distribution: N * H(p_hat). Returns float64 [C]."""
    symbols = np.asarray(symbols)
    counts = count_symbols(symbols, 256).astype(np.float64)
    n = counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(counts > 0, counts * np.log2(np.where(counts > 0, n / counts, 1.0)), 0.0)
    return terms.sum(axis=1)


def table_code_length_bits(symbols: np.ndarray, freqs: np.ndarray) -> np.ndarray:
    """Ideal code length [C] of ``symbols`` [C, N] under 12-bit tables ``freqs``."""
    counts = count_symbols(symbols, freqs.shape[1]).astype(np.float64)
    f = freqs.astype(np.float64)
    with np.errstate(divide="ignore"):
        return np.where(counts > 0, counts * (PROB_BITS - np.log2(np.where(f > 0, f, 1))), 0.0).sum(axis=1)


# --------------------------------------------------------------------------- table banks (rans v2)

#: code length of a slot frequency f in 1/65536 bits, round(65536 * log2(4096 / f)) for f = 1..4096 (index 0:
#: impossible). Integer costs keep the bank choice identical on every machine (no BLAS summation order).
_COST_Q = np.concatenate(([0], np.round(np.log2(PROB_SCALE / np.arange(1, PROB_SCALE + 1)) * 65536))).astype(np.int64)
BANK_ITERATIONS = 10


@njit(cache=True)
def _block_hist(symbols, bsyms, nb, out):  # pragma: no cover - numba
    C, N = symbols.shape
    for c in range(C):
        row = symbols[c]
        for b in range(nb):
            o = out[c * nb + b]
            for i in range(b * bsyms, min(N, (b + 1) * bsyms)):
                o[row[i]] += 1


def block_counts(symbols: np.ndarray, block_symbols: int) -> np.ndarray:
    """Histograms [C * nb, 256] of each context's blocks of ``block_symbols`` symbols (the last may be short),
    context-major: row ``c * nb + b`` is block ``b`` of context ``c``; ``nb = ceil(N / block_symbols)`` (1 if N = 0)."""
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8)
    C, N = symbols.shape
    nb = max(1, -(-N // block_symbols))
    out = np.zeros((C * nb, 256), np.int64)
    _block_hist(symbols, block_symbols, nb, out)
    return out


@njit(cache=True)
def _kmeans_tables(hist, assign, k, iters, cost_q):  # pragma: no cover - numba
    """k-means of block histograms ``hist`` [n, A] under their exact code length (``cost_q``, integer) from the
    start ``assign`` [n] (updated in place). A table lacking one of a block's symbols is never chosen for it;
    ties go to the lowest table. Returns the final tables' counts [k, A]."""
    n, A = hist.shape
    counts = np.zeros((k, A), np.int64)
    freqs = np.zeros((k, A), np.int64)
    prev = np.zeros((k, A), np.int64)
    # each block's present symbols (a block of ~1K symbols uses a few dozen of the alphabet)
    nz_start = np.zeros(n + 1, np.int64)
    for i in range(n):
        nz_start[i + 1] = nz_start[i] + np.count_nonzero(hist[i])
    nz_sym = np.empty(nz_start[n], np.int64)
    nz_cnt = np.empty(nz_start[n], np.int64)
    for i in range(n):
        j = nz_start[i]
        for s in range(A):
            if hist[i, s]:
                nz_sym[j] = s
                nz_cnt[j] = hist[i, s]
                j += 1
    for it in range(iters + 1):
        counts[:] = 0
        for i in range(n):
            for j in range(nz_start[i], nz_start[i + 1]):
                counts[assign[i], nz_sym[j]] += nz_cnt[j]
        if it == iters:
            break
        for t in range(k):  # a table whose blocks did not change keeps its frequencies
            if it == 0 or (counts[t] != prev[t]).any():
                _normalize_one(counts[t], freqs[t])
        prev[:] = counts
        changed = False
        for i in range(n):
            best, best_t = -1, 0
            for t in range(k):
                c = 0
                ok = True
                for j in range(nz_start[i], nz_start[i + 1]):
                    f = freqs[t, nz_sym[j]]
                    if f == 0:
                        ok = False
                        break
                    c += nz_cnt[j] * cost_q[f]
                if ok and (best < 0 or c < best):
                    best, best_t = c, t
            if best_t != assign[i]:
                assign[i] = best_t
                changed = True
        if not changed:  # counts are those of this assignment
            break
    return counts


def learn_bank(symbols: np.ndarray, block_symbols: int, max_tables: int) -> tuple[np.ndarray, np.ndarray]:
    """A bank of at most ``max_tables`` 12-bit tables and each (context, block)'s table, for a rans v2 stream.

    Encoder-only (spec/rans-v2.md leaves the choice free): k-means of the block histograms under their exact
    code length (:func:`_kmeans_tables`), started from ``max_tables`` groups of equal size ranked by mean symbol
    (a scale proxy, so the start is deterministic), at most :data:`BANK_ITERATIONS` rounds; each table is
    :func:`normalize_freqs` of its blocks' summed counts, so every symbol of a block has a nonzero frequency in
    the block's table. Unused tables are dropped, then tables are merged while that shortens the stream (their
    LEB128 bytes counted: :func:`_merge_tables`). Returns (freqs uint32 [K, A] with ``A`` = max symbol + 1,
    table_of uint8 [C, nb]).
    """
    symbols = np.ascontiguousarray(symbols, dtype=np.uint8)
    C, N = symbols.shape
    nb = max(1, -(-N // block_symbols))
    if C == 0 or N == 0:  # no symbols: one table (f_0 = 4096), used by every (empty) block
        return normalize_freqs(np.zeros((1, 1), np.int64)), np.zeros((C, nb), np.uint8)
    hist = block_counts(symbols, block_symbols)
    A = int(np.flatnonzero(hist.any(axis=0))[-1]) + 1
    hist = np.ascontiguousarray(hist[:, :A])
    n = hist.shape[0]
    k = max(1, min(int(max_tables), n))
    mean_q = (hist * np.arange(A, dtype=np.int64)).sum(axis=1) * 4096 // hist.sum(axis=1)
    rank = np.empty(n, np.int64)
    rank[np.argsort(mean_q, kind="stable")] = np.arange(n)
    assign = np.minimum(rank * k // n, k - 1)
    counts = _kmeans_tables(hist, assign, k, BANK_ITERATIONS, _COST_Q)
    label = _merge_tables(counts, _COST_Q)  # table t of the k-means -> its table in the bank
    merged = np.zeros((int(label.max()) + 1, A), np.int64)
    np.add.at(merged, label, counts)
    return normalize_freqs(merged), label[assign].astype(np.uint8).reshape(C, nb)


@njit(cache=True)
def _table_cost(counts, f, cost_q):  # pragma: no cover - numba
    """Bits x 65536 of coding ``counts`` [A] with their own 12-bit table (written into ``f``), plus the table's
    LEB128 bytes."""
    _normalize_one(counts, f)
    c = 0
    for s in range(counts.shape[0]):
        c += counts[s] * cost_q[f[s]] + (16 if f[s] >= 128 else 8) * 65536
    return c


@njit(cache=True)
def _union_cost(sums, i, j, tmp, f, cost_q):  # pragma: no cover - numba
    """:func:`_table_cost` of tables ``i`` and ``j`` of ``sums`` merged (``tmp``, ``f``: scratch [A])."""
    for s in range(sums.shape[1]):
        tmp[s] = sums[i, s] + sums[j, s]
    return _table_cost(tmp, f, cost_q)


@njit(cache=True)
def _merge_tables(counts, cost_q):  # pragma: no cover - numba
    """Merge the k-means tables greedily (the pair whose union costs least more) down to one, and keep the bank
    size whose stream is shortest: a table costs its bytes, so a small chunk wants fewer tables than a large one.
    Empty tables are dropped. Returns each k-means table's index in the kept bank (tables numbered by their
    first k-means table)."""
    k, A = counts.shape
    f = np.zeros(A, np.int64)
    group = np.arange(k)  # k-means table -> the live table it was merged into
    live = np.zeros(k, np.bool_)
    sums = counts.copy()
    cost = np.zeros(k, np.int64)
    for t in range(k):
        if counts[t].sum() > 0:
            live[t] = True
            cost[t] = _table_cost(sums[t], f, cost_q)
    best_total = cost.sum()
    best = group.copy()
    tmp = np.zeros(A, np.int64)
    union = np.zeros((k, k), np.int64)  # union[i, j], i < j: the cost of live tables i and j merged
    for i in range(k):
        for j in range(i + 1, k):
            if live[i] and live[j]:
                union[i, j] = _union_cost(sums, i, j, tmp, f, cost_q)
    while live.sum() > 1:
        bi, bj, bd, bu = -1, -1, 0, 0
        for i in range(k):
            if not live[i]:
                continue
            for j in range(i + 1, k):
                if not live[j]:
                    continue
                u = union[i, j]
                d = u - cost[i] - cost[j]
                if bi < 0 or d < bd:
                    bi, bj, bd, bu = i, j, d, u
        for s in range(A):
            sums[bi, s] += sums[bj, s]
        cost[bi], cost[bj], live[bj] = bu, 0, False
        for t in range(k):  # only the pairs with the grown table change
            if live[t] and t != bi:
                union[min(t, bi), max(t, bi)] = _union_cost(sums, min(t, bi), max(t, bi), tmp, f, cost_q)
        for t in range(k):
            if group[t] == bj:
                group[t] = bi
        if cost.sum() < best_total:
            best_total = cost.sum()
            best = group.copy()
    # number the kept tables 0.. in order of their first k-means table
    label = np.full(k, -1, np.int64)
    nxt = 0
    for t in range(k):
        if counts[best[t]].sum() == 0 and counts[t].sum() == 0:
            continue
        r = best[t]
        if label[r] < 0:
            label[r] = nxt
            nxt += 1
    out = np.zeros(k, np.int64)
    for t in range(k):
        out[t] = label[best[t]] if label[best[t]] >= 0 else 0
    return out
