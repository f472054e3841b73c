"""The calibration record: a model's PCA bases, means, eigenvalues and per-layer sensitivities.

Computed once per model (:mod:`kvcodec.calibration.build`), stored as a file
(:mod:`kvcodec.calibration.store`), and resolved once per encode and passed down to the
planner. A calibration steers every quantizer step and basis, so a wrong one encodes garbage
that still decodes: :meth:`Calibration.check_for` binds it to its model.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.errors import KvcFormatError, KvcModelMismatchError

CALIB_FORMAT = "kvcodec-calibration"
CALIB_VERSION = 3  # the version written; version 2 files (a float16 basis) are still read
# Calibration corpus: Python reference chapters and licenses NOT used by the benchmarks.
CALIB_PYDOC_TOPICS = ("formatstrings", "string-methods", "typesseq", "debugger")
CALIB_TEXTS = ("pydoc:" + ",".join(CALIB_PYDOC_TOPICS), "gfdl13", "mpl2")
CALIB_CONTEXT = 1024
SENS_CONTINUATION = 128
SENS_SAMPLES = 8  # Hutchinson samples of the Fisher information per calibration text (one backward pass each)
DEFAULT_SINK = 4



# The basis grid (calibration v3, issue 38: a calibration cheap enough to ship with one file). Each basis column
# is snapped to ``q * 2**e`` with integer codes |q| <= 127 and one power-of-two exponent e per column, so the
# file stores 8-bit codes (zstd-compressed: a block-diagonal basis is mostly zeros) instead of float16.
# Why it costs nothing: the encoder projects with the least-squares inverse of the basis it is given
# (TransformStage), so a coarser basis only decorrelates slightly less; on SmolLM2 at 2K tokens (balanced,
# py-heapq and c-stdio) an 8-bit basis changed bits by +0.01 % and KL within run-to-run noise.
# Why a power of two: q * 2**e is exact in float16 for e in [GRID_EXP_MIN, GRID_EXP_MAX], and snapping is
# idempotent (a snapped column snaps to itself: max |q| >= 64), so the codes are recovered exactly from
# the float16 basis.
GRID_CODE_MAX = 127
BASIS_GRID = "int8-pow2-column"  # metadata "basis_grid" of a calibration whose basis was snapped
GRID_EXP_MIN, GRID_EXP_MAX = -24, 9


def grid_codes(basis: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 codes [..., D, K], int8 exponents [..., K]) of ``basis`` [..., D, K] on the grid (columns snapped)."""
    b = np.asarray(basis, np.float64)
    m = np.abs(b).max(axis=-2) / GRID_CODE_MAX
    f, k = np.frexp(np.where(m > 0, m, 1.0))
    e = np.where(f == 0.5, k - 1, k)  # ceil(log2(m)), exactly
    e = np.clip(np.where(m > 0, e, 0), GRID_EXP_MIN, GRID_EXP_MAX).astype(np.int8)
    q = np.clip(np.rint(np.ldexp(b, -e[..., None, :].astype(np.int64))), -GRID_CODE_MAX, GRID_CODE_MAX)
    return q.astype(np.int8), e


def grid_basis(q: np.ndarray, e: np.ndarray) -> np.ndarray:
    """The float16 basis of codes ``q`` [..., D, K] and exponents ``e`` [..., K] (exact: no rounding)."""
    return np.ldexp(q.astype(np.float32), e[..., None, :].astype(np.int32)).astype(np.float16)


def snap_basis(basis: np.ndarray) -> np.ndarray:
    """``basis`` on the grid (float16): what a calibration stores and every encoder and decoder uses."""
    return grid_basis(*grid_codes(basis))


@dataclass
class Calibration:
    basis: np.ndarray  # float16 [L, 2, H, D, D], columns sorted by decreasing variance
    mean: np.ndarray  # float32 [L, 2, H, D]
    eigval: np.ndarray  # float32 [L, 2, H, D]
    sensitivity: np.ndarray  # float32 [L, 2]: d KL / d (per-element MSE), nats per unit^2
    meta: dict[str, Any]
    path: Path | None = None

    @property
    def attachments(self) -> dict[str, np.ndarray]:
        """The codec's attachment arrays (views of ``basis`` / ``mean``): the same array objects on
        every call while those fields are unchanged, because the fused decoder caches the matrices
        it derives from an attachment by the array's identity (a fresh view per file open missed
        that cache on every chunk: ~10 % of a whole-file decode)."""
        memo = self.__dict__.get("_attachments_memo")
        if memo is None or memo[0] is not self.basis or memo[1] is not self.mean:
            L, _, H, D, K = self.basis.shape
            memo = (self.basis, self.mean,
                    {"pca.basis": self.basis.reshape(2 * L, H, D, K), "pca.mean": self.mean.reshape(2 * L, H, D)})
            self.__dict__["_attachments_memo"] = memo
        return dict(memo[2])

    def check_for(self, fingerprint: Any) -> None:
        """Refuse (one-line KvcError) a calibration that is not this model's or does not fit its shapes."""
        fid = self.meta.get("fingerprint_id")
        if fid != fingerprint.id:
            where = f" ({self.path})" if self.path else ""
            raise KvcModelMismatchError(f"calibration{where} belongs to model {str(fid)[:40]}, not to this model "
                                        f"{fingerprint.id}; rebuild it: kvc calibrate --model MODEL --force")
        L, _, H, D, _ = self.basis.shape
        want = (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_dims[0])
        if (L, H, D) != want or self.sensitivity.shape != (L, 2):
            raise KvcFormatError(f"calibration has {L} layers x {H} KV heads x head_dim {D}, the model "
                                 f"{want[0]} x {want[1]} x {want[2]}; rebuild it: kvc calibrate --model MODEL --force")

    def truncated(self, k: np.ndarray | int) -> dict[str, np.ndarray]:
        """Attachments with only the first max(k) basis columns (option (c))."""
        kmax = int(np.max(k))
        a = self.attachments
        return {"pca.basis": np.ascontiguousarray(a["pca.basis"][..., :kmax]), "pca.mean": a["pca.mean"]}
