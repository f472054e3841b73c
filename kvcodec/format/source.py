"""Byte sources a `.kvc` reader can read from.

Every source exposes ``size`` and ``read(offset, length) -> bytes-like`` and
raises :class:`KvcFormatError` on a short read. Accepted inputs:

* ``bytes`` / ``bytearray`` / ``memoryview``
* a path (``str`` / ``os.PathLike``): memory-mapped, so reading one layer of a
  large file touches only that layer's pages
* a binary file object with ``seek``/``read``
* any object with an integer ``size`` and ``read(offset, length)`` (e.g. the
  store's ``FileRangeReader`` / HTTP ``RangeReader``)
"""

from __future__ import annotations

import io
import mmap
import os
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ..errors import KvcFormatError, KvcInputError


@runtime_checkable
class RangeSource(Protocol):
    size: int

    def read(self, offset: int, length: int) -> bytes: ...


class _Base:
    size: int
    name: str = "<source>"

    def _check(self, offset: int, length: int) -> None:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise KvcFormatError(f"read of {length} bytes at offset {offset} runs past the end of the {self.size}-byte {self.name}")

    def close(self) -> None:
        pass


class BytesSource(_Base):
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data)
        if not mv.readonly:
            mv = memoryview(bytes(mv))
        self._mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        self.size = len(self._mv)
        self.name = "buffer"

    def read(self, offset: int, length: int) -> memoryview:
        self._check(offset, length)
        return self._mv[offset : offset + length]


class MmapSource(_Base):
    def __init__(self, path: Path) -> None:
        self.name = str(path)
        try:
            self._f = open(path, "rb")
        except FileNotFoundError:
            raise KvcInputError(f"no such file: {path}") from None
        except IsADirectoryError:
            raise KvcInputError(f"{path} is a directory, not a .kvc file") from None
        except OSError as exc:
            raise KvcInputError(f"cannot open {path}: {exc.strerror}") from None
        self.size = os.fstat(self._f.fileno()).st_size
        self._mm: mmap.mmap | None = None
        self._mv: memoryview | None = None
        if self.size:
            try:
                self._mm = mmap.mmap(self._f.fileno(), 0, access=mmap.ACCESS_READ)
                self._mv = memoryview(self._mm)
            except (OSError, ValueError):  # e.g. a FIFO or a filesystem without mmap: fall back to reads
                self._mm = None

    def read(self, offset: int, length: int) -> bytes | memoryview:
        self._check(offset, length)
        if self._mv is not None:
            return self._mv[offset : offset + length]
        self._f.seek(offset)
        b = self._f.read(length)
        if len(b) != length:
            raise KvcFormatError(f"short read in {self.name}: wanted {length} bytes at offset {offset}, got {len(b)}")
        return b

    def close(self) -> None:
        if self._mv is not None:
            self._mv.release()
            self._mv = None
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # arrays still view the map; it closes when they go
                pass
            self._mm = None
        self._f.close()


class FileObjectSource(_Base):
    def __init__(self, f: Any) -> None:
        self._f = f
        self.name = str(getattr(f, "name", "file object"))
        try:
            self.size = f.seek(0, io.SEEK_END)
        except (OSError, ValueError, AttributeError) as exc:
            raise KvcInputError(f"the file object is not seekable ({exc}); reading .kvc from a pipe is not supported") from None

    def read(self, offset: int, length: int) -> bytes:
        self._check(offset, length)
        self._f.seek(offset)
        b = self._f.read(length)
        if not isinstance(b, (bytes, bytearray)) or len(b) != length:
            got = len(b) if isinstance(b, (bytes, bytearray)) else type(b).__name__
            raise KvcFormatError(f"short read in {self.name}: wanted {length} bytes at offset {offset}, got {got}")
        return bytes(b)


class RangeObjectSource(_Base):
    """Wraps any object with ``size`` and ``read(offset, length)``; checks every read's length."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        size = obj.size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise KvcInputError(f"range source reports a bad size {size!r}")
        self.size = size
        self.name = str(getattr(obj, "url", None) or getattr(obj, "name", None) or type(obj).__name__)

    def read(self, offset: int, length: int) -> bytes | memoryview:
        self._check(offset, length)
        if length == 0:
            return b""
        b = self._obj.read(offset, length)
        try:
            n = memoryview(b).nbytes
        except TypeError:
            raise KvcFormatError(f"range source {self.name} returned {type(b).__name__}, not bytes") from None
        if n != length:
            raise KvcFormatError(f"short read from {self.name}: wanted {length} bytes at offset {offset}, got {n}")
        return b


def open_source(source: Any) -> _Base:
    if isinstance(source, _Base):
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return BytesSource(source)
    if isinstance(source, (str, os.PathLike)):
        return MmapSource(Path(source))
    if hasattr(source, "size") and callable(getattr(source, "read", None)) and not hasattr(source, "seek"):
        return RangeObjectSource(source)
    if callable(getattr(source, "read", None)) and callable(getattr(source, "seek", None)):
        return FileObjectSource(source)
    if hasattr(source, "size") and callable(getattr(source, "read", None)):
        return RangeObjectSource(source)
    raise KvcInputError(f"cannot read a .kvc file from a {type(source).__name__}")
