"""Resource bounds for untrusted input: how much a file may make us allocate, and which files we open.

Every reader of untrusted bytes (``.kvc`` files, HDF5 / safetensors captures)
goes through here so that the rules are the same everywhere:

* :func:`max_decoded_bytes` -- the per-file limit on the total *declared*
  output (all K/V tensors of a file, as the header states them), checked
  before anything is allocated. A tiny, perfectly valid file can legally
  declare terabytes (a constant tensor entropy-codes to almost nothing), so a
  limit on the declaration is the only defence. Default 16 GiB (a 32k-token
  Llama-3-8B cache in fp16 is 4 GiB); ``$KVCODEC_MAX_DECODED_BYTES`` or the
  readers' ``max_decoded_bytes=`` argument change it.
* :func:`max_decoded_ratio` -- the same declaration relative to the file's
  real size: a 34 KB file declaring 1.5 GB (a zstd-coded constant) is refused
  at open, whatever the absolute limit. Default 256 (a file may decode to at
  most 256 times its size: 0.125 bits per float32 element, 8x below the
  smallest preset's rate); ``$KVCODEC_MAX_DECODED_RATIO`` or the readers'
  ``max_decoded_ratio=`` argument change it (0: no ratio limit).
  :func:`check_declared` applies both.
* :func:`open_regular` -- open a path for reading only if it is a regular
  file: a FIFO would block forever, a device could be endless, a directory is
  a user mistake. The check is race-free (``O_NONBLOCK`` open, then ``fstat``
  of the very descriptor that will be read).
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

from kvcodec.errors import KvcFormatError, KvcInputError

DEFAULT_MAX_DECODED_BYTES = 16 << 30
MAX_DECODED_ENV = "KVCODEC_MAX_DECODED_BYTES"
DEFAULT_MAX_DECODED_RATIO = 256.0
MAX_RATIO_ENV = "KVCODEC_MAX_DECODED_RATIO"


def max_decoded_bytes(override: int | None = None) -> int:
    """The per-file declared-output limit in bytes: ``override``, else ``$KVCODEC_MAX_DECODED_BYTES``, else 16 GiB."""
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, int) or override <= 0:
            raise KvcInputError(f"max_decoded_bytes must be a positive integer, got {override!r}")
        return override
    env = os.environ.get(MAX_DECODED_ENV)
    if env is None or env.strip() == "":
        return DEFAULT_MAX_DECODED_BYTES
    s = env.strip()
    if not (s.isascii() and s.isdigit()) or int(s) <= 0:
        raise KvcInputError(f"${MAX_DECODED_ENV} must be a positive integer number of bytes, got {env!r}")
    return int(s)


def max_decoded_ratio(override: float | None = None) -> float:
    """Declared decoded bytes per byte of file allowed: ``override``, else ``$KVCODEC_MAX_DECODED_RATIO``, else 256.

    0 means no ratio limit (the absolute limit still applies).
    """
    if override is not None:
        if isinstance(override, bool) or not isinstance(override, (int, float)) or not 0 <= override < float("inf"):
            raise KvcInputError(f"max_decoded_ratio must be a finite number >= 0 (0: no limit), got {override!r}")
        return float(override)
    env = os.environ.get(MAX_RATIO_ENV)
    if env is None or env.strip() == "":
        return DEFAULT_MAX_DECODED_RATIO
    s = env.strip()
    if not re.fullmatch(r"[0-9]{1,12}(\.[0-9]{1,9})?", s):
        raise KvcInputError(f"${MAX_RATIO_ENV} must be a number >= 0 in ASCII digits (0: no limit), got {env!r}")
    return float(s)


def check_declared(declared: int, size: int, *, max_bytes: int, max_ratio: float, what: str = "file") -> None:
    """Raise :class:`KvcFormatError` if ``declared`` decoded bytes exceed ``max_bytes`` or ``max_ratio`` x ``size``.

    Called right after a header is parsed, before anything is decoded or allocated.
    """
    if declared > max_bytes:
        raise KvcFormatError(
            f"{what} declares {declared:,} bytes of decoded K/V, over the limit of {max_bytes:,} "
            f"(raise ${MAX_DECODED_ENV} to read it)")
    if max_ratio and declared > max_ratio * max(size, 1):
        raise KvcFormatError(
            f"{what} of {size:,} bytes declares {declared:,} bytes of decoded K/V ({declared / max(size, 1):,.0f}x "
            f"its size), over the limit of {max_ratio:g}x (raise ${MAX_RATIO_ENV} to read it)")


#: a file may occupy this many times fewer bytes on disk than its size says, once it is larger than ``SPARSE_FLOOR``
SPARSE_RATIO = 64
SPARSE_FLOOR = 1 << 20


def check_not_sparse(st: os.stat_result, name: str, what: str, fd: int | None = None) -> None:
    """Refuse a regular file whose size is mostly holes (``st_blocks`` far below ``st_size``).

    Why: every bound on untrusted input that is relative to a file's size (the declared-output ratio of a
    ``.kvc``, a capture's tensors) assumes the bytes are really there; a sparse file costs its maker nothing
    per byte, so a few kilobytes of real data with a hole of terabytes pass the ratio and make the reader
    allocate what the hole spans (a ``.kvc``'s stored attachments and chunk records are read whole). A
    file system that reports no blocks at all (``st_blocks`` 0) is not judged. With the open descriptor
    ``fd``, the file must also really hold a hole (``SEEK_HOLE`` before its end): few blocks alone also
    mean a compressing file system, or ZFS counting a just-written file's blocks only at its next commit."""
    size, blocks = st.st_size, getattr(st, "st_blocks", 0)
    if size > SPARSE_FLOOR and blocks and blocks * 512 * SPARSE_RATIO < size and (fd is None or _has_hole(fd, size)):
        raise KvcFormatError(f"{name}: a sparse file ({size:,} bytes, {blocks * 512:,} on disk, over {SPARSE_RATIO}x); "
                             f"refusing to read it as {what} (copy it without holes, e.g. cp --sparse=never)")


def _has_hole(fd: int, size: int) -> bool:
    """Whether the file of ``fd`` has a hole before its end (False where ``SEEK_HOLE`` is not supported: the
    generic answer, the end of the file, says the same). Reads go through ``pread``: the offset is restored."""
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is None:
        return False
    try:
        at = os.lseek(fd, 0, seek_hole)
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        return False
    return at < size


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def open_regular(path: str | os.PathLike[str], what: str = "input") -> int:
    """A read-only file descriptor of ``path``, which must be a regular file (KvcInputError otherwise).

    ``stat`` first, so devices and FIFOs are never opened at all; then the open
    itself is non-blocking and the descriptor is ``fstat``-ed, so a path
    swapped for a FIFO in between cannot block us either.
    """
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise KvcInputError(f"no such file: {p}") from None
    except OSError as exc:
        raise KvcInputError(f"cannot open {p}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KvcInputError(f"{p} is {_kind(st.st_mode)}, not a regular file; refusing to read it as {what}")
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    try:
        fd = os.open(p, flags)
    except FileNotFoundError:
        raise KvcInputError(f"no such file: {p}") from None
    except OSError as exc:
        raise KvcInputError(f"cannot open {p}: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KvcInputError(f"{p} is {_kind(st.st_mode)}, not a regular file; refusing to read it as {what}")
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd

