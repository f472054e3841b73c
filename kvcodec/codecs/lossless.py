"""Container-level stages: ``cast`` (array->array), ``raw`` (array->bytes), ``shuffle`` and ``zstd`` (bytes->bytes).

The ``lossless`` preset is raw -> shuffle(itemsize) -> zstd; ``fp16`` is
cast(float16) -> raw -> shuffle(2) -> zstd (exact for fp16 caches, one
rounding to fp16 for fp32 ones). See
spec/kvc-v1.md section 8 for the normative definition of each stage.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import zstandard

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ArrayToArray, ArrayToBytes, BytesToBytes, ChunkContext, Pipeline, SideData, register
from kvcodec.core.dtypes import DTYPE_BY_NAME, np_le

ZSTD_MAX_WINDOW = 1 << 23
ZSTD_LEVELS = range(-7, 20)


CAST_DTYPES = ("float16", "float32")


@register
class Cast(ArrayToArray):
    """Round to ``dtype`` (numpy's round-to-nearest-even); decode widens back exactly to the input dtype."""

    name = "cast"
    version = 1

    def __init__(self, dtype: str = "float16") -> None:
        if dtype not in CAST_DTYPES:
            raise KvcCodecError(f"codec 'cast': dtype must be one of {CAST_DTYPES}, got {dtype!r}")
        self.dtype = dtype

    def get_config(self) -> dict[str, Any]:
        return {"dtype": self.dtype}

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        return ArraySpec(spec.shape, self.dtype)

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]:
        if arr.dtype.kind != "f":
            raise KvcCodecError(f"codec 'cast' needs floating-point input, got {arr.dtype}")
        with np.errstate(over="ignore"):
            out = np.ascontiguousarray(arr.astype(self.dtype))
        # NaN and +-inf are stored as they are (exact); a finite value that becomes inf is not
        overflow = np.isinf(out) & np.isfinite(arr)
        if overflow.any():
            big = float(np.abs(arr[overflow].astype(np.float64)).max())
            raise KvcCodecError(f"codec 'cast': a value of magnitude {big:.4g} overflows {self.dtype} "
                                f"(max {float(np.finfo(self.dtype).max):.6g}); use the lossless preset for this cache")
        return out, {}

    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        if spec.dtype not in CAST_DTYPES:
            raise KvcFormatError(f"codec 'cast' cannot widen to {spec.dtype}")
        return np.asarray(arr).astype(spec.dtype)


@register
class Raw(ArrayToBytes):
    """Elements in C order, little-endian. ``dtype="bfloat16"`` packs exact-bf16 float32 input into 2 bytes."""

    name = "raw"
    version = 1

    def __init__(self, dtype: str | None = None) -> None:
        if dtype not in (None, "bfloat16"):
            raise KvcCodecError(f"codec 'raw': config dtype must be absent or 'bfloat16', got {dtype!r}")
        self.dtype = dtype

    def get_config(self) -> dict[str, Any]:
        return {} if self.dtype is None else {"dtype": self.dtype}

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]:
        arr = np.ascontiguousarray(arr)
        if self.dtype == "bfloat16":
            if arr.dtype != np.float32:
                raise KvcCodecError(f"codec 'raw' (bfloat16) needs float32 input, got {arr.dtype}")
            bits = arr.view(np.uint32)
            if np.any(bits & 0xFFFF):
                raise KvcCodecError("codec 'raw' (bfloat16): input is not exactly representable in bfloat16")
            return (bits >> 16).astype("<u2").tobytes(), {}
        if arr.dtype.name not in DTYPE_BY_NAME:
            raise KvcCodecError(f"codec 'raw' cannot store dtype {arr.dtype}")
        return arr.astype(np_le(arr.dtype.name), copy=False).tobytes(), {}

    def decode(self, data: bytes | memoryview, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        if side:
            raise KvcFormatError(f"codec 'raw' takes no side data, chunk has {sorted(side)}")
        n = int(np.prod(spec.shape, dtype=np.int64)) if spec.shape else 1
        if self.dtype == "bfloat16":
            if spec.dtype != "float32":
                raise KvcFormatError(f"codec 'raw' (bfloat16) decodes to float32, not {spec.dtype}")
            if len(data) != 2 * n:
                raise KvcFormatError(f"codec 'raw': {len(data)} bytes for {n} bfloat16 elements")
            hi = np.frombuffer(data, dtype="<u2").astype(np.uint32)
            return (hi << 16).view(np.float32).reshape(spec.shape)
        if spec.dtype not in DTYPE_BY_NAME:
            raise KvcFormatError(f"codec 'raw' cannot decode dtype {spec.dtype}")
        dt = np_le(spec.dtype)
        if len(data) != n * dt.itemsize:
            raise KvcFormatError(f"codec 'raw': {len(data)} bytes for {n} {spec.dtype} elements")
        return np.frombuffer(data, dtype=dt).astype(dt.newbyteorder("="), copy=True).reshape(spec.shape)


@register
class Shuffle(BytesToBytes):
    """Byte shuffle: byte b of every element, for b = 0 .. elementsize-1; a tail shorter than one element is copied."""

    name = "shuffle"
    version = 1

    def __init__(self, elementsize: int = 2) -> None:
        if not isinstance(elementsize, int) or isinstance(elementsize, bool) or not 1 <= elementsize <= 16:
            raise KvcCodecError(f"codec 'shuffle': elementsize must be an int in [1, 16], got {elementsize!r}")
        self.elementsize = elementsize

    def get_config(self) -> dict[str, Any]:
        return {"elementsize": self.elementsize}

    def encode(self, data: bytes, ctx: ChunkContext) -> bytes:
        es = self.elementsize
        m = len(data) // es
        body = np.frombuffer(data, dtype=np.uint8, count=m * es).reshape(m, es)
        return body.T.tobytes() + bytes(data[m * es :])

    def decode(self, data: bytes | memoryview, max_size: int, ctx: ChunkContext) -> bytes:
        if len(data) > max_size:
            raise KvcFormatError(f"codec 'shuffle': {len(data)} input bytes exceed the declared {max_size}")
        es = self.elementsize
        m = len(data) // es
        body = np.frombuffer(data, dtype=np.uint8, count=m * es).reshape(es, m)
        return body.T.tobytes() + bytes(data[m * es :])


@register
class Zstd(BytesToBytes):
    """Zstandard, one frame; decoding never produces more than the declared size."""

    name = "zstd"
    version = 1

    def __init__(self, level: int = 3) -> None:
        if not isinstance(level, int) or isinstance(level, bool) or level not in ZSTD_LEVELS:
            raise KvcCodecError(f"codec 'zstd': level must be an int in [-7, 19], got {level!r}")
        self.level = level

    def get_config(self) -> dict[str, Any]:
        return {"level": self.level}

    def encode(self, data: bytes, ctx: ChunkContext) -> bytes:
        cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True, write_checksum=False)
        return cctx.compress(bytes(data))

    def decode(self, data: bytes | memoryview, max_size: int, ctx: ChunkContext) -> bytes:
        return bytes(zstd_decompress_exact(data, max_size))


def zstd_decompress_exact(data: bytes | memoryview, size: int) -> bytearray:
    """Decompress one zstd frame (plus trailing empty frames) to exactly ``size`` bytes.

    The only zstd decompression in kvcodec (the ``zstd`` stage and the fused
    lossless decoder both call it): the output buffer is the *declared* size,
    which the container already bounded, and decompression stops one byte past
    it -- a frame's own content-size field is never trusted, so a 49 KB bomb
    cannot expand to gigabytes. Fewer or more bytes, a window over 8 MiB or a
    corrupt stream are a :class:`KvcFormatError`.
    """
    if size < 0:
        raise KvcFormatError(f"codec 'zstd': negative declared size {size}")
    out = bytearray(size)
    view = memoryview(out)
    got = 0
    try:
        dctx = zstandard.ZstdDecompressor(max_window_size=ZSTD_MAX_WINDOW)
        with dctx.stream_reader(bytes(data), read_across_frames=True) as r:
            while got < size:
                n = r.readinto(view[got : min(size, got + (1 << 22))])
                if not n:
                    break
                got += n
            if got == size and r.read(1):
                raise KvcFormatError(f"codec 'zstd': output exceeds the declared {size} bytes")
    except zstandard.ZstdError as exc:
        raise KvcFormatError(f"codec 'zstd': corrupt stream: {exc}") from None
    finally:
        view.release()
    if got != size:
        raise KvcFormatError(f"codec 'zstd': produced {got} bytes, declared {size}")
    return out


def lossless_pipeline(tensor_dtype: str = "float16", level: int = 3, shuffle: bool = True) -> Pipeline:
    """raw -> shuffle(itemsize) -> zstd for a tensor of ``tensor_dtype`` (float16 | bfloat16 | float32)."""
    raw = Raw("bfloat16" if tensor_dtype == "bfloat16" else None)
    itemsize = 2 if tensor_dtype == "bfloat16" else np.dtype(tensor_dtype).itemsize
    stages: list = [raw]
    if shuffle:
        stages.append(Shuffle(itemsize))
    stages.append(Zstd(level))
    return Pipeline(stages)


def fp16_pipeline(level: int = 3) -> Pipeline:
    """cast(float16) -> raw -> shuffle(2) -> zstd: the cache as fp16, stored losslessly."""
    return Pipeline([Cast("float16"), Raw(), Shuffle(2), Zstd(level)])


def raw_pipeline(tensor_dtype: str = "float16") -> Pipeline:
    return Pipeline([Raw("bfloat16" if tensor_dtype == "bfloat16" else None)])
