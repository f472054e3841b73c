"""The default resolver of a `.kvc` file's external attachments: the per-model calibration store.

Why here and not in ``format/``: the container only knows that an attachment is referenced by
name + sha256; where such arrays live (kvcodec's calibration cache and the calibrations shipped
in the package) is the lossy codec's business. The reader and the writer's read-back call
:func:`default_resolver`, which imports the calibration store only when a file references an
external attachment.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def default_resolver(name: str, info: Any) -> np.ndarray | None:
    """The array named ``name`` whose sha256 is ``info`` (a sha256 string or an object with ``.sha256``), or None."""
    sha = info if isinstance(info, str) else getattr(info, "sha256", None)
    if sha is None:
        return None
    import importlib

    # by name, like the stage table in kvcodec.stages: the container never imports the lossy codec statically
    return importlib.import_module("kvcodec.quant.calibrate").resolve_attachment(name, sha)
