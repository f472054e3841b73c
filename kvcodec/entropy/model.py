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

__all__ = ["count_symbols", "normalize_freqs", "cumulative", "empirical_entropy_bits", "table_code_length_bits"]


@njit(cache=True)
def _normalize_one(counts, out):  # pragma: no cover - numba
    """Fill ``out`` (int64[A]) with a 12-bit table for ``counts`` (int64[A]).

    Every present symbol gets >= 1; the result maximises sum(c_s * log f_s)
    (= minimises the ideal code length) subject to sum(f) = 4096 and f_s >= 1
    for present symbols: proportional start, greedy +-1 fix-up of the sum,
    then 1-unit exchanges while one strictly shortens the code. Ties go to
    the lowest symbol index, so the result is deterministic.
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
    # fix the sum: add where the gain is largest / remove where the loss is smallest
    while fsum < PROB_SCALE:
        best = -1
        bestv = -1.0
        for s in range(A):
            if counts[s] > 0:
                v = counts[s] * math.log((out[s] + 1) / out[s])
                if v > bestv:
                    bestv = v
                    best = s
        out[best] += 1
        fsum += 1
    while fsum > PROB_SCALE:
        best = -1
        bestv = math.inf
        for s in range(A):
            if out[s] > 1:
                v = counts[s] * math.log(out[s] / (out[s] - 1))
                if v < bestv:
                    bestv = v
                    best = s
        out[best] -= 1
        fsum -= 1
    # exchange 1 unit while it strictly helps (objective strictly increases -> terminates)
    for _ in range(4 * PROB_SCALE):
        # best unit to add; best unit to take from any *other* symbol. If some
        # move t <- s helps, so does add <- s (gain(add) >= gain(t)), and s != add
        # because loss(s) > gain(s) for every s: so this test is exhaustive.
        add = -1
        addv = -1.0
        for s in range(A):
            if counts[s] > 0:
                v = counts[s] * math.log((out[s] + 1) / out[s])
                if v > addv:
                    addv = v
                    add = s
        rem = -1
        remv = math.inf
        for s in range(A):
            if s != add and out[s] > 1:
                w = counts[s] * math.log(out[s] / (out[s] - 1))
                if w < remv:
                    remv = w
                    rem = s
        if rem < 0 or addv <= remv * (1.0 + 1e-12):
            break
        out[add] += 1
        out[rem] -= 1


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
