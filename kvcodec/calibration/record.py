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
CALIB_VERSION = 2
# Calibration corpus: Python reference chapters and licenses NOT used by the benchmarks.
CALIB_PYDOC_TOPICS = ("formatstrings", "string-methods", "typesseq", "debugger")
CALIB_TEXTS = ("pydoc:" + ",".join(CALIB_PYDOC_TOPICS), "gfdl13", "mpl2")
CALIB_CONTEXT = 1024
SENS_CONTINUATION = 128
SENS_SAMPLES = 4  # Hutchinson samples of the Fisher trace (one backward pass each)
DEFAULT_SINK = 4



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
