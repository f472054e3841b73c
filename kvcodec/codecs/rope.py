"""The ``rope`` stage (spec/codec-v1.md): keys lose their rotary position embedding on encode (float64 math,
rounded once to float32) and get it back on decode, so the transform sees position-free keys."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcodec.codecs.common import FLOATS, check3, int_param, no_extra
from kvcodec.codecs.rope_tables import positions_for, rope_tables
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register
from kvcodec.errors import KvcCodecError, KvcFormatError

def rope_decode(y: np.ndarray, cos: np.ndarray, sin: np.ndarray, dim: int) -> np.ndarray:
    """Re-apply RoPE: x = y*cos + rotate_half(y)*sin on the first ``dim`` channels (float32).

    y float32 [H, T, D]; cos, sin float32 [H, T, dim] (from :func:`rope_tables`).
    rotate_half(y) = concat(-y[dim/2:dim], y[:dim/2]). Products and the sum are
    separately rounded float32 operations. Channels >= dim pass through.
    """
    y = np.asarray(y, dtype=np.float32)
    h = dim // 2
    r = y[..., :dim]
    rh = np.concatenate([-r[..., h:], r[..., :h]], axis=-1)
    t1 = r * cos
    t2 = rh * sin
    out = y.copy()
    out[..., :dim] = t1 + t2
    return out


@register
class RopeStage(ArrayToArray):
    """Keys to pre-RoPE (encode) and back (decode). Config: theta, dim."""

    name = "rope"
    version = 1

    def __init__(self, theta: float, dim: int) -> None:
        if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta) or theta <= 1.0:
            raise KvcCodecError(f"codec 'rope': theta must be a finite number > 1, got {theta!r}")
        self.theta = float(theta)
        self.dim = int_param(dim, "dim", "rope", 2, 1 << 16)
        if self.dim % 2:
            raise KvcCodecError("codec 'rope': dim must be even")

    def get_config(self) -> dict[str, Any]:
        return {"theta": self.theta, "dim": self.dim}

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        return ArraySpec(spec.shape, "float32")

    def _tables(self, H: int, T: int, ctx: ChunkContext) -> tuple[np.ndarray, np.ndarray]:
        pos = positions_for(ctx.positions, ctx.layer, H, T, ctx.token_start)
        return rope_tables(pos, self.theta, self.dim)

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        check3(arr, "rope", FLOATS)
        H, T, D = arr.shape
        if self.dim > D:
            raise KvcCodecError(f"codec 'rope': dim {self.dim} exceeds {D} channels")
        pos = positions_for(ctx.positions, ctx.layer, H, T, ctx.token_start)
        # rotation by -angle in float64 (x*cos - rotate_half(x)*sin), rounded once to float32;
        # numba kernel + cached float64 tables, same bits as the numpy expression
        from kvcodec.codecs.fastencode import rope_unrotate

        return rope_unrotate(arr, pos, self.theta, self.dim), {}

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        no_extra(side, "rope", set())
        H, T, D = spec.shape
        if arr.shape != (H, T, D) or arr.dtype != np.float32:
            raise KvcFormatError(f"codec 'rope': got {arr.dtype}{arr.shape}, expected float32{spec.shape}")
        cos, sin = self._tables(H, T, ctx)
        return rope_decode(arr, cos, sin, self.dim).astype(spec.dtype)
