"""The quantize stage's error, predicted without coding: what rate control (:mod:`kvcodec.plan.ratecontrol`)
sums over a cache's transform coefficients for every candidate step.

It mirrors :class:`kvcodec.codecs.quantize.QuantizeStage` (round half to even, or the deadzone's floor, and the
step of a (head, coefficient) widened where its range would not fit ``max_bits``), so it lives beside the codecs:
arrays in, error power out; the planner supplies the coefficients and the steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit


@dataclass
class Coefficients:
    """One cache's full-basis transform coefficients per (layer, kind), and what weights their tokens.

    ``y[l][k]``: float32 [H, T', D] coefficients of the coded tokens (sink excluded; a strided
    subsample when ``stride`` > 1); ``w[l]``: float64 [T'] token weights summing to 1.
    Computed once per encode: every candidate step reuses them.
    """

    y: list[list[np.ndarray]]
    w: list[np.ndarray]
    token_index: list[np.ndarray]  # absolute token index of each column of y[l][*] (for tokenscale classes)


@njit(cache=True, nogil=True)
def _coded_noise(z, k, st, omega, deadzone):  # pragma: no cover - numba
    """sum_t omega[t] sum_{h, d < k} ((r - q) st[h, d])^2 with r = z[h, t, d] / st[h, d] and q its quantisation
    (round half to even, or the deadzone's floor(|r| + 0.5 - deadzone)), in the quantize stage's float32."""
    H, T, _ = z.shape
    half = np.float32(0.5 - deadzone)
    tot = 0.0
    for t in range(T):
        acc = 0.0
        for h in range(H):
            for d in range(k):
                s = st[h, d]
                r = z[h, t, d] / s
                if deadzone != 0.0:
                    a = np.floor(abs(r) + half)
                    q = a if r >= 0 else -a
                else:
                    q = np.rint(r)
                e = np.float64((r - q) * s)
                acc += e * e
        tot += omega[t] * acc
    return tot


@dataclass
class NoiseModel:
    """The step-independent part of :func:`noise_power` for one set of coefficients and tokenscale multipliers,
    prepared once so that each candidate step of the search costs one pass over the coefficients.

    Per (layer, kind): ``z`` float32 [H, T', D] (the coefficients over their token's multiplier, what the
    quantizer rounds), ``amax`` [H, D] (max over tokens of ``|z|``: the range that widens a step),
    ``omega`` float64 [T'] (token weight x multiplier^2: the weight of a token's rounding error) and
    ``dropped`` float64 [D + 1] (weighted power of the coefficients from ``k`` on, for every ``k``: what
    dropping them costs).
    """

    z: list[list[np.ndarray]]
    amax: list[list[np.ndarray]]
    omega: list[list[np.ndarray]]
    dropped: list[list[np.ndarray]]

    @classmethod
    def prepare(cls, co: Coefficients, multipliers: list[np.ndarray] | None = None, kinds: str = "kv") -> "NoiseModel":
        zs, amaxs, omegas, drops = [], [], [], []
        for l in range(len(co.y)):
            ml = None if multipliers is None else multipliers[l][co.token_index[l]].astype(np.float32)
            zr, ar, orow, dr = [], [], [], []
            for ki in range(2):
                m = ml if "kv"[ki] in kinds else None
                y = co.y[l][ki]
                z = np.ascontiguousarray(y if m is None else y / m[None, :, None], np.float32)
                w = co.w[l]
                zr.append(z)
                ar.append(np.abs(z).max(axis=1) if z.shape[1] else np.zeros(z.shape[::2], np.float32))
                orow.append(w if m is None else w * m.astype(np.float64) ** 2)
                col = np.einsum("htd,t->d", y.astype(np.float64) ** 2, w) if y.shape[1] else np.zeros(y.shape[2])
                dr.append(np.concatenate([np.cumsum(col[::-1])[::-1], [0.0]]))
            zs.append(zr)
            amaxs.append(ar)
            omegas.append(orow)
            drops.append(dr)
        return cls(zs, amaxs, omegas, drops)

    def power(self, steps: np.ndarray, kept: np.ndarray, max_bits: int, deadzone: float = 0.0) -> np.ndarray:
        """Weighted coefficient-domain error power per element [L, 2] at ``steps`` [L, 2] (:func:`noise_power`)."""
        L = len(self.z)
        out = np.zeros((L, 2))
        lim = (1 << (max_bits - 1)) - 1
        for l in range(L):
            for ki in range(2):
                z = self.z[l][ki]
                H, T, D = z.shape
                if T == 0:
                    continue
                k = int(kept[l, ki])
                st = np.ascontiguousarray(np.maximum(np.float32(steps[l, ki]), self.amax[l][ki][:, :k] / (lim + 0.49)), np.float32)
                coded = _coded_noise(z, k, st, self.omega[l][ki], float(deadzone)) if k else 0.0
                out[l, ki] = (coded + float(self.dropped[l][ki][k])) / (H * D)
        return out


def noise_power(co: Coefficients, steps: np.ndarray, kept: np.ndarray, max_bits: int,
                multipliers: list[np.ndarray] | None = None, deadzone: float = 0.0, kinds: str = "kv") -> np.ndarray:
    """Weighted coefficient-domain error power per element [L, 2] of quantising ``co`` at ``steps`` [L, 2].

    ``kept`` [L, 2]: coefficients coded (the rest are dropped: their error is their value);
    ``multipliers[l]``: tokenscale's step multiplier per token of layer ``l`` (None: 1), indexed
    by absolute token. Mirrors the quantize stage: the step of a (head, coefficient) widens to
    ``amax / (2**(max_bits-1) - 0.51)`` where its range would not fit ``max_bits``.
    """
    return NoiseModel.prepare(co, multipliers, kinds).power(steps, kept, max_bits, deadzone)
