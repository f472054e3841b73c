"""The calibration's math: streamed second moments and (block-)weighted PCA. Pure numpy, no model."""

from __future__ import annotations


import numpy as np

from kvcodec.codecs.blocks import channel_blocks

class Moments:
    """Running first and second moments of pre-RoPE K/V per (layer, kind, kv head), tokens >= sink.

    Accumulated capture by capture, in float64 sums, so the PCA needs no concatenation of the captures.
    """

    def __init__(self, L: int, H: int, D: int) -> None:
        self.n = np.zeros((L, 2))
        self.s1 = np.zeros((L, 2, H, D))
        self.s2 = np.zeros((L, 2, H, D, D))

    def add(self, layer: int, kind: int, x: np.ndarray) -> None:
        """Accumulate one layer's K (kind 0) or V (kind 1) samples, ``x`` [H, T, D] as the plans code them."""
        x = x.astype(np.float64)
        self.n[layer, kind] += x.shape[1]
        self.s1[layer, kind] += x.sum(axis=1)
        self.s2[layer, kind] += np.einsum("htd,hte->hde", x, x, optimize=True)


def compute_pca(mom: Moments, metrics: np.ndarray | None = None,
                blocks: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(basis fp16 [L,2,H,D,D], mean fp32 [L,2,H,D], eigval fp32 [L,2,H,D]) from accumulated moments.

    With ``metrics`` M [L,2,H,D,D] the PCA is done in the weighted space z = M^(1/2) x:
    basis = M^(-1/2) V (not orthonormal), so a uniform error on the coefficients
    is a uniform error in the metric (e.g. attention-output) space.

    Block-diagonal over ``blocks`` (default :func:`kvcodec.codecs.blocks.channel_blocks`, one block
    up to head_dim 64; ``[(0, D)]`` is one PCA over the whole head): each
    column is a PCA direction of one channel block, in that block's metric M_bb (errors of
    different blocks' coefficients are independent, so M's cross terms add nothing in
    expectation), and the columns of all blocks are ordered by decreasing variance. Why: the
    inverse transform then costs a block's width per coefficient instead of the head's
    (decode at head_dim 256 ran at half the speed of 64); the price is the correlation
    between blocks the basis no longer removes (BENCHMARKS.md, "Block-diagonal bases").
    All (layer, kind, head) blocks go through one batched eigh: thousands of tiny LAPACK
    calls cost more in dispatch and BLAS thread hand-offs than in maths.
    """
    mean = mom.s1 / mom.n[:, :, None, None]
    cov = mom.s2 / mom.n[:, :, None, None, None] - mean[..., :, None] * mean[..., None, :]
    basis, eig = block_pca(cov, metrics, blocks)
    return basis.astype(np.float16), mean.astype(np.float32), np.maximum(eig, 0).astype(np.float32)


def block_pca(cov: np.ndarray, metrics: np.ndarray | None = None,
              blocks: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(basis [..., D, D], variances [..., D]) of covariances ``cov`` [..., D, D]: the weighted PCA of
    :func:`_weighted_pca` per channel block (default :func:`kvcodec.codecs.blocks.channel_blocks`), each
    column nonzero on its block only, the columns of all blocks by decreasing variance (see
    :func:`compute_pca`; benchmarks and tests build their bases with it too)."""
    D = cov.shape[-1]
    basis = np.zeros(cov.shape)
    eig = np.zeros(cov.shape[:-1])
    col = 0
    for c0, c1 in channel_blocks(D) if blocks is None else blocks:
        v, w = _weighted_pca(cov[..., c0:c1, c0:c1], None if metrics is None else metrics[..., c0:c1, c0:c1])
        basis[..., c0:c1, col : col + c1 - c0] = v
        eig[..., col : col + c1 - c0] = w
        col += c1 - c0
    order = np.argsort(-eig, axis=-1, kind="stable")  # the identity for one block: eigh's order, reversed
    return np.take_along_axis(basis, order[..., None, :], axis=-1), np.take_along_axis(eig, order, axis=-1)


def _weighted_pca(cov: np.ndarray, metrics: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(basis [..., d, d] = M^(-1/2) V, variances [..., d]) of covariances ``cov`` [..., d, d] in the metric
    ``metrics`` (None: identity), columns by decreasing variance, each column's largest-magnitude entry positive."""
    if metrics is not None:
        mw, mv = np.linalg.eigh(metrics)
        S = (mv * np.sqrt(mw)[..., None, :]) @ np.swapaxes(mv, -1, -2)
        Si = (mv / np.sqrt(mw)[..., None, :]) @ np.swapaxes(mv, -1, -2)
        cov = S @ cov @ S
    w, v = np.linalg.eigh((cov + np.swapaxes(cov, -1, -2)) / 2)
    w, v = w[..., ::-1], v[..., ::-1]  # decreasing variance (eigh returns ascending)
    # deterministic sign: largest-magnitude entry of each column positive
    idx = np.argmax(np.abs(v), axis=-2)[..., None, :]
    sgn = np.sign(np.take_along_axis(v, idx, axis=-2))
    v = v * np.where(sgn == 0, 1, sgn)
    if metrics is not None:
        v = Si @ v
    return v, w


COLUMN_WEIGHTING = "fisher-coefficient-v1"  # metadata "column_weighting" of a calibration built with fisher_weighted
WEIGHT_FLOOR = 1e-4  # smallest column weight: a column no continuation reads is scaled by at most 100, not infinitely


def fisher_weighted(basis: np.ndarray, eigval: np.ndarray, csens: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(basis [L,2,H,D,K], eigval [L,2,H,K], sensitivity [L,2]) with each column scaled to its measured sensitivity.

    ``csens`` [L,2,H,K] is the KL per unit noise power on each coefficient of the unscaled ``basis``
    (:func:`kvcodec.calibration.build.coefficient_sensitivity`). Why: the plans quantize every coefficient of a
    (layer, kind) with one step, which is the rate-distortion optimum only when every coefficient costs the same
    KL per unit error (equal slopes: step ~ 1 / sqrt(sensitivity) for entropy-coded uniform quantizers). The
    attention metric the PCA whitens by (:func:`compute_pca`) makes the coefficients of one head roughly equal,
    but it is normalised per head and only a proxy: measured, coefficients of one layer differ by 2-60x (SmolLM2,
    heads alone). Scaling column ``d`` by ``1/sqrt(f_d)``, ``f = csens / mean(csens)`` over the layer's (head,
    coefficient), makes its coefficient ``sqrt(f_d)`` times larger, so the one step is finer where the model
    is sensitive and coarser where it is not: per-coefficient, per-head bit allocation with no decoder change
    (the basis is the decoder's, whatever its scale).

    The returned sensitivity is the layer's sum of ``csens``: then a coefficient-domain error of mean power N per
    element costs KL ``sens * N`` whatever column it falls on (what :mod:`kvcodec.plan.ratecontrol` predicts with).
    Columns are re-sorted by decreasing weighted variance, since the transform keeps the first ``k``.
    """
    c = np.maximum(np.asarray(csens, np.float64), 0.0)
    cbar = c.mean(axis=(-1, -2), keepdims=True)
    f = np.where(cbar > 0, np.maximum(c / np.where(cbar > 0, cbar, 1.0), WEIGHT_FLOOR), 1.0)
    b = np.asarray(basis, np.float64) / np.sqrt(f)[..., None, :]
    e = np.asarray(eigval, np.float64) * f
    order = np.argsort(-e, axis=-1, kind="stable")
    b = np.take_along_axis(b, order[..., None, :], axis=-1)
    e = np.take_along_axis(e, order, axis=-1)
    return b, e.astype(np.float32), c.sum(axis=(-1, -2)).astype(np.float32)
