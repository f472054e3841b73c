"""numba encoder hot spots of the lossy stages (encode side only; output bit-identical to the numpy code
they replace, so the golden vectors still match byte for byte).

* :func:`rope_unrotate` -- ``RopeStage.encode``: float64 ``x*cos - rotate_half(x)*sin`` rounded once to
  float32, with the float64 cos/sin tables cached per (positions, theta, dim);
* :func:`quantize_step_symbols` -- ``QuantizeStage._enc_step`` (deadzone 0): ``q = clip(rint(x / step))``,
  zigzag symbols, per-channel max(|q|) and non-zero flags in one pass.

No fastmath: every product / sum / quotient rounds exactly as in numpy.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from numba import njit

from kvcodec.codecs.common import float32_copy
from kvcodec.lru import BoundedLRU
from kvcodec.codecs.rope_tables import inv_freq, rope_angles

_TABLES64: BoundedLRU[tuple] = BoundedLRU(32)


def rope_tables64(pos: np.ndarray, theta: float, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 cos, sin [Hp, T, dim] (Hp = 1 when the positions are shared by all heads), cached.
    The angles are :func:`kvcodec.codecs.rope_tables.rope_angles` (the stage's own), kept in float64."""
    p = np.asarray(pos)
    if p.ndim == 2 and p.shape[0] > 1 and (p == p[:1]).all():
        p = p[:1]
    if p.ndim == 1:
        p = p[None, :]
    p = np.ascontiguousarray(p, dtype=np.int64)
    key = (p.shape, p.tobytes(), float(theta), int(dim))
    hit = _TABLES64.get(key)
    if hit is None:
        ang = rope_angles(p, inv_freq(theta, dim))
        c, s = np.cos(ang), np.sin(ang)
        c.flags.writeable = False
        s.flags.writeable = False
        hit = (c, s)
        _TABLES64.put(key, hit)
    return hit


@njit(cache=True, nogil=True)
def _rope_unrotate(x, c, s, dim, out):  # pragma: no cover - numba
    H, T, D = x.shape
    half = dim // 2
    for h in range(H):
        hc = h if c.shape[0] > 1 else 0
        for t in range(T):
            for d in range(half):
                v = np.float64(x[h, t, d]) * c[hc, t, d] - (-np.float64(x[h, t, d + half])) * s[hc, t, d]
                out[h, t, d] = np.float32(v)
            for d in range(half, dim):
                v = np.float64(x[h, t, d]) * c[hc, t, d] - np.float64(x[h, t, d - half]) * s[hc, t, d]
                out[h, t, d] = np.float32(v)
            for d in range(dim, D):
                out[h, t, d] = np.float32(np.float64(x[h, t, d]))


def rope_unrotate(arr: np.ndarray, pos: np.ndarray, theta: float, dim: int) -> np.ndarray:
    """float32 [H, T, D]: RoPE by -angle of ``arr`` (float16/float32), exactly ``RopeStage.encode``'s numpy result."""
    c, s = rope_tables64(pos, theta, dim)
    out = np.empty(arr.shape, np.float32)
    x = float32_copy(arr)  # float16 -> float32 -> float64 are exact
    _rope_unrotate(x, c, s, dim, out)
    return out


@njit(cache=True, nogil=True)
def _quantize_step(x, st, lim, sym, qmax, nz):  # pragma: no cover - numba
    # Branch-free inner loop (selects, integer zigzag, an OR for "any non-zero") so LLVM vectorises it: 5x the
    # speed of the per-element branches it replaces, same bits on finite input (the stage refuses NaN/inf first).
    H, T, C = x.shape
    lo = np.float32(-lim - 1)
    hi = np.float32(lim)
    ored = np.zeros(C, np.int32)
    for h in range(H):
        mx = qmax[h]
        s = st[h]
        for c in range(C):
            mx[c] = 0
            ored[c] = 0
        for t in range(T):
            xr = x[h, t]
            out = sym[h, t]
            for c in range(C):
                r = np.rint(xr[c] / s[c])
                r = lo if r < lo else r
                r = hi if r > hi else r
                q = np.int32(r)
                ored[c] |= q
                m = q ^ (q >> 31)  # max(q, -q-1)
                mx[c] = m if m > mx[c] else mx[c]
                out[c] = (q << 1) ^ (q >> 31)  # zigzag; < 2**(bits of lim + 1): fits sym's dtype
        for c in range(C):
            nz[h, c] = ored[c] != 0


def quantize_step_symbols(x: np.ndarray, st: np.ndarray, lim: int, sym_dtype: Any = np.uint8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(zigzag symbols ``sym_dtype`` [H, T, C], max(q, -q-1) int32 [H, C], any(q != 0) bool [H, C]) of
    ``q = clip(rint(x / st), -lim-1, lim)``; x float32 [H, T, C], st float32 [H, C]; ``2 * lim + 1`` must fit ``sym_dtype``."""
    H, T, C = x.shape
    sym = np.empty((H, T, C), sym_dtype)
    qmax = np.zeros((H, C), np.int32)
    nz = np.zeros((H, C), np.bool_)
    _quantize_step(np.ascontiguousarray(x, dtype=np.float32), np.ascontiguousarray(st, dtype=np.float32), int(lim), sym, qmax, nz)
    return sym, qmax, nz
