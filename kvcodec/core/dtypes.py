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


def f32_to_bf16(t: Any) -> Any:
    """A float32 torch tensor narrowed to bfloat16 as torch rounds it, except a NaN that is an exact bfloat16 value,
    whose bits (sign and payload) are kept.

    Why: bfloat16 travels through the codecs as exact float32 and torch's float32 -> bfloat16 conversion turns every
    NaN into one canonical NaN (0xFFFF), so a lossless bfloat16 cache holding another NaN did not come back bit for
    bit (float16 and float32 do). A lossy decode's NaN that is not an exact bfloat16 keeps torch's conversion: its
    top half alone could read as an infinity."""
    import torch

    out = t.to(torch.bfloat16)
    # A NaN anywhere makes the sum NaN, so one reduction (~0.1 ms per million values) rules the common case out;
    # a full isnan pass would cost 10x the conversion itself, ~10 % of a bfloat16 file's whole decode.
    if t.numel() and bool(torch.isnan(t.sum())):
        nan = torch.isnan(t)
        bits = t.view(torch.int32)
        keep = nan & ((bits & 0xFFFF) == 0)
        out = torch.where(keep, (bits >> 16).to(torch.int16).view(torch.bfloat16), out)
    return out


def cast_in_range(t: Any, dtype: Any) -> Any:
    """Torch tensor ``t`` cast to ``dtype``; one :class:`~kvcodec.errors.KvcInputError` line where a finite value of
    ``t`` would become inf (a narrowing cast: float32 or bfloat16 past float16's 65504).

    Why: a `.kvc` entry outlives the engine that wrote it, and loads into models and engines of another dtype (a
    float32 capture into a float16 model, a bfloat16 LMCache chunk into a float16 vLLM cache). A plain cast puts
    inf into the cache, silently: the attention then reads NaNs. Only a narrowing cast pays the check."""
    import torch

    from kvcodec.errors import KvcInputError

    out = t.to(dtype)
    if (out.dtype != t.dtype and out.is_floating_point() and t.is_floating_point()
            and torch.finfo(out.dtype).max < torch.finfo(t.dtype).max and bool(torch.isinf(out).any())
            and bool((torch.isinf(out) & torch.isfinite(t)).any())):
        name = str(out.dtype).removeprefix("torch.")
        raise KvcInputError(f"the cache holds values past {name}'s range ({torch.finfo(out.dtype).max:g}), the dtype "
                            f"it is loaded into: load it into a {str(t.dtype).removeprefix('torch.')} model")
    return out
