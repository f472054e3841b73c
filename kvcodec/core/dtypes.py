"""Element types of side data and blobs: the one code table the container and the codecs share (spec/kvc-v1.md).

Why in core: the lossless codecs write side arrays with these codes and the container parses them;
neither may import the other.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# Side data and blob element types (code, JSON name); all little-endian.
DTYPE_CODES: dict[int, str] = {
    1: "uint8", 2: "int8", 3: "uint16", 4: "int16", 5: "uint32", 6: "int32",
    7: "uint64", 8: "int64", 9: "float16", 10: "float32", 11: "float64",
}
DTYPE_BY_NAME = {v: k for k, v in DTYPE_CODES.items()}


def np_le(dtype_name: str) -> np.dtype:
    """The little-endian numpy dtype named ``dtype_name`` (every on-disk array is little-endian)."""
    return np.dtype(dtype_name).newbyteorder("<")


def is_bf16(t: Any) -> bool:
    """Whether a tensor (or cache) is bfloat16, which numpy lacks (written and probed as float32 chunks)."""
    return str(t.dtype) == "torch.bfloat16"


def tensor_dtype(cache: Any) -> str:
    """A cache's tensor dtype as the header names it (``float16``, ``bfloat16``, ``float32``)."""
    return str(cache.dtype).removeprefix("torch.")
