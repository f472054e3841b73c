"""The lossy array->array stages of kvcodec (normative: spec/codec-v1.md).

Stages (all version 1), in the order a key pipeline uses them::

    rope -> keep -> transform -> quantize -> rans

* ``rope``      keys: undo RoPE on encode (float64 math -> float32), redo it on decode.
* ``keep``      store sink / recent tokens as raw side data, code the rest.
* ``transform`` orthonormal decorrelation (PCA basis from an attachment, or Hadamard).
* ``quantize``  uniform scalar quantization to uint8 symbols (``step`` or ``minmax`` mode).

Each decode is also exposed as a pure function of arrays (``*_decode``) so a
GPU implementation can be compared against it bit for bit. Decodes use only
float32 elementwise operations in a fixed order, every product and sum
rounded separately (numpy never fuses multiply-add).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import njit

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ArrayToArray, ChunkContext, SideData, register, side_array
from kvcodec.codecs.rope_tables import positions_for, rope_tables

_FLOATS = ("float16", "float32")
KIND_INDEX = {"k": 0, "v": 1}


def _no_extra(side: SideData, stage: str, allowed: set[str]) -> None:
    extra = set(side) - allowed
    if extra:
        raise KvcFormatError(f"codec {stage!r}: unexpected side data {sorted(extra)}")


def _check3(arr: np.ndarray, stage: str, dtypes: tuple[str, ...]) -> None:
    if arr.ndim != 3 or str(arr.dtype) not in dtypes:
        raise KvcCodecError(f"codec {stage!r} takes (heads, tokens, channels) {'/'.join(dtypes)} arrays, got {arr.dtype}{arr.shape}")


def _int(v: Any, name: str, stage: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise KvcCodecError(f"codec {stage!r}: {name} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


# =========================================================================== rope
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
        self.dim = _int(dim, "dim", "rope", 2, 1 << 16)
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
        _check3(arr, "rope", _FLOATS)
        H, T, D = arr.shape
        if self.dim > D:
            raise KvcCodecError(f"codec 'rope': dim {self.dim} exceeds {D} channels")
        pos = positions_for(ctx.positions, ctx.layer, H, T, ctx.token_start)
        # rotation by -angle in float64 (x*cos - rotate_half(x)*sin), rounded once to float32;
        # numba kernel + cached float64 tables, same bits as the numpy expression
        from kvcodec.codecs.fastencode import rope_unrotate

        return rope_unrotate(arr, pos, self.theta, self.dim), {}

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        _no_extra(side, "rope", set())
        H, T, D = spec.shape
        if arr.shape != (H, T, D) or arr.dtype != np.float32:
            raise KvcFormatError(f"codec 'rope': got {arr.dtype}{arr.shape}, expected float32{spec.shape}")
        cos, sin = self._tables(H, T, ctx)
        return rope_decode(arr, cos, sin, self.dim).astype(spec.dtype)


# =========================================================================== keep
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
        self.sink = _int(sink, "sink", "keep", 0, 1 << 30)
        self.recent = _int(recent, "recent", "keep", 0, 1 << 30)
        if dtype not in _FLOATS:
            raise KvcCodecError(f"codec 'keep': dtype must be one of {_FLOATS}, got {dtype!r}")
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
        _check3(arr, "keep", _FLOATS)
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
        return np.ascontiguousarray(arr[:, s : T - r], dtype=np.float32), {"kept": kept}

    def kept_side(self, side: SideData, spec: ArraySpec) -> np.ndarray:
        """Validated kept tokens [H, sink + recent, D] of a chunk (CPU and GPU decoders)."""
        _no_extra(side, "keep", {"kept"})
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


# =========================================================================== transform
def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix float32 [n, n] (n a power of two); entries +-1/sqrt(n)."""
    if n < 1 or n & (n - 1):
        raise KvcCodecError(f"hadamard size must be a power of two, got {n}")
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / math.sqrt(n)).astype(np.float32)


@njit(cache=True)
def _inv_transform_nb(y, bt, mean, out):  # pragma: no cover - numba
    # y [H, N, K], bt [H, K, D], mean [H, D], out [H, N, D]; no fastmath: no contraction
    H, N, K = y.shape
    D = bt.shape[2]
    for h in range(H):
        for n in range(N):
            for d in range(D):
                acc = np.float32(0.0)
                for k in range(K):
                    acc = acc + y[h, n, k] * bt[h, k, d]
                out[h, n, d] = acc + mean[h, d]


def transform_decode(y: np.ndarray, basis: np.ndarray, mean: np.ndarray, fast: bool = True) -> np.ndarray:
    """x[h, t, d] = (sum_{k=0..K-1} y[h,t,k] * B[h,d,k]) + mean[h,d], float32, k ascending.

    y float32 [H, T, K]; basis float32 [H, D, K] (columns = basis vectors);
    mean float32 [H, D]. acc starts at +0.0; each product and each add is a
    separately rounded float32 op; the mean is added last.
    ``fast=False`` runs the numpy reference loop (the definition).
    """
    y = np.ascontiguousarray(y, dtype=np.float32)
    bt = np.ascontiguousarray(np.swapaxes(basis.astype(np.float32), 1, 2))  # [H, K, D]
    mean = np.ascontiguousarray(mean, dtype=np.float32)
    H, T, K = y.shape
    D = bt.shape[2]
    if fast:
        out = np.empty((H, T, D), dtype=np.float32)
        _inv_transform_nb(y, bt, mean, out)
        return out
    acc = np.zeros((H, T, D), dtype=np.float32)
    for k in range(K):
        acc = acc + y[:, :, k : k + 1] * bt[:, k : k + 1, :]
    return acc + mean[:, None, :]


@register
class TransformStage(ArrayToArray):
    """Orthonormal transform, keeping the first ``k`` coefficients.

    Config: ``basis`` = "hadamard" (fixed, no mean) or "pca" (attachments
    ``<attachment>.basis`` [2L, H, D, Kb] and ``<attachment>.mean`` [2L, H, D],
    float16 or float32, row 2*layer + (0 for k, 1 for v)); ``k`` <= Kb.
    """

    name = "transform"
    version = 1

    def __init__(self, basis: str = "pca", k: int | None = None, attachment: str = "pca") -> None:
        if basis not in ("pca", "hadamard"):
            raise KvcCodecError(f"codec 'transform': basis must be 'pca' or 'hadamard', got {basis!r}")
        self.basis = basis
        self.k = None if k is None else _int(k, "k", "transform", 1, 1 << 16)
        if not isinstance(attachment, str) or not attachment:
            raise KvcCodecError("codec 'transform': attachment must be a non-empty string")
        self.attachment = attachment

    def get_config(self) -> dict[str, Any]:
        c: dict[str, Any] = {"basis": self.basis, "k": self.k}
        if self.basis == "pca":
            c["attachment"] = self.attachment
        return c

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        H, T, D = spec.shape
        return ArraySpec((H, T, D if self.k is None else self.k), "float32")

    def matrices(self, H: int, D: int, ctx: ChunkContext) -> tuple[np.ndarray, np.ndarray]:
        """(basis float32 [H, D, K], mean float32 [H, D]) for this chunk; validates attachments."""
        K = D if self.k is None else self.k
        if K > D:
            raise KvcFormatError(f"codec 'transform': k={K} exceeds {D} channels")
        if self.basis == "hadamard":
            b = np.broadcast_to(hadamard(D)[:, :K], (H, D, K))
            return np.ascontiguousarray(b), np.zeros((H, D), np.float32)
        nb, nm = f"{self.attachment}.basis", f"{self.attachment}.mean"
        att = ctx.attachments  # stored and external alike (the writer passes the external arrays it encodes with)
        if nb not in att or nm not in att:
            raise KvcFormatError(f"codec 'transform': attachment {nb!r} or {nm!r} is missing")
        B, M = np.asarray(att[nb]), np.asarray(att[nm])
        if B.dtype.name not in _FLOATS or M.dtype.name not in _FLOATS:
            raise KvcFormatError(f"codec 'transform': attachments must be float16/float32, got {B.dtype}/{M.dtype}")
        if B.ndim != 4 or B.shape[2] != D or B.shape[1] < H or B.shape[3] < K or 2 * ctx.layer + 1 >= B.shape[0]:
            raise KvcFormatError(f"codec 'transform': basis attachment {B.shape} does not fit layer {ctx.layer}, {H} heads, {D} channels, k={K}")
        if M.shape != B.shape[:3]:
            raise KvcFormatError(f"codec 'transform': mean attachment {M.shape}, expected {B.shape[:3]}")
        kind = KIND_INDEX.get(ctx.kind)
        if kind is None:
            raise KvcFormatError(f"codec 'transform': unknown tensor kind {ctx.kind!r}")
        row = 2 * ctx.layer + kind
        h0 = int(ctx.extra.get("head_start", 0))
        if h0 < 0 or h0 + H > B.shape[1]:
            raise KvcFormatError(f"codec 'transform': heads {h0}..{h0 + H} outside the basis attachment")
        b = B[row, h0 : h0 + H, :, :K].astype(np.float32)
        m = M[row, h0 : h0 + H].astype(np.float32)
        if not (np.isfinite(b).all() and np.isfinite(m).all()):
            raise KvcFormatError("codec 'transform': basis or mean contains NaN or inf")
        return b, m

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        _check3(arr, "transform", _FLOATS)
        H, T, D = arr.shape
        b, m = self.matrices(H, D, ctx)
        # least-squares coefficients for the (fp16-rounded, slightly non-orthonormal) basis:
        # y = (x - m) B (B^T B)^-1, so that decode(encode(x)) is as close to x as the basis allows
        b64 = b.astype(np.float64)
        proj = np.einsum("hdk,hkj->hdj", b64, np.linalg.inv(np.einsum("hdk,hdj->hkj", b64, b64)))
        y = np.matmul(arr.astype(np.float32) - m[:, None, :], proj.astype(np.float32))
        return y.astype(np.float32), {}

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        _no_extra(side, "transform", set())
        H, T, D = spec.shape
        b, m = self.matrices(H, D, ctx)
        if arr.shape != (H, T, b.shape[2]) or arr.dtype != np.float32:
            raise KvcFormatError(f"codec 'transform': got {arr.dtype}{arr.shape}, expected float32{(H, T, b.shape[2])}")
        return transform_decode(arr, b, m).astype(spec.dtype)


# =========================================================================== quantize
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
                _int(b, "bits", "quantize", 2 if symmetric else 1, 8)
            self.bits = [int(b) for b in blist] if isinstance(bits, list) else int(bits)  # type: ignore[arg-type]
            if axis not in ("channel", "token"):
                raise KvcCodecError(f"codec 'quantize': axis must be 'channel' or 'token', got {axis!r}")
            self.axis = axis
            self.group = _int(group, "group", "quantize", 1, 1 << 30)
            if not isinstance(symmetric, (bool, np.bool_)):
                raise KvcCodecError(f"codec 'quantize': symmetric must be true or false, got {symmetric!r}")
            self.symmetric = bool(symmetric)

    def _set_step(self, step: Any, max_bits: Any, deadzone: Any, max_bits_limit: int) -> None:
        """Validate and set step mode's config (v1 codes up to 8 bits, v2 up to 16)."""
        if isinstance(step, bool) or not isinstance(step, (int, float)) or not math.isfinite(step) or step <= 0:
            raise KvcCodecError(f"codec 'quantize': step must be a positive finite number, got {step!r}")
        self.step = float(step)
        self.max_bits = _int(max_bits, "max_bits", "quantize", 1, max_bits_limit)
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
        _check3(arr, "quantize", _FLOATS)
        x = arr.astype(np.float32)
        if not np.isfinite(x).all():
            raise KvcCodecError("codec 'quantize': input contains NaN or inf")
        return self._enc_step(x) if self.mode == "step" else self._enc_minmax(x)

    def _enc_step(self, x: np.ndarray) -> tuple[np.ndarray, SideData]:
        """(zigzag symbols, uint8 for max_bits <= 8 else uint16 [H, T, C]; side data step, bits)."""
        H, T, C = x.shape
        lim = (1 << (self.max_bits - 1)) - 1  # |q| <= lim keeps zigzag < 2**max_bits
        sym_dtype = np.uint8 if self.max_bits <= 8 else np.uint16
        amax = np.abs(x).max(axis=1) if T else np.zeros((H, C), np.float32)
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
        _no_extra(side, "quantize", {"step", "bits"})
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
        _no_extra(side, "quantize", {"scale"} if self.symmetric else {"scale", "zero"})
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
    greedy tokens flip at clear margins (issue 15; benchmarks/results/floor.txt).
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


from kvcodec.codecs import tokenscale as _tokenscale  # noqa: E402,F401  (registers the tokenscale stage)
