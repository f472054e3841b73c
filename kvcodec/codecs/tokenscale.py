"""The ``tokenscale`` array->array stage: a per-token step multiplier (spec/codec-v1.md).

Placed before ``quantize`` so that token t is quantized with step
``step[h, c] * mult[class[t]]``: tokens that receive little attention get coarse
steps (see :mod:`kvcodec.plan.importance`). Side data: ``class`` (packed
``bits``-bit class per token, shared by all heads and channels of the chunk)
and ``mult`` (float32 class -> multiplier table). Decode is one float32
multiply per element::

    x[h, t, c] = y[h, t, c] * mult[class[t]]

The encoder divides by the multiplier (exact for the power-of-two tables the
presets use). The classes are an encoder input, not config: a :class:`TokenClasses`
under ``ctx.encoder["tokenscale"]`` (the plan's ``encoder_inputs`` for that layer,
which the writer hands to the tensor's chunks); without one every token gets class 0
with multiplier 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register

_BITS = (1, 2, 4, 8)
MAX_CLASSES = 256


def pack_classes(cls: np.ndarray, bits: int) -> np.ndarray:
    """uint8 classes [T] -> packed uint8 [ceil(T*bits/8)]; token t at bit (t*bits) % 8 of byte (t*bits)//8 (LSB first)."""
    cls = np.asarray(cls, np.uint8).reshape(-1)
    if bits == 8:
        return cls.copy()
    per = 8 // bits
    n = -(-cls.size // per)
    pad = np.zeros(n * per, np.uint8)
    pad[: cls.size] = cls
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return np.bitwise_or.reduce((pad.reshape(n, per) << shifts[None, :]).astype(np.uint8), axis=1).astype(np.uint8)


def unpack_classes(packed: np.ndarray, bits: int, T: int) -> np.ndarray:
    """Inverse of :func:`pack_classes` (returns all ceil(T*bits/8)*8/bits entries; the first T are the tokens')."""
    packed = np.asarray(packed, np.uint8)
    if bits == 8:
        return packed.copy()
    per = 8 // bits
    shifts = (np.arange(per, dtype=np.uint8) * bits).astype(np.uint8)
    return ((packed[:, None] >> shifts[None, :]) & np.uint8((1 << bits) - 1)).reshape(-1)


@dataclass(frozen=True)
class TokenClasses:
    """The encoder input of one tensor's ``tokenscale`` stage.

    ``classes``: uint8 class per absolute token of the cache (token ``ctx.token_start + skip + t``
    of the chunk's stage input is ``classes[...]``); ``table``: float32 class -> multiplier;
    ``skip``: tokens removed by earlier stages (keep's sinks) before this one.
    """

    classes: np.ndarray
    table: np.ndarray
    skip: int = 0


@register
class TokenScaleStage(ArrayToArray):
    """Per-token step multiplier classes. Config: ``bits`` (1, 2, 4 or 8: width of a packed class)."""

    name = "tokenscale"
    version = 1

    def __init__(self, bits: int = 4) -> None:
        if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or int(bits) not in _BITS:
            raise KvcCodecError(f"codec 'tokenscale': bits must be one of {_BITS}, got {bits!r}")
        self.bits = int(bits)

    def get_config(self) -> dict[str, Any]:
        return {"bits": self.bits}

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        if len(spec.shape) != 3:
            raise KvcCodecError(f"codec 'tokenscale' takes (heads, tokens, channels) arrays, got shape {spec.shape}")
        return ArraySpec(spec.shape, "float32")

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        if arr.ndim != 3 or arr.dtype.name not in ("float16", "float32"):
            raise KvcCodecError(f"codec 'tokenscale' takes (heads, tokens, channels) float16/float32 arrays, got {arr.dtype}{arr.shape}")
        H, T, C = arr.shape
        inputs = ctx.encoder.get(self.name)
        if inputs is None:
            cls, table = np.zeros(T, np.uint8), np.ones(1, np.float32)
        else:
            if not isinstance(inputs, TokenClasses):
                raise KvcCodecError(f"codec 'tokenscale': encoder input is a {type(inputs).__name__}, not TokenClasses")
            a = ctx.token_start + inputs.skip
            cls = np.asarray(inputs.classes, np.uint8)[a : a + T]
            table = np.asarray(inputs.table, np.float32)
            if cls.shape != (T,):
                raise KvcCodecError(f"codec 'tokenscale': encoder classes cover {cls.shape[0]} of the chunk's {T} tokens")
        if table.ndim != 1 or not 1 <= table.size <= min(MAX_CLASSES, 1 << self.bits) or not (np.isfinite(table).all() and (table > 0).all()):
            raise KvcCodecError(f"codec 'tokenscale': multiplier table must hold 1..{1 << self.bits} finite positive values")
        if T and int(cls.max()) >= table.size:
            raise KvcCodecError("codec 'tokenscale': a class exceeds the multiplier table")
        y = arr.astype(np.float32) / table[cls.astype(np.int64)][None, :, None]
        return y.astype(np.float32), {"class": pack_classes(cls, self.bits), "mult": table.astype(np.float32)}

    def multipliers(self, side: SideData, T: int) -> np.ndarray:
        """float32 [T]: the multiplier of each token, after every check of the side data
        (the one validation shared by the CPU decode, the fused CPU decoder and the GPU path)."""
        extra = set(side) - {"class", "mult"}
        if extra:
            raise KvcFormatError(f"codec 'tokenscale': unexpected side data {sorted(extra)}")
        mult, packed = side.get("mult"), side.get("class")
        if mult is None or packed is None:
            raise KvcFormatError("codec 'tokenscale': side data 'class' or 'mult' missing")
        mult, packed = np.asarray(mult), np.asarray(packed)
        n = mult.shape[0] if mult.ndim == 1 else -1
        if mult.dtype != np.float32 or not 1 <= n <= (1 << self.bits):
            raise KvcFormatError(f"codec 'tokenscale': side data 'mult' is {mult.dtype}{mult.shape}, expected float32 (1..{1 << self.bits},)")
        if not (np.isfinite(mult).all() and (mult > 0).all()):
            raise KvcFormatError("codec 'tokenscale': multiplier table holds NaN, inf or a value <= 0")
        nbytes = -(-T * self.bits // 8)
        if packed.dtype != np.uint8 or packed.shape != (nbytes,):
            raise KvcFormatError(f"codec 'tokenscale': side data 'class' is {packed.dtype}{packed.shape}, expected uint8({nbytes},)")
        cls = unpack_classes(packed, self.bits, T)
        if (cls[T:] != 0).any():
            raise KvcFormatError("codec 'tokenscale': padding bits of 'class' are not zero")
        cls = cls[:T]
        if T and int(cls.max()) >= n:
            raise KvcFormatError(f"codec 'tokenscale': class {int(cls.max())} outside the {n}-entry multiplier table")
        return np.ascontiguousarray(mult[cls.astype(np.int64)], dtype=np.float32)

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, C = spec.shape
        if arr.shape != (H, T, C) or arr.dtype != np.float32:
            raise KvcFormatError(f"codec 'tokenscale': got {arr.dtype}{arr.shape}, expected float32{spec.shape}")
        m = self.multipliers(side, T)
        return (arr * m[None, :, None]).astype(spec.dtype)


# --------------------------------------------------------------------------- golden vectors
def vector_cases() -> dict[str, dict[str, Any]]:
    """Golden vectors of this stage (spec/vectors/codec/tokenscale*/, same file layout as kvcodec.testing.vectors).

    ``tokenscale`` (no encoder classes: class 0, multiplier 1) has a ``case.json``
    and is checked by the generic golden-vector test; ``tokenscale_classes``
    (4-bit classes, 13 tokens so the last byte is half padding, a non-power-of-two
    table entry so the multiply rounds) stores its encoder inputs, so its
    metadata is ``vector.json`` (the generic test re-encodes without them).
    """
    rng = np.random.default_rng(20260402)
    x = (rng.standard_normal((2, 13, 8)) * 3).astype(np.float32)
    cls = rng.integers(0, 5, 13).astype(np.uint8)
    table = np.array([0.25, 1.0, 2.0, 11.3137085, 45.254834], np.float32)
    return {
        "tokenscale": {"stage": {"name": "tokenscale", "version": 1, "config": {"bits": 2}}, "input": x[:, :9], "meta": "case.json"},
        "tokenscale_classes": {"stage": {"name": "tokenscale", "version": 1, "config": {"bits": 4}}, "input": x, "meta": "vector.json",
                               "classes": cls, "table": table},
    }

