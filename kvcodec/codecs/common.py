"""Checks every lossy stage applies to its config, its input and the side data a file gives its decoder."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.core.stage import SideData
from kvcodec.errors import KvcCodecError, KvcFormatError

FLOATS = ("float16", "float32")
#: K and V as indices of per-(layer, kind) tables
KIND_INDEX = {"k": 0, "v": 1}


def float32_copy(arr: np.ndarray) -> np.ndarray:
    """A C-contiguous float32 array equal to ``arr`` (float16 -> float32 is exact).

    Why torch for float16: numpy widens half floats one element at a time, torch with the CPU's
    F16C instructions; on a 2K-token chunk of SmolLM2 that is 1.25 ms against 0.07-0.18 ms, and
    the encoder widens every chunk of a cache at least twice (the first stage and the read-back).
    """
    if arr.dtype == np.float16 and arr.flags.writeable and arr.size and all(s >= 0 for s in arr.strides):
        import torch

        return torch.from_numpy(arr).to(torch.float32).contiguous().numpy()
    return np.ascontiguousarray(arr, dtype=np.float32)


def no_extra(side: SideData, stage: str, allowed: set[str]) -> None:
    extra = set(side) - allowed
    if extra:
        raise KvcFormatError(f"codec {stage!r}: unexpected side data {sorted(extra)}")


def check3(arr: np.ndarray, stage: str, dtypes: tuple[str, ...]) -> None:
    if arr.ndim != 3 or str(arr.dtype) not in dtypes:
        raise KvcCodecError(f"codec {stage!r} takes (heads, tokens, channels) {'/'.join(dtypes)} arrays, got {arr.dtype}{arr.shape}")


def int_param(v: Any, name: str, stage: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise KvcCodecError(f"codec {stage!r}: {name} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)
