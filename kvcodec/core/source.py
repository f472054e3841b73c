"""Byte sources a `.kvc` reader can read from.

Every source is a :class:`ByteSource` (one protocol and one error contract, shared with the
store's range readers). Accepted inputs:

* ``bytes`` / ``bytearray`` / ``memoryview``
* a path (``str`` / ``os.PathLike``) of a regular file: positional reads, so
  reading one layer of a large file reads only that layer's bytes (never
  memory-mapped: a file shrinking under a mapping is a SIGBUS)
* a binary file object with ``seek``/``read``
* a :class:`ByteSource` (e.g. the store's ``FileRangeReader`` / ``HttpRangeReader``), used as is
* any other object with an integer ``size`` and ``read(offset, length)`` (wrapped, every read checked)
"""

from __future__ import annotations

import contextlib
import io
import os
from pathlib import Path
from typing import Any, Iterator

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, KvcIOError


class ByteSource:
    """The ONE byte-source type: ``size``, ``read(offset, length)``, ``close()`` (a context manager).

    The reader's sources below and the store's range readers (:class:`kvcodec.store.ranged.RangeReader`:
    local files, HTTP, S3, tenant-scoped) all derive from it and implement only ``_read``, so they share
    one error contract, enforced here:

    * ``read`` returns exactly ``length`` bytes (a bytes-like object) or raises;
    * a negative offset or length is the caller's bug: :class:`KvcInputError`;
    * a range outside ``[0, size)`` or fewer bytes delivered than asked (a truncated or shrinking
      file, a short HTTP body): :class:`KvcFormatError` ("short read");
    * transport failures of remote sources: :class:`~kvcodec.errors.KvcStoreError` (raised by ``_read``).
    """

    size: int = 0
    name: str = "<source>"

    def _read(self, offset: int, length: int) -> bytes | bytearray | memoryview:  # pragma: no cover - abstract
        raise NotImplementedError

    def read(self, offset: int, length: int) -> bytes | bytearray | memoryview:
        """Exactly ``length`` bytes starting at ``offset``."""
        offset, length = int(offset), int(length)
        if offset < 0 or length < 0:
            raise KvcInputError(f"{self.name}: negative range offset={offset} length={length}")
        if offset + length > self.size:
            raise KvcFormatError(f"{self.name}: short read: {length} bytes at offset {offset} run past the end "
                                 f"of the {self.size}-byte source (truncated?)")
        if length == 0:
            return b""
        data = self._read(offset, length)
        try:
            n = memoryview(data).nbytes
        except TypeError:
            raise KvcFormatError(f"{self.name}: source returned {type(data).__name__}, not bytes") from None
        if n != length:
            raise KvcFormatError(f"{self.name}: short read at offset {offset}: wanted {length} bytes, got {n}")
        return data

    def read_all(self) -> bytes:
        return bytes(self.read(0, self.size))

    def close(self) -> None:
        pass

    def __enter__(self) -> "ByteSource":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return self.size

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r}, size={self.size})"


class BytesSource(ByteSource):
    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        mv = memoryview(data)
        if not mv.readonly:
            mv = memoryview(bytes(mv))
        self._mv = mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
        self.size = len(self._mv)
        self.name = "buffer"

    def _read(self, offset: int, length: int) -> memoryview:
        return self._mv[offset : offset + length]


class PathSource(ByteSource):
    """A local file read with ``os.pread``, never memory-mapped.

    A mapped file that shrinks under the reader kills the process with SIGBUS
    on the next touch of a vanished page; positional reads instead come back
    short, which is a :class:`KvcFormatError`. Only regular files are opened
    (a FIFO would block, a device could be endless): see
    :func:`kvcodec.limits.open_regular`; nor a sparse one (:func:`kvcodec.limits.check_not_sparse`).
    The size is fixed at open.
    """

    def __init__(self, path: Path) -> None:
        from kvcodec.limits import check_not_sparse, open_regular

        self.name = str(path)
        self._fd: int | None = open_regular(path, "a .kvc file")
        try:
            st = os.fstat(self._fd)
            check_not_sparse(st, self.name, "a .kvc file", self._fd)  # the ratio bound needs the bytes to be really there
        except BaseException:
            self.close()
            raise
        self.size = st.st_size

    def _read(self, offset: int, length: int) -> bytes:
        if self._fd is None:
            raise KvcInputError(f"{self.name}: reader is closed")
        parts: list[bytes] = []
        got = 0
        while got < length:
            try:
                b = os.pread(self._fd, min(length - got, 1 << 30), offset + got)
            except OSError as exc:
                raise KvcFormatError(f"read error in {self.name} at offset {offset + got}: {exc.strerror or exc}") from None
            if not b:
                raise KvcFormatError(
                    f"short read in {self.name}: wanted {length} bytes at offset {offset}, got {got} "
                    f"(the file shrank to less than its {self.size} bytes while being read)")
            parts.append(b)
            got += len(b)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class FileObjectSource(ByteSource):
    def __init__(self, f: Any) -> None:
        self._f = f
        self.name = str(getattr(f, "name", "file object"))
        try:
            self.size = f.seek(0, io.SEEK_END)
        except (OSError, ValueError, AttributeError) as exc:
            raise KvcInputError(f"the file object is not seekable ({exc}); reading .kvc from a pipe is not supported") from None

    def _read(self, offset: int, length: int) -> bytes:
        with _foreign(self.name, offset):
            self._f.seek(offset)
            b = self._f.read(length)
        if not isinstance(b, (bytes, bytearray)) or len(b) != length:
            got = len(b) if isinstance(b, (bytes, bytearray)) else type(b).__name__
            raise KvcFormatError(f"short read in {self.name}: wanted {length} bytes at offset {offset}, got {got}")
        return bytes(b)


class RangeObjectSource(ByteSource):
    """Wraps any object with ``size`` and ``read(offset, length)``; checks every read's length."""

    def __init__(self, obj: Any) -> None:
        self._obj = obj
        size = obj.size
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise KvcInputError(f"range source reports a bad size {size!r}")
        self.size = size
        self.name = str(getattr(obj, "url", None) or getattr(obj, "name", None) or type(obj).__name__)

    def _read(self, offset: int, length: int) -> bytes | memoryview:
        with _foreign(self.name, offset):
            return self._obj.read(offset, length)  # its length is checked by ByteSource.read


@contextlib.contextmanager
def _foreign(name: str, offset: int) -> Iterator[None]:
    """A caller's file or range object that fails its own way (an ``OSError``, a ``ValueError`` from a closed
    file, any exception of its own), as one :class:`~kvcodec.errors.KvcIOError` line naming the source and the
    offset; the object's exception stays chained for whoever debugs it. A KvcError of its own passes as it is."""
    try:
        yield
    except KvcError:
        raise
    except Exception as exc:
        why = (exc.strerror if isinstance(exc, OSError) else None) or " ".join(str(exc).split()) or "no message"
        raise KvcIOError(f"{name}: reading at offset {offset} failed: {type(exc).__name__}: {why}"[:400]) from exc


def open_source(source: Any) -> ByteSource:
    if isinstance(source, ByteSource):  # the store's range readers too
        return source
    if isinstance(source, (bytes, bytearray, memoryview)):
        return BytesSource(source)
    if isinstance(source, (str, os.PathLike)):
        return PathSource(Path(source))
    if hasattr(source, "size") and callable(getattr(source, "read", None)) and not hasattr(source, "seek"):
        return RangeObjectSource(source)
    if callable(getattr(source, "read", None)) and callable(getattr(source, "seek", None)):
        import io

        if isinstance(source, io.TextIOBase):  # read as text, its first non-UTF-8 byte escaped as UnicodeDecodeError
            raise KvcInputError("the file object is open in text mode; open the .kvc file in binary mode ('rb')")
        return FileObjectSource(source)
    if hasattr(source, "size") and callable(getattr(source, "read", None)):
        return RangeObjectSource(source)
    raise KvcInputError(f"cannot read a .kvc file from a {type(source).__name__}")
