"""The ``quantize`` stages (spec/codec-v1.md): uniform scalar quantization to symbols, version 1 (8-bit codes,
``step`` or ``minmax`` mode) and version 2 (16-bit codes as two byte planes, for near-lossless)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvcodec.codecs.common import FLOATS, check3, int_param, no_extra
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register, side_array
from kvcodec.errors import KvcCodecError, KvcFormatError

def zigzag(q: np.ndarray) -> np.ndarray:
    """int -> uint: 0,-1,1,-2,2,... -> 0,1,2,3,4,..."""
    q = q.astype(np.int32)
    return np.where(q >= 0, 2 * q, -2 * q - 1)


def unzigzag(s: np.ndarray) -> np.ndarray:
    s = s.astype(np.int32)
    return (s >> 1) ^ -(s & 1)


def quantize_step_decode(sym: np.ndarray, step: np.ndarray) -> np.ndarray:
    """``step`` mode: x[h,t,c] = float32(unzigzag(sym[h,t,c])) * float32(step[h,c]) (one rounding)."""
    q = unzigzag(sym).astype(np.float32)
    return q * step.astype(np.float32)[:, None, :]


def quantize_minmax_decode(sym: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: str, group: int, bits: int) -> np.ndarray:
    """``minmax`` mode. Asymmetric: x = float32(s) * scale + zero; symmetric
    (zero is None): x = float32(s - 2**(bits-1)) * scale. scale/zero are
    float16 per group, expanded to float32 and repeated over the group axis."""
    H, T, C = sym.shape
    sc = scale.astype(np.float32)
    ze = None if zero is None else zero.astype(np.float32)
    if axis == "channel":  # groups of `group` tokens per channel: scale [H, ceil(T/g), C]
        sc = np.repeat(sc, group, axis=1)[:, :T]
        ze = None if ze is None else np.repeat(ze, group, axis=1)[:, :T]
    else:  # groups of `group` channels per token: scale [H, T, ceil(C/g)]
        sc = np.repeat(sc, group, axis=2)[:, :, :C]
        ze = None if ze is None else np.repeat(ze, group, axis=2)[:, :, :C]
    if ze is None:
        return (sym.astype(np.int32) - (1 << (bits - 1))).astype(np.float32) * sc
    return sym.astype(np.float32) * sc + ze


def _fp16_side_ok(side: np.ndarray, amax: np.ndarray) -> None:
    """Refuse at encode what the decoder would refuse: float16 scale / zero side data that overflowed."""
    if not np.isfinite(side).all():
        raise KvcCodecError(f"codec 'quantize': values up to {float(np.max(amax)):.4g} overflow the float16 scale / zero "
                            f"side data (|x| must stay below 65504); this cache's range is too large for minmax mode")


def _round(x: np.ndarray) -> np.ndarray:
    return np.rint(x)  # round half to even


@register
class QuantizeStage(ArrayToArray):
    """Uniform scalar quantization to uint8 symbols.

    ``mode="step"`` (for transform coefficients, entropy coded afterwards):
    config ``step`` (target step, > 0), ``max_bits`` (1..8), optional
    ``deadzone`` (encoder rounding offset, 0 = round to nearest). Side data
    ``step`` float16 [H, C] (actual step per (head, channel)) and ``bits``
    uint8 [H, C] (0..8: signed range [-2**(b-1), 2**(b-1)-1], 0 = all zero);
    symbols are zigzag(q) < 2**bits.

    ``mode="minmax"`` (KIVI-like): config ``bits`` (1..8, or a list per head),
    ``axis`` "channel" (scale per channel over groups of ``group`` tokens) or
    "token" (per token over groups of ``group`` channels), ``symmetric``.
    Side data ``scale`` (and ``zero`` if asymmetric) float16 per group.
    """

    name = "quantize"
    version = 1

    def __init__(self, mode: str = "step", step: float | None = None, max_bits: int = 8, deadzone: float = 0.0,
                 bits: int | list[int] | None = None, axis: str = "channel", group: int = 32, symmetric: bool = False) -> None:
        if mode not in ("step", "minmax"):
            raise KvcCodecError(f"codec 'quantize': mode must be 'step' or 'minmax', got {mode!r}")
        self.mode = mode
        if mode == "step":
            self._set_step(step, max_bits, deadzone, 8)
        else:
            blist = bits if isinstance(bits, list) else [bits]
            for b in blist:
                int_param(b, "bits", "quantize", 2 if symmetric else 1, 8)
            self.bits = [int(b) for b in blist] if isinstance(bits, list) else int(bits)  # type: ignore[arg-type]
            if axis not in ("channel", "token"):
                raise KvcCodecError(f"codec 'quantize': axis must be 'channel' or 'token', got {axis!r}")
            self.axis = axis
            self.group = int_param(group, "group", "quantize", 1, 1 << 30)
            if not isinstance(symmetric, (bool, np.bool_)):
                raise KvcCodecError(f"codec 'quantize': symmetric must be true or false, got {symmetric!r}")
            self.symmetric = bool(symmetric)

    def _set_step(self, step: Any, max_bits: Any, deadzone: Any, max_bits_limit: int) -> None:
        """Validate and set step mode's config (v1 codes up to 8 bits, v2 up to 16)."""
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0:
            raise KvcCodecError(f"codec 'quantize': step must be a positive finite number, got {step!r}")
        self.step = float(step)
        self.max_bits = int_param(max_bits, "max_bits", "quantize", 1, max_bits_limit)
        if isinstance(deadzone, bool) or not isinstance(deadzone, (int, float)) or not 0.0 <= deadzone < 0.5:
            raise KvcCodecError(f"codec 'quantize': deadzone must be in [0, 0.5), got {deadzone!r}")
        self.deadzone = float(deadzone)

    def get_config(self) -> dict[str, Any]:
        if self.mode == "step":
            c: dict[str, Any] = {"mode": "step", "step": self.step, "max_bits": self.max_bits}
            if self.deadzone:
                c["deadzone"] = self.deadzone
            return c
        return {"mode": "minmax", "bits": self.bits, "axis": self.axis, "group": self.group, "symmetric": self.symmetric}

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        return ArraySpec(spec.shape, "uint8")

    def _head_bits(self, H: int) -> np.ndarray:
        b = self.bits
        if isinstance(b, list):
            if len(b) != H:
                raise KvcFormatError(f"codec 'quantize': {len(b)} bit widths for {H} heads")
            return np.asarray(b, np.int64)
        return np.full(H, b, np.int64)

    def _group_shape(self, H: int, T: int, C: int) -> tuple[int, int, int]:
        g = self.group
        return (H, -(-T // g), C) if self.axis == "channel" else (H, T, -(-C // g))

    # -- encode ------------------------------------------------------------
    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        check3(arr, "quantize", FLOATS)
        x = np.asarray(arr, dtype=np.float32)  # read only: no copy of a float32 input
        if self.mode == "step":
            return self._enc_step(x)
        if not np.isfinite(x).all():
            raise KvcCodecError("codec 'quantize': input contains NaN or inf")
        return self._enc_minmax(x)

    def _enc_step(self, x: np.ndarray) -> tuple[np.ndarray, SideData]:
        """(zigzag symbols, uint8 for max_bits <= 8 else uint16 [H, T, C]; side data step, bits)."""
        H, T, C = x.shape
        lim = (1 << (self.max_bits - 1)) - 1  # |q| <= lim keeps zigzag < 2**max_bits
        sym_dtype = np.uint8 if self.max_bits <= 8 else np.uint16
        amax = np.abs(x).max(axis=1) if T else np.zeros((H, C), np.float32)
        if not np.isfinite(amax).all():  # max propagates NaN and inf: one pass checks the input and takes the range
            raise KvcCodecError("codec 'quantize': input contains NaN or inf")
        step = np.full((H, C), self.step, np.float64)
        # widen the step where the range would not fit max_bits
        need = amax / (lim + 0.49)
        step = np.maximum(step, need)
        with np.errstate(over="ignore"):
            step16 = step.astype(np.float16)
            step16 = np.where(step16.astype(np.float64) < step, np.nextafter(step16, np.float16(np.inf)), step16).astype(np.float16)
        if not np.isfinite(step16).all():  # the step is stored as float16: its range bounds what max_bits can code
            raise KvcCodecError(f"codec 'quantize': values up to {float(amax.max()):.4g} need a step over float16's 65504 "
                                f"at max_bits={self.max_bits}; this cache's range is too large for a lossy preset")
        st = step16.astype(np.float32)
        if not self.deadzone:  # one numba pass, same bits as the numpy branch below
            from kvcodec.codecs.fastencode import quantize_step_symbols

            sym, qmax, nz = quantize_step_symbols(x, st, lim, sym_dtype)
        else:
            r = x / st[:, None, :]
            q = np.sign(r) * np.floor(np.abs(r) + (0.5 - self.deadzone))
            q = np.clip(q, -lim - 1, lim).astype(np.int32)
            qmax = np.maximum(q.max(axis=1), -q.min(axis=1) - 1) if T else np.zeros((H, C), np.int32)
            nz = (q != 0).any(axis=1) if T else np.zeros((H, C), bool)
            sym = zigzag(q).astype(sym_dtype)
        # bits: smallest b with -2**(b-1) <= q <= 2**(b-1)-1 ; all-zero channel -> 0
        bits = np.where(nz, np.ceil(np.log2(np.maximum(qmax, 0).astype(np.float64) + 1.0)).astype(np.int64) + 1, 0)
        bits = np.minimum(bits, self.max_bits)
        return sym, {"step": step16, "bits": bits.astype(np.uint8)}

    def _enc_minmax(self, x: np.ndarray) -> tuple[np.ndarray, SideData]:
        H, T, C = x.shape
        g = self.group
        hb = self._head_bits(H)[:, None, None]
        levels = (1 << hb) - 1
        if self.axis == "channel":
            pad = (-T) % g
            xp = np.concatenate([x, np.repeat(x[:, -1:], pad, 1)], 1) if pad and T else x
            xg = xp.reshape(H, -1, g, C)
            mn, mx, amx = xg.min(2), xg.max(2), np.abs(xg).max(2)
            expand = lambda a: np.repeat(a, g, axis=1)[:, :T]  # noqa: E731
        else:
            pad = (-C) % g
            xp = np.concatenate([x, np.repeat(x[:, :, -1:], pad, 2)], 2) if pad and C else x
            xg = xp.reshape(H, T, -1, g)
            mn, mx, amx = xg.min(3), xg.max(3), np.abs(xg).max(3)
            expand = lambda a: np.repeat(a, g, axis=2)[:, :, :C]  # noqa: E731
        if self.symmetric:
            half = (1 << (hb - 1)) - 1
            with np.errstate(over="ignore"):
                scale = (amx / half).astype(np.float16)
                scale = np.where(scale.astype(np.float32) * half < amx, np.nextafter(scale, np.float16(np.inf)), scale).astype(np.float16)
            _fp16_side_ok(scale, amx)
            sc = expand(scale.astype(np.float32))
            with np.errstate(divide="ignore", invalid="ignore"):
                q = np.where(sc > 0, _round(x / sc), 0)
            s = np.clip(q + (1 << (hb - 1)), 0, levels)
            return s.astype(np.uint8), {"scale": scale}
        with np.errstate(over="ignore"):
            zero = mn.astype(np.float16)
            zero = np.where(zero.astype(np.float32) > mn, np.nextafter(zero, np.float16(-np.inf)), zero).astype(np.float16)
            scale = ((mx - zero.astype(np.float32)) / levels).astype(np.float16)
        _fp16_side_ok(zero, amx)
        _fp16_side_ok(scale, amx)
        sc, ze = expand(scale.astype(np.float32)), expand(zero.astype(np.float32))
        with np.errstate(divide="ignore", invalid="ignore"):
            q = np.where(sc > 0, _round((x - ze) / sc), 0)
        s = np.clip(q, 0, levels)
        return s.astype(np.uint8), {"scale": scale, "zero": zero}

    # -- decode ------------------------------------------------------------
    def step_side(self, side: SideData, spec: ArraySpec) -> tuple[np.ndarray, np.ndarray]:
        """Validated (step fp16 (H, C), bits uint8 (H, C)) of a step-mode chunk (CPU and GPU decoders)."""
        H, _, C = spec.shape
        no_extra(side, "quantize", {"step", "bits"})
        step = side_array(side, "step", "quantize", (H, C), "float16")
        bits = side_array(side, "bits", "quantize", (H, C), "uint8")
        if not (np.isfinite(step).all() and (step.astype(np.float32) >= 0).all()):
            raise KvcFormatError("codec 'quantize': step side data is NaN, inf or negative")
        if (bits > self.max_bits).any():
            raise KvcFormatError(f"codec 'quantize': bit width {int(bits.max())} exceeds max_bits {self.max_bits}")
        return step, bits

    def minmax_side(self, side: SideData, spec: ArraySpec) -> tuple[np.ndarray, tuple[int, ...], np.ndarray, np.ndarray | None]:
        """Validated (head bits, group shape, scale, zero or None) of a minmax-mode chunk."""
        H, T, C = spec.shape
        hb = self._head_bits(H)
        gshape = self._group_shape(H, T, C)
        no_extra(side, "quantize", {"scale"} if self.symmetric else {"scale", "zero"})
        scale = side_array(side, "scale", "quantize", gshape, "float16")
        zero = None if self.symmetric else side_array(side, "zero", "quantize", gshape, "float16")
        if not np.isfinite(scale).all() or (zero is not None and not np.isfinite(zero).all()):
            raise KvcFormatError("codec 'quantize': scale or zero side data is NaN or inf")
        return hb, gshape, scale, zero

    # -- decode ------------------------------------------------------------
    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, C = spec.shape
        if arr.shape != (H, T, C) or arr.dtype != np.uint8:
            raise KvcFormatError(f"codec 'quantize': got {arr.dtype}{arr.shape}, expected uint8{spec.shape}")
        if self.mode == "step":
            step, bits = self.step_side(side, spec)
            if T and (arr.max(axis=1) >= (np.uint32(1) << bits.astype(np.uint32))).any():
                raise KvcFormatError("codec 'quantize': symbol outside its channel's bit width")
            return quantize_step_decode(arr, step).astype(spec.dtype)
        hb, gshape, scale, zero = self.minmax_side(side, spec)
        if T and C and (arr.max(axis=(1, 2)) > (1 << hb) - 1).any():
            raise KvcFormatError("codec 'quantize': symbol exceeds the bit width")
        if len(set(hb.tolist())) == 1:
            out = quantize_minmax_decode(arr, scale, zero, self.axis, self.group, int(hb[0]))
        else:
            out = np.concatenate([quantize_minmax_decode(arr[h : h + 1], scale[h : h + 1], None if zero is None else zero[h : h + 1],
                                                         self.axis, self.group, int(hb[h])) for h in range(H)], 0)
        return out.astype(spec.dtype)


@register
class WideQuantizeStage(QuantizeStage):
    """``quantize`` v2: v1's ``step`` mode with codes of up to 16 bits, written as two byte planes.

    Why a second version: v1 codes at most 8 bits per coefficient, so a
    coefficient channel whose range exceeds 127 steps gets its step widened to
    fit. That is invisible at ``balanced``'s steps but sets ``near-lossless``'s
    quality floor: below step0 ~0.02 KL stops falling (~4e-5 on SmolLM2) and
    greedy tokens flip at clear margins (issue 15; benchmarks/results/floor/floor.txt).
    The rANS coder stays a byte coder: the high bytes and the low bytes are
    separate channels, so each gets its own tables (the high plane of a narrow
    channel is all zeros and costs almost nothing; the low plane of a wide one
    is close to uniform, which is what its information is).

    Config ``step`` (> 0), ``max_bits`` (1..16), optional ``deadzone``. Side data
    as v1 (``step`` float16 [H, C], ``bits`` uint8 [H, C] <= max_bits). Output
    uint8 [H, T, 2C]: channel c < C holds ``s >> 8``, channel C + c holds
    ``s & 255`` of the symbol ``s = zigzag(q) < 2**bits[h, c]``.
    """

    version = 2

    def __init__(self, step: float | None = None, max_bits: int = 16, deadzone: float = 0.0) -> None:
        self.mode = "step"
        self._set_step(step, max_bits, deadzone, 16)

    def get_config(self) -> dict[str, Any]:
        c: dict[str, Any] = {"step": self.step, "max_bits": self.max_bits}
        if self.deadzone:
            c["deadzone"] = self.deadzone
        return c

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        H, T, C = spec.shape
        return ArraySpec((H, T, 2 * C), "uint8")

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        sym, side = super().encode(arr, ctx)  # v1's step mode, codes up to max_bits wide
        s = sym.astype(np.uint16)
        return np.ascontiguousarray(np.concatenate([s >> 8, s & 0xFF], axis=2).astype(np.uint8)), side

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, C = spec.shape
        if arr.shape != (H, T, 2 * C) or arr.dtype != np.uint8:
            raise KvcFormatError(f"codec 'quantize': got {arr.dtype}{arr.shape}, expected uint8{(H, T, 2 * C)}")
        step, bits = self.step_side(side, spec)
        s = (arr[:, :, :C].astype(np.uint32) << 8) | arr[:, :, C:]
        if T and (s.max(axis=1) >= (np.uint32(1) << bits.astype(np.uint32))).any():
            raise KvcFormatError("codec 'quantize': symbol outside its channel's bit width")
        return quantize_step_decode(s, step).astype(spec.dtype)
