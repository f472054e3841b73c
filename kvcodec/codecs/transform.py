"""The ``transform`` stage (spec/codec-v1.md): an orthonormal decorrelation of each head's channels, a PCA basis
from an attachment (the model's calibration) or a Hadamard matrix.

Each decode is also a pure function of arrays (``transform_decode``) so every decoder can be compared with
it bit for bit: float32 products and sums, each rounded separately, in the spec's order."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from kvcodec.codecs.common import FLOATS, KIND_INDEX, check3, int_param, no_extra
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register
from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.lru import BoundedLRU, weak

_PROJ: BoundedLRU[tuple] = BoundedLRU(256)


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix float32 [n, n] (n a power of two); entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise KvcCodecError(f"hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


@njit(cache=True, nogil=True)
def _inv_transform_nb(y, bt, mean, out):  # pragma: no cover - numba
    # y [H, N, K], bt [H, K, D], mean [H, D], out [H, N, D]; no fastmath: no contraction.
    # Each output element is the definition's sequence (0.0, then + y*b for k ascending, then + mean); the
    # channel loop is innermost so that LLVM vectorises across channels (the writer runs this on the first
    # chunk of every lossy structure: with k innermost it was 1/6 of a Gemma 3 encode).
    H, N, K = y.shape
    D = bt.shape[2]
    acc = np.empty(D, np.float32)
    for h in range(H):
        for n in range(N):
            for d in range(D):
                acc[d] = np.float32(0.0)
            for k in range(K):
                yk = y[h, n, k]
                for d in range(D):
                    acc[d] = acc[d] + yk * bt[h, k, d]
            for d in range(D):
                out[h, n, d] = acc[d] + mean[h, d]


def transform_decode(y: np.ndarray, basis: np.ndarray, mean: np.ndarray, fast: bool = True) -> np.ndarray:
    """x[h, t, d] = (sum_{k=0..K-1} y[h,t,k] * B[h,d,k]) + mean[h,d], float32, k ascending.

    y float32 [H, T, K]; basis float32 [H, D, K] (columns = basis vectors);
    mean float32 [H, D]. acc starts at +0.0; each product and each add is a
    separately rounded float32 op; the mean is added last.
    ``fast=False`` runs the numpy reference loop (the definition).
    """
    y = np.ascontiguousarray(y, dtype=np.float32)
    bt = np.ascontiguousarray(np.swapaxes(basis.astype(np.float32), 1, 2))  # [H, K, D]
    mean = np.ascontiguousarray(mean, dtype=np.float32)
    H, T, K = y.shape
    D = bt.shape[2]
    if fast:
        out = np.empty((H, T, D), dtype=np.float32)
        _inv_transform_nb(y, bt, mean, out)
        return out
    acc: np.ndarray = np.zeros((H, T, D), dtype=np.float32)
    for k in range(K):
        acc = acc + y[:, :, k : k + 1] * bt[:, k : k + 1, :]
    return acc + mean[:, None, :]


@register
class TransformStage(ArrayToArray):
    """Orthonormal transform, keeping the first ``k`` coefficients.

    Config: ``basis`` = "hadamard" (fixed, no mean) or "pca" (attachments
    ``<attachment>.basis`` [2L, H, D, Kb] and ``<attachment>.mean`` [2L, H, D],
    float16 or float32, row 2*layer + (0 for k, 1 for v)); ``k`` <= Kb.
    """

    name = "transform"
    version = 1

    def __init__(self, basis: str = "pca", k: int | None = None, attachment: str = "pca") -> None:
        if basis not in ("pca", "hadamard"):
            raise KvcCodecError(f"codec 'transform': basis must be 'pca' or 'hadamard', got {basis!r}")
        self.basis = basis
        self.k = None if k is None else int_param(k, "k", "transform", 1, 1 << 16)
        if not isinstance(attachment, str) or not attachment:
            raise KvcCodecError("codec 'transform': attachment must be a non-empty string")
        self.attachment = attachment

    def get_config(self) -> dict[str, Any]:
        c: dict[str, Any] = {"basis": self.basis, "k": self.k}
        if self.basis == "pca":
            c["attachment"] = self.attachment
        return c

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        H, T, D = spec.shape
        return ArraySpec((H, T, D if self.k is None else self.k), "float32")

    def matrices(self, H: int, D: int, ctx: ChunkContext) -> tuple[np.ndarray, np.ndarray]:
        """(basis float32 [H, D, K], mean float32 [H, D]) for this chunk; validates attachments."""
        K = D if self.k is None else self.k
        if K > D:
            raise KvcFormatError(f"codec 'transform': k={K} exceeds {D} channels")
        if self.basis == "hadamard":
            b = np.broadcast_to(hadamard(D)[:, :K], (H, D, K))
            return np.ascontiguousarray(b), np.zeros((H, D), np.float32)
        nb, nm = f"{self.attachment}.basis", f"{self.attachment}.mean"
        att = ctx.attachments  # stored and external alike (the writer passes the external arrays it encodes with)
        if nb not in att or nm not in att:
            raise KvcFormatError(f"codec 'transform': attachment {nb!r} or {nm!r} is missing")
        B, M = np.asarray(att[nb]), np.asarray(att[nm])
        if B.dtype.name not in FLOATS or M.dtype.name not in FLOATS:
            raise KvcFormatError(f"codec 'transform': attachments must be float16/float32, got {B.dtype}/{M.dtype}")
        if B.ndim != 4 or B.shape[2] != D or B.shape[1] < H or B.shape[3] < K or 2 * ctx.layer + 1 >= B.shape[0]:
            raise KvcFormatError(f"codec 'transform': basis attachment {B.shape} does not fit layer {ctx.layer}, {H} heads, {D} channels, k={K}")
        if M.shape != B.shape[:3]:
            raise KvcFormatError(f"codec 'transform': mean attachment {M.shape}, expected {B.shape[:3]}")
        kind = KIND_INDEX.get(ctx.kind)
        if kind is None:
            raise KvcFormatError(f"codec 'transform': unknown tensor kind {ctx.kind!r}")
        row = 2 * ctx.layer + kind
        h0 = int(ctx.extra.get("head_start", 0))
        if h0 < 0 or h0 + H > B.shape[1]:
            raise KvcFormatError(f"codec 'transform': heads {h0}..{h0 + H} outside the basis attachment")
        b = B[row, h0 : h0 + H, :, :K].astype(np.float32)
        m = M[row, h0 : h0 + H].astype(np.float32)
        if not (np.isfinite(b).all() and np.isfinite(m).all()):
            raise KvcFormatError("codec 'transform': basis or mean contains NaN or inf")
        return b, m

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        check3(arr, "transform", FLOATS)
        H, T, D = arr.shape
        proj, m = self._projection(H, D, ctx)
        y = np.matmul(arr.astype(np.float32) - m[:, None, :], proj)
        return y.astype(np.float32), {}

    def _projection(self, H: int, D: int, ctx: ChunkContext) -> tuple[np.ndarray, np.ndarray]:
        """(float32 [H, D, K] least-squares projection, float32 [H, D] mean) of this chunk's basis block.

        The coefficients for the (fp16-rounded, slightly non-orthonormal) basis are
        ``y = (x - m) B (B^T B)^-1``, so that decode(encode(x)) is as close to x as the basis allows.
        The projection depends only on the calibration, so it is cached per attachment arrays and block
        (weak references, as the fused decoder's matrices): every chunk of every file of a model reuses
        it (the inverse was a third of a whole encode at head_dim 256).
        """
        K = D if self.k is None else self.k
        B = ctx.attachments.get(f"{self.attachment}.basis") if self.basis != "hadamard" else None
        M = ctx.attachments.get(f"{self.attachment}.mean") if self.basis != "hadamard" else None
        key = (self.basis, id(B), id(M), ctx.layer, ctx.kind, int(ctx.extra.get("head_start", 0)), H, D, K)
        ref = () if B is None else (B, M)
        hit = _PROJ.get(key)
        if hit is not None and all(w() is a for w, a in zip(hit[2], ref)):
            return hit[0], hit[1]
        b, m = self.matrices(H, D, ctx)  # validates (raises KvcFormatError)
        b64 = b.astype(np.float64)
        proj = np.einsum("hdk,hkj->hdj", b64, np.linalg.inv(np.einsum("hdk,hdj->hkj", b64, b64))).astype(np.float32)
        _PROJ.put(key, (proj, m, tuple(weak(a) for a in ref)))
        return proj, m

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        no_extra(side, "transform", set())
        H, T, D = spec.shape
        b, m = self.matrices(H, D, ctx)
        if arr.shape != (H, T, b.shape[2]) or arr.dtype != np.float32:
            raise KvcFormatError(f"codec 'transform': got {arr.dtype}{arr.shape}, expected float32{(H, T, b.shape[2])}")
        return transform_decode(arr, b, m).astype(spec.dtype)
