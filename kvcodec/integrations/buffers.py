"""Checks on the buffers engines hand the integrations to read from or write into: a tensor with memory, whose
elements are each one place in it.

Why: a decoded chunk is written through ``copy_`` into the engine's buffer. A tensor on the ``meta`` device has
no memory (every copy into it is a no-op, so a load "succeeded" and left the engine's real buffer as it was), and
a view whose elements share memory (``expand``, a zero stride, ``as_strided`` over itself) made ``copy_`` raise
a RuntimeError mid-load, a traceback out of the engine's storage thread. Both are refused here, in one line,
before any work; a strided view whose elements are distinct (a slice, a permutation) is written correctly.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.errors import KvcInputError


def overlaps(t: torch.Tensor) -> bool:
    """True unless ``t``'s elements are provably distinct places in memory (sorted strides, each at least the
    span of the dimensions below it: torch's own sufficient test; a layout it cannot prove is refused)."""
    dims = sorted((s, n) for s, n in zip(t.stride(), t.shape) if n > 1)
    span = 1
    for s, n in dims:
        if s < span:
            return True
        span = s * n
    return False


def check_buffer(t: Any, what: str, write: bool = True) -> torch.Tensor:
    """``t`` if it is a tensor with memory (and, to be written, with distinct elements), else one KvcInputError."""
    if not isinstance(t, torch.Tensor):
        raise KvcInputError(f"{what} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type == "meta":
        raise KvcInputError(f"{what} is a meta tensor: it has no memory to {'write' if write else 'read'}")
    if write and t.numel() > 1 and overlaps(t):
        raise KvcInputError(f"{what} has elements sharing memory (strides {tuple(t.stride())} for shape "
                            f"{tuple(t.shape)}): writing into it would put several values in one place")
    return t
