"""Codec stages that reimplement the baselines kvcodec is compared against.

They are ordinary registered stages, so a baseline is written into a real
``.kvc`` file and its size is real file bytes (header, side data, checksums
and all), exactly like kvcodec's own presets.

Stages (each one's encode/decode is *the* definition of the baseline; the
tests hold them to an independent numpy implementation bit for bit):

``bl_int8_token`` (array->array, -> int8)
    Per-token int8: one absmax scale per (head, token), stored as fp16.
    ``s = f32(f16(absmax / 127))``; ``q = clip(rint(x / s), -127, 127)``;
    ``x' = q * s``. A zero row has ``s = 0`` and decodes to 0.
``bl_kivi`` (array->bytes)
    KIVI (Liu et al. 2024): keys per channel in groups of ``group`` tokens,
    values per token in groups of ``group`` channels; asymmetric min/max,
    fp16 scale and zero point; the last ``residual`` tokens of the tensor are
    kept in fp16; ``bits``-bit codes are bit-packed. For a group:
    ``s = f16((max - min) / L)``, ``z = f16(min)``, ``L = 2**bits - 1``,
    ``q = clip(rint((x - z) / s), 0, L)`` (``q = 0`` where ``s == 0``),
    ``x' = q * s + z``. A last, shorter key group (when the quantized
    prefix is not a multiple of ``group``) is its own group.
``bl_cachegen`` (array->bytes)
    CacheGen as shipped in LMCache: one max-abs scale per token over all
    heads and channels of the (layer, kind) tensor (fp16), ``MAX = bins//2 - 1``,
    ``q = clip(rint(x * (MAX / s) + MAX), 0, 2*MAX)``,
    ``x' = (q - MAX) / MAX * s``; no delta/anchor coding; per chunk of
    ``chunk_tokens`` tokens and per channel (``h * D + d``) a CDF with
    ``cdf_entries`` int16 entries (16-bit precision, LMCache/torchac
    renormalisation: ``round(cdf * (2**16 - (n - 1))) + arange(n)``) stored
    raw, and one range-coded stream per (chunk, channel) (constriction 0.5.0
    ``RangeEncoder`` with the stored CDF as an exact ``Categorical``), with a
    uint32 word-length table.

All float math is float32; the decoded array is cast to the stage's input
dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ArrayToArray, ArrayToBytes, ChunkContext, SideData, register, side_array

_FLOAT_DTYPES = ("float16", "float32", "float64")


_FP16_MAX = 65504.0


def _check_float(name: str, arr: np.ndarray) -> np.ndarray:
    """A float array every baseline can code: finite and within float16, whose scales they store (one NaN, inf or
    1e30 made every other value of its token or channel NaN in the decoded file, silently)."""
    if arr.dtype.kind != "f":
        raise KvcCodecError(f"codec {name!r} codes float arrays, got {arr.dtype}")
    if arr.size:
        if not np.isfinite(arr).all():
            raise KvcCodecError(f"codec {name!r}: input contains NaN or inf")
        big = float(np.abs(arr).max())
        if big > _FP16_MAX:
            raise KvcCodecError(f"codec {name!r}: a value of magnitude {big:.4g} overflows the float16 scales it stores "
                                "(max 65504); use the lossless preset for this cache")
    return arr


def _check3(name: str, shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise KvcCodecError(f"codec {name!r} codes (heads, tokens, channels) arrays, got shape {tuple(shape)}")
    return int(shape[0]), int(shape[1]), int(shape[2])


# -- bit packing -------------------------------------------------------------
def pack_bits(q: np.ndarray, bits: int) -> bytes:
    """Pack uint8 codes < 2**bits, little-endian within each byte (first code in the low bits)."""
    if bits == 8:
        return np.ascontiguousarray(q, dtype=np.uint8).tobytes()
    per = 8 // bits
    flat = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1)
    pad = (-flat.size) % per
    if pad:
        flat = np.concatenate([flat, np.zeros(pad, np.uint8)])
    g = flat.reshape(-1, per).astype(np.uint16)
    shifts = (np.arange(per, dtype=np.uint16) * bits)[None, :]
    return (g << shifts).sum(axis=1).astype(np.uint8).tobytes()


def unpack_bits(data: bytes | memoryview, bits: int, n: int) -> np.ndarray:
    per = 8 // bits
    need = -(-n // per)
    buf = np.frombuffer(data, dtype=np.uint8)
    if buf.size != need:
        raise KvcFormatError(f"bit-packed payload has {buf.size} bytes, expected {need}")
    if bits == 8:
        return buf.copy()
    shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
    return ((buf[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n].astype(np.uint8)


# -- per-token int8 -----------------------------------------------------------
def int8_token_quant(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(q int8 (H,T,D), scale fp16 (H,T,1)) of the per-token absmax scheme."""
    x = x.astype(np.float32)
    amax = np.abs(x).max(axis=-1, keepdims=True)
    s16 = (amax / np.float32(127.0)).astype(np.float16)
    s = s16.astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))
    q = np.clip(np.rint(x / safe), -127, 127).astype(np.int8)
    return q, s16


@register
class Int8TokenStage(ArrayToArray):
    """Per-token int8: one absmax scale per (head, token), fp16 scale as side data."""

    name = "bl_int8_token"
    version = 1

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        return ArraySpec(spec.shape, "int8")

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        arr = _check_float(self.name, np.asarray(arr))
        _check3(self.name, arr.shape)
        q, s16 = int8_token_quant(arr)
        return q, {"scale": s16}

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, D = _check3(self.name, spec.shape)
        s = side_array(side, "scale", self.name, (H, T, 1), "float16").astype(np.float32)
        q = np.asarray(arr)
        if q.dtype != np.int8 or q.shape != (H, T, D):
            raise KvcFormatError(f"codec {self.name!r}: got {q.dtype}{q.shape}, expected int8{(H, T, D)}")
        return (q.astype(np.float32) * s).astype(spec.dtype)


# -- KIVI ---------------------------------------------------------------------
def _group_starts(n: int, group: int) -> np.ndarray:
    return np.arange(0, n, group, dtype=np.int64)


@register
class KiviStage(ArrayToBytes):
    """KIVI-style asymmetric group quantization with an fp16 recent window, bit-packed.

    ``layout="code"`` keeps in fp16 what KIVI's code keeps after prefill: the
    last ``T % residual`` keys (keys are quantized in whole groups of
    ``residual`` tokens) and the last ``residual`` values. ``layout="window"``
    (the first reimplementation, kept so its files still decode) keeps the last
    ``residual`` tokens of both, which overcharges KIVI's keys.
    """

    name = "bl_kivi"
    version = 1

    def __init__(self, bits: int = 2, mode: str = "key", group: int = 32, residual: int = 128, layout: str = "window") -> None:
        if bits not in (1, 2, 4, 8):
            raise KvcCodecError(f"codec 'bl_kivi': bits must be 1, 2, 4 or 8, got {bits!r}")
        if mode not in ("key", "value"):
            raise KvcCodecError(f"codec 'bl_kivi': mode must be 'key' or 'value', got {mode!r}")
        if not isinstance(group, int) or group <= 0 or not isinstance(residual, int) or residual < 0:
            raise KvcCodecError(f"codec 'bl_kivi': bad group {group!r} / residual {residual!r}")
        if layout not in ("window", "code"):
            raise KvcCodecError(f"codec 'bl_kivi': layout must be 'window' or 'code', got {layout!r}")
        self.bits, self.mode, self.group, self.residual, self.layout = bits, mode, group, residual, layout

    def get_config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {"bits": self.bits, "mode": self.mode, "group": self.group, "residual": self.residual}
        if self.layout != "window":  # files written before the option keep their exact config
            cfg["layout"] = self.layout
        return cfg

    def _layout(self, H: int, T: int, D: int) -> tuple[int, tuple[int, int, int]]:
        if self.layout == "code" and self.mode == "key":
            tq = T - T % self.residual if self.residual else T
        else:
            tq = max(T - self.residual, 0)
        n_groups = (len(_group_starts(tq, self.group)), D) if self.mode == "key" else (tq, len(_group_starts(D, self.group)))
        return tq, (H, *n_groups)

    def _expand(self, a: np.ndarray, tq: int, D: int) -> np.ndarray:
        """Broadcast per-group parameters back to the (H, tq, D) grid."""
        if self.mode == "key":
            return np.repeat(a, self.group, axis=1)[:, :tq, :]
        return np.repeat(a, self.group, axis=2)[:, :, :D]

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]:
        arr = _check_float(self.name, np.asarray(arr))
        H, T, D = _check3(self.name, arr.shape)
        x = arr.astype(np.float32)
        tq, _ = self._layout(H, T, D)
        xq, tail = x[:, :tq, :], x[:, tq:, :].astype(np.float16)
        L = np.float32((1 << self.bits) - 1)
        if tq:
            axis = 1 if self.mode == "key" else 2
            starts = _group_starts(tq if axis == 1 else D, self.group)
            mn = np.minimum.reduceat(xq, starts, axis=axis)
            mx = np.maximum.reduceat(xq, starts, axis=axis)
            scale = ((mx - mn) / L).astype(np.float16)
            zero = mn.astype(np.float16)
            s = self._expand(scale.astype(np.float32), tq, D)
            z = self._expand(zero.astype(np.float32), tq, D)
            safe = np.where(s > 0, s, np.float32(1.0))
            q = np.where(s > 0, np.clip(np.rint((xq - z) / safe), 0, L), 0).astype(np.uint8)
        else:
            _, gshape = self._layout(H, T, D)
            scale = zero = np.zeros(gshape, np.float16)
            q = np.zeros((H, 0, D), np.uint8)
        return pack_bits(q, self.bits), {"scale": scale, "zero": zero, "tail": np.ascontiguousarray(tail)}

    def decode(self, data: bytes | memoryview, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        H, T, D = _check3(self.name, spec.shape)
        tq, gshape = self._layout(H, T, D)
        scale = side_array(side, "scale", self.name, gshape, "float16").astype(np.float32)
        zero = side_array(side, "zero", self.name, gshape, "float16").astype(np.float32)
        tail = side_array(side, "tail", self.name, (H, T - tq, D), "float16")
        q = unpack_bits(data, self.bits, H * tq * D).reshape(H, tq, D)
        out = np.empty((H, T, D), np.float32)
        if tq:
            out[:, :tq] = q.astype(np.float32) * self._expand(scale, tq, D) + self._expand(zero, tq, D)
        out[:, tq:] = tail.astype(np.float32)
        return out.astype(spec.dtype)


# -- CacheGen as shipped -------------------------------------------------------
def renorm_cdf(counts: np.ndarray, precision: int = 16) -> np.ndarray:
    """LMCache/torchac ``_renorm_cast_cdf_``: histogram [..., n-1] -> integer CDF [..., n] (int64).

    ``cdf = round([0, cumsum(p)] * (2**precision - (n - 1))) + arange(n)``, so
    every symbol gets frequency >= 1 and the last entry is ``2**precision``.
    """
    counts = np.asarray(counts, dtype=np.float32)
    total = counts.sum(axis=-1, keepdims=True)
    pdf = counts / np.where(total > 0, total, np.float32(1.0))
    cdf = np.concatenate([np.zeros(pdf.shape[:-1] + (1,), np.float32), np.cumsum(pdf, axis=-1, dtype=np.float32)], axis=-1)
    cdf[..., -1] = 1.0  # a cumsum of float probabilities may miss 1 by an ulp
    n = cdf.shape[-1]
    scaled = np.rint(cdf * np.float32((1 << precision) - (n - 1))).astype(np.int64)
    return scaled + np.arange(n, dtype=np.int64)


def cachegen_quant(x: np.ndarray, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """(q uint8 (T, C), scale fp16 (T,)) for one (layer, kind) tensor (H, T, D); C = H*D, c = h*D + d."""
    H, T, D = x.shape
    xc = x.astype(np.float32).transpose(1, 0, 2).reshape(T, H * D)
    mx = np.float32(bins // 2 - 1)
    s16 = np.abs(xc).max(axis=1).astype(np.float16)
    s = s16.astype(np.float32)
    factor = np.where(s > 0, mx / np.where(s > 0, s, np.float32(1.0)), np.float32(0.0))
    q = np.clip(np.rint(xc * factor[:, None] + mx), 0, 2 * mx).astype(np.uint8)
    return q, s16


def cachegen_dequant(q: np.ndarray, s16: np.ndarray, bins: int, shape: tuple[int, int, int]) -> np.ndarray:
    H, T, D = shape
    mx = np.float32(bins // 2 - 1)
    y = (q.astype(np.float32) - mx) / mx * s16.astype(np.float32)[:, None]
    return y.reshape(T, H, D).transpose(1, 0, 2)


def _constriction():
    try:
        import constriction
    except ImportError:
        raise KvcCodecError("codec 'bl_cachegen' needs constriction==0.5.0 (pip install constriction==0.5.0)") from None
    return constriction


@register
class CacheGenStage(ArrayToBytes):
    """LMCache's CacheGen codec as shipped (per-token scale, per-chunk-per-channel CDF, range coder)."""

    name = "bl_cachegen"
    version = 1

    def __init__(self, bins: int = 32, chunk_tokens: int = 256, cdf_entries: int = 33, precision: int = 16) -> None:
        if not isinstance(bins, int) or not 4 <= bins <= 256 or bins % 2:
            raise KvcCodecError(f"codec 'bl_cachegen': bins must be an even integer in [4, 256], got {bins!r}")
        if not isinstance(cdf_entries, int) or cdf_entries < bins - 1 + 1 or cdf_entries > 257:
            raise KvcCodecError(f"codec 'bl_cachegen': cdf_entries {cdf_entries!r} cannot hold {bins - 1} symbols")
        if not isinstance(chunk_tokens, int) or chunk_tokens <= 0 or precision != 16:
            raise KvcCodecError(f"codec 'bl_cachegen': bad chunk_tokens {chunk_tokens!r} / precision {precision!r}")
        self.bins, self.chunk_tokens, self.cdf_entries, self.precision = bins, chunk_tokens, cdf_entries, precision

    def get_config(self) -> dict[str, Any]:
        return {"bins": self.bins, "chunk_tokens": self.chunk_tokens, "cdf_entries": self.cdf_entries, "precision": self.precision}

    def _model(self, cdf_row: np.ndarray):
        c = _constriction()
        freq24 = np.diff(cdf_row).astype(np.int64) << (24 - self.precision)
        # perfect=False maps probabilities p to cdf_i = floor(cumsum(p)_<i * (2^24 - n) / sum p) + i;
        # with p = F - 1 (sum 2^24 - n) that is exactly cumsum(F): the stored table, bit for bit.
        return c.stream.model.Categorical((freq24 - 1).astype(np.float64), perfect=False)

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]:
        c = _constriction()
        arr = _check_float(self.name, np.asarray(arr))
        H, T, D = _check3(self.name, arr.shape)
        q, s16 = cachegen_quant(arr, self.bins)
        C, n = H * D, self.cdf_entries
        starts = list(range(0, T, self.chunk_tokens))
        cdfs = np.zeros((len(starts), C, n), np.int16)
        lengths = np.zeros((len(starts), C), np.uint32)
        words: list[np.ndarray] = []
        for j, t0 in enumerate(starts):
            block = q[t0 : t0 + self.chunk_tokens]  # (tokens, C)
            counts = np.zeros((C, n - 1), np.int64)
            np.add.at(counts, (np.broadcast_to(np.arange(C), block.shape), block), 1)
            cdf = renorm_cdf(counts, self.precision)
            cdfs[j] = cdf.astype(np.uint16).view(np.int16)  # 2^16 wraps to 0, as in LMCache's int16 tensor
            sym = np.ascontiguousarray(block.T).astype(np.int32)
            for ch in range(C):
                enc = c.stream.queue.RangeEncoder()
                enc.encode(sym[ch], self._model(cdf[ch]))
                w = enc.get_compressed()
                lengths[j, ch] = w.size
                words.append(w)
        payload = np.concatenate(words).astype("<u4").tobytes() if words else b""
        return payload, {"scale": s16, "cdf": cdfs, "length": lengths}

    def decode(self, data: bytes | memoryview, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        c = _constriction()
        H, T, D = _check3(self.name, spec.shape)
        C, n = H * D, self.cdf_entries
        starts = list(range(0, T, self.chunk_tokens))
        s16 = side_array(side, "scale", self.name, (T,), "float16")
        cdfs = side_array(side, "cdf", self.name, (len(starts), C, n), "int16").view(np.uint16).astype(np.int64)
        cdfs[..., -1] += 1 << self.precision  # the wrapped 2^16
        lengths = side_array(side, "length", self.name, (len(starts), C), "uint32").astype(np.int64)
        freqs = np.diff(cdfs, axis=-1)
        if cdfs[..., 0].any() or (freqs <= 0).any() or (cdfs[..., -1] != 1 << self.precision).any():
            raise KvcFormatError(f"codec {self.name!r}: stored CDF is not a valid {self.precision}-bit table")
        buf = np.frombuffer(data, dtype="<u4") if len(data) % 4 == 0 else None
        if buf is None or buf.size != int(lengths.sum()):
            raise KvcFormatError(f"codec {self.name!r}: payload is {len(data)} bytes, length table says {4 * int(lengths.sum())}")
        q = np.empty((T, C), np.uint8)
        off = 0
        for j, t0 in enumerate(starts):
            nt = min(self.chunk_tokens, T - t0)
            for ch in range(C):
                w = buf[off : off + lengths[j, ch]].astype(np.uint32)
                off += int(lengths[j, ch])
                try:
                    sym = c.stream.queue.RangeDecoder(w).decode(self._model(cdfs[j, ch]), nt)
                except Exception as exc:  # constriction raises its own errors on corrupt streams
                    raise KvcFormatError(f"codec {self.name!r}: corrupt range-coded stream ({exc})") from None
                q[t0 : t0 + nt, ch] = sym
        if int(q.max(initial=0)) > 2 * (self.bins // 2 - 1):
            raise KvcFormatError(f"codec {self.name!r}: decoded symbol out of range for {self.bins} bins")
        return cachegen_dequant(q, s16, self.bins, (H, T, D)).astype(spec.dtype)
