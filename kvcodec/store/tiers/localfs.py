"""Local-filesystem primitives of the directory tier: opening its directories and entries without following what
someone planted in them, an error's reason a person can act on, and an envelope checked as a stream.

Why apart from :mod:`kvcodec.store.tiers.directory`: they are the tier's defence against its own directory (a
symlink, FIFO, file or directory planted at a name the store owns), and each is small and self-contained.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import BinaryIO, Callable

from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.store.keys import StoreKey
from kvcodec.store.tiers.base import FIXED_SIZE, parse_fixed, parse_header

__all__ = ["check_head", "fsync_dir", "open_dir", "open_regular", "purge_older", "remove_stale_tmp", "why"]


def fsync_dir(path: str) -> None:
    """Make a rename in ``path`` durable (where the platform can)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - platforms without dir fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


_DIR_FLAGS = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)


def open_dir(name: str, dir_fd: int | None, create: bool) -> int:
    """A descriptor of the directory ``name`` (relative to ``dir_fd``), never through a symlink (ELOOP) nor a file
    (ENOTDIR) planted there; made first when missing and ``create``."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, 0o777, dir_fd=dir_fd)  # the umask decides, as os.makedirs let it (a group store)
        except FileExistsError:  # another writer made it just now
            pass
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)


def purge_older(path: str, grace_s: float, now: float) -> int:
    """Delete the regular files of directory ``path`` last modified ``grace_s`` or more before ``now``; how many.

    Opened without following a symlink planted at ``path``: gc's purge of ``quarantine/`` listed and unlinked
    the old files of whatever directory such a symlink pointed to. ``OSError`` (:func:`why`) for one."""
    try:
        fd = open_dir(path, None, False)
    except FileNotFoundError:
        return 0
    n = 0
    try:
        for de in os.scandir(fd):
            try:
                if de.is_file(follow_symlinks=False) and now - de.stat(follow_symlinks=False).st_mtime >= grace_s:
                    os.unlink(de.name, dir_fd=fd)
                    n += 1
            except FileNotFoundError:
                pass
    finally:
        os.close(fd)
    return n


def why(e: OSError) -> str:
    """An ``OSError`` of an entry's write, read or delete as the reason a person can act on."""
    if e.errno == errno.ENOSPC:
        return "no space left on device"
    if e.errno in (errno.ELOOP, errno.ENOTDIR):  # O_NOFOLLOW | O_DIRECTORY on a symlink: ENOTDIR (Linux)
        return "a symlink or file sits where the store's own directory belongs (never followed: remove it)"
    if e.errno in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
        return "a directory sits at the entry's name (the store writes none there: remove it)"
    return e.strerror or str(e)


def open_regular(path: str, dir_fd: int | None = None) -> BinaryIO:
    """Open ``path`` for reading without following a symlink or blocking on a FIFO planted at an entry's name.

    Entries are only ever created by rename of a regular temp file, so
    anything else at an entry's name is foreign: an ``OSError``.
    """
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags, dir_fd=dir_fd)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def check_head(f: BinaryIO, size: int, what: str) -> StoreKey:
    """The key the envelope read from ``f`` (a file of ``size`` bytes) names, its head checked as
    ``decode_envelope_parts`` checks it (fixed part, the size it announces, header) without reading the
    payload: at most 24 bytes plus a header of at most 1 MiB. KvcFormatError on any damage found."""
    fixed = f.read(FIXED_SIZE)
    hl, dl, _ = parse_fixed(fixed, what)
    if FIXED_SIZE + hl + dl != size:
        raise KvcFormatError(f"{what}: size {size} != {FIXED_SIZE + hl + dl} announced (truncated or padded)")
    hb = f.read(hl)
    if len(hb) != hl:
        raise KvcFormatError(f"{what}: truncated header")
    try:
        return StoreKey.from_str(parse_header(hb, what)["key"])
    except KvcInputError as e:
        raise KvcFormatError(f"{what}: bad key in header: {e}") from None


def remove_stale_tmp(root: str, objects: str, marker_tmp: Callable[[str], bool], grace_s: float, now: float) -> int:
    """Delete the directory tier's own temp files older than ``grace_s``: a marker's in ``root`` (``marker_tmp``
    says which), an entry's or owner file's (``.<name>.<pid>.<rand>.tmp``) under ``objects``; how many.

    Why only those: the whole root was walked, and a root that also held other, hidden, directories lost their
    ``*.tmp`` files."""
    try:
        top = [(root, [n for n in os.listdir(root) if marker_tmp(n)])]
    except OSError:
        top = []
    n = 0
    for dirpath, names in top + [(d, f) for d, _, f in os.walk(objects)]:
        for nm in names:
            if not (nm.endswith(".tmp") and (dirpath == root or nm.startswith("."))):
                continue
            p = os.path.join(dirpath, nm)
            try:
                if now - os.stat(p).st_mtime >= grace_s:
                    os.unlink(p)
                    n += 1
            except FileNotFoundError:
                pass
    return n


def evict_oldest(files: list[tuple[str, os.stat_result]], total: int, target: int,
                 keep: str | None = None) -> tuple[int, list[int], int]:
    """Unlink the least recently written of ``files`` ((path, stat) pairs holding ``total`` bytes) until at most
    ``target`` bytes are left, never ``keep`` (the entry just written). Returns the bytes left, the indexes of the
    files counted out of them (one already gone included) and how many this call unlinked.

    The one LRU pass of the directory tier's two caps: a partition's (``max_bytes``) and a tenant's over all its
    partitions (``tenant_bytes``, store/tiers/quota.py)."""
    counted: list[int] = []
    n = 0
    for i in sorted(range(len(files)), key=lambda j: files[j][1].st_mtime):
        if total <= target:
            break
        path, st = files[i]
        if path == keep:
            continue
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
        total -= st.st_size
        counted.append(i)
    return total, counted, n
