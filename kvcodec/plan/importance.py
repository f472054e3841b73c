"""Per-(layer, token) importance of a context's KV entries, mapped to the step classes of token-weighted quantization.

Why: with attention output ``o = sum_t a_t v_t``, independent coding noise of
power ``s_t^2`` on value ``v_t`` adds ``sum_t a_t^2 s_t^2`` to the output error
(and noise on key ``k_t`` perturbs logit t, whose effect on ``o`` is again
proportional to ``a_t``). So the distortion a token's coding noise causes is
weighted by ``E_q[a_{q,t}^2]`` over the queries that will read it; attention is
extremely concentrated, so most tokens can be coded much more coarsely.
Minimising ``sum_t w_t step_t^2`` at a fixed rate ``-sum_t log step_t`` gives
``step_t ∝ w_t^{-1/2}`` (high-rate theory); :func:`token_multipliers` maps that
to a few log2 classes (the ``tokenscale`` stage, spec/codec-v1.md).

The importance itself (the last ``window`` queries' attention over the cache, one forward pass of the
model) is measured by :mod:`kvcodec.models.importance`; this module maps it to step classes.
"""

from __future__ import annotations

import numpy as np

from kvcodec.errors import KvcInputError


def floored(w: np.ndarray, floor: float) -> np.ndarray:
    """``w`` normalised to sum 1, with ``floor`` of the total spread uniformly: ``(1 - floor) w / sum w + floor / n``."""
    w = np.maximum(np.asarray(w, np.float64), 0.0)
    if not 0.0 <= floor < 1.0:
        raise KvcInputError(f"tokenscale floor must be in [0, 1), got {floor!r}")
    n, total = w.size, float(w.sum())
    if n == 0:
        return w
    if total <= 0:
        return np.full(n, 1.0 / n)
    return (1.0 - floor) * w / total + floor / n


def token_multipliers(w: np.ndarray, sink: int, n_classes: int = 16, log2_step: float = 0.5,
                      min_log2: float = -2.0, power: float = 0.5, max_log2: float | None = None,
                      floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Step-multiplier classes of the coded tokens (tokens >= ``sink``) of one layer.

    ``w`` [T]: importance. Ideal multiplier ``m_t = (w_t / w_ref)^-power``,
    ``w_ref`` chosen so the importance-weighted noise power equals that of a
    uniform step (``sum w m^2 = sum w`` over coded tokens): the ``step0`` knob
    keeps its meaning. ``log2 m`` is rounded to multiples of ``log2_step`` and
    clamped to ``[min_log2, min(max_log2, min_log2 + (n_classes-1) log2_step)]``.
    ``floor`` > 0 first spreads that fraction of the coded tokens' importance uniformly (:func:`floored`).
    Returns (classes uint8 [T - sink], table float32 [n_classes]: 2**(min_log2 + c*log2_step)).
    """
    w = np.asarray(w, np.float64)[sink:]
    if floor:
        w = floored(w, floor)
    w = np.maximum(w, 1e-30)
    if max_log2 is not None:
        n_classes = max(1, min(n_classes, int(np.floor((max_log2 - min_log2) / log2_step + 1e-9)) + 1))
    table_l2 = min_log2 + log2_step * np.arange(n_classes)
    table = np.exp2(table_l2).astype(np.float32)
    if w.size == 0:
        return np.zeros(0, np.uint8), table
    lw = np.log2(w)

    def classes(lref: float) -> np.ndarray:
        l2 = -power * (lw - lref)
        return np.clip(np.rint((l2 - min_log2) / log2_step), 0, n_classes - 1).astype(np.int64)

    # sum w m^2 increases with lref: bisect for sum w m^2 = sum w
    lo, hi = float(lw.min()) - 40.0, float(lw.max()) + 40.0
    target = w.sum()
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        m = table[classes(mid)].astype(np.float64)
        if (w * m * m).sum() > target:
            hi = mid
        else:
            lo = mid
    return classes(lo).astype(np.uint8), table
