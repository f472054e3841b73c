"""The ``keep`` stage (spec/codec-v1.md): sink and recent tokens travel as raw side data; the rest is coded."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcodec.codecs.common import FLOATS, check3, float32_copy, int_param, no_extra
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register, side_array
from kvcodec.errors import KvcCodecError, KvcFormatError


def keep_dtype(t: Any) -> str:
    """The ``dtype`` of a keep stage over tensor ``t`` [H, T, D] (a torch tensor): float16 unless its values could
    overflow it (then float32).

    The kept rows are pre-RoPE keys (a rotation mixes channel pairs, so a
    component can grow by up to sqrt(2)) or values; a file must never hold an
    fp16 side array that overflowed, which its reader would reject.
    """
    amax = float(t.detach().abs().max()) if t.numel() else 0.0
    return "float16" if amax * math.sqrt(2.0) < float(np.finfo(np.float16).max) else "float32"


def keep_decode(rest: np.ndarray, kept: np.ndarray, sink: int, recent: int) -> np.ndarray:
    """Re-insert kept tokens: out = concat(kept[:, :sink], rest, kept[:, sink:]) as float32."""
    k32 = kept.astype(np.float32)
    return np.concatenate([k32[:, :sink], rest.astype(np.float32), k32[:, sink:]], axis=1)


@register
class KeepStage(ArrayToArray):
    """Keep the first ``sink`` and last ``recent`` tokens as side data ``kept``.

    Config: sink, recent (>= 0), dtype ("float16" | "float32") of ``kept``.
    Output: the other tokens, float32 [H, T - n_sink - n_recent, D].
    """

    name = "keep"
    version = 1

    def __init__(self, sink: int = 4, recent: int = 0, dtype: str = "float16") -> None:
        self.sink = int_param(sink, "sink", "keep", 0, 1 << 30)
        self.recent = int_param(recent, "recent", "keep", 0, 1 << 30)
        if dtype not in FLOATS:
            raise KvcCodecError(f"codec 'keep': dtype must be one of {FLOATS}, got {dtype!r}")
        self.dtype = dtype

    def get_config(self) -> dict[str, Any]:
        return {"sink": self.sink, "recent": self.recent, "dtype": self.dtype}

    def counts(self, T: int) -> tuple[int, int]:
        s = min(self.sink, T)
        return s, min(self.recent, T - s)

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        H, T, D = spec.shape
        s, r = self.counts(T)
        return ArraySpec((H, T - s - r, D), "float32")

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        check3(arr, "keep", FLOATS)
        H, T, D = arr.shape
        s, r = self.counts(T)
        src = np.concatenate([arr[:, :s], arr[:, T - r :]], axis=1)
        if not np.isfinite(src).all():
            raise KvcCodecError("codec 'keep': the kept sink/recent tokens contain NaN or inf (lossy presets need a finite cache)")
        with np.errstate(over="ignore"):
            kept = src.astype(self.dtype)
        if not np.isfinite(kept).all():  # finite input that overflows float16 would make a file its reader rejects
            big = float(np.abs(src.astype(np.float64)).max())
            raise KvcCodecError(f"codec 'keep': kept tokens reach {big:.4g}, beyond the {self.dtype} range; "
                                f"use keep dtype float32 (kvcodec's presets pick it automatically)")
        return float32_copy(arr[:, s : T - r]), {"kept": kept}

    def kept_side(self, side: SideData, spec: ArraySpec) -> np.ndarray:
        """Validated kept tokens [H, sink + recent, D] of a chunk (CPU and GPU decoders)."""
        no_extra(side, "keep", {"kept"})
        H, T, D = spec.shape
        s, r = self.counts(T)
        kept = side_array(side, "kept", "keep", (H, s + r, D), self.dtype)
        if not np.isfinite(kept).all():
            raise KvcFormatError("codec 'keep': kept tokens contain NaN or inf")
        return kept

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, D = spec.shape
        s, r = self.counts(T)
        kept = self.kept_side(side, spec)
        if arr.shape != (H, T - s - r, D):
            raise KvcFormatError(f"codec 'keep': got {arr.shape}, expected {(H, T - s - r, D)}")
        return keep_decode(arr, kept, s, r).astype(spec.dtype)
