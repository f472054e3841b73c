"""Safe outputs: every file kvcodec writes goes through this module.

Why one helper: a writer that is killed, runs out of disk or is pointed at the
wrong path must never leave a half-written file, clobber one of its own
inputs or replace something that is not a regular file (``-o /dev/sda``,
``-o a.kvc`` when decoding ``a.kvc``). So every output is

1. checked first (:func:`check_output`): not the same file as any input
   (by real path *and* by ``(st_dev, st_ino)``, so symlinks and hard links
   are caught), not an existing non-regular file, its directory exists;
2. written to a temp file in the destination's directory (same filesystem,
   so the final rename is atomic) named ``.<name>.<host>.<pid>.<rand>.kvctmp``;
3. flushed, ``fsync``-ed and renamed over the destination, then the
   directory is fsynced; on any error the temp file is removed.

A writer killed with SIGKILL cannot clean up, so each new write first
collects stale temp files in its directory (:func:`collect_stale_temps`):
ours by name, older than a grace period, and whose writer pid is dead on
this host (temps of other hosts, e.g. on NFS, only after ``MAX_AGE_S``).

OS failures (disk full, read-only filesystem, permissions) become one-line
:class:`~kvcodec.errors.KvcIOError` messages instead of tracebacks.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import time
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterable, Iterator

from kvcodec.errors import KvcInputError, KvcIOError

TEMP_SUFFIX = ".kvctmp"
GRACE_S = 3600.0  # a temp younger than this is never collected (its writer may still be running)
MAX_AGE_S = 7 * 24 * 3600.0  # older than this it is collected even if its pid looks alive (pid reuse, other hosts)
_TEMP_RE = re.compile(r"^\.(?P<name>.+)\.(?P<host>[0-9a-f]{8})\.(?P<pid>\d+)\.(?P<rand>[0-9a-f]{8})" + re.escape(TEMP_SUFFIX) + "$")

PathLike = str | os.PathLike


def host_tag() -> str:
    """Eight hex digits naming this host, so a pid is only judged on the host that owns it."""
    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogatepass")).hexdigest()[:8]


def temp_name(dest: Path) -> Path:
    """A fresh temp path next to ``dest`` in the recognisable pattern :func:`collect_stale_temps` knows."""
    # the name is cut so that a destination name near NAME_MAX (255) still has a temp name that fits
    return dest.parent / f".{dest.name[:160]}.{host_tag()}.{os.getpid()}.{secrets.token_hex(4)}{TEMP_SUFFIX}"


def io_error(exc: OSError, what: str) -> KvcIOError:
    """A one-line KvcIOError for an OSError met while doing ``what``."""
    reasons = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "disk quota exceeded",
        errno.EROFS: "the filesystem is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "operation not permitted",
        errno.ENOENT: "no such file or directory",
        errno.ENOTDIR: "a path component is not a directory",
        errno.EISDIR: "is a directory",
        errno.ENAMETOOLONG: "file name too long",
        errno.EXDEV: "cross-device rename",
        errno.EIO: "I/O error",
    }
    why = reasons.get(exc.errno or -1) or exc.strerror or str(exc)
    return KvcIOError(f"{what}: {why}")


def io_error_in(exc: Exception, what: str) -> KvcIOError:
    """A KvcIOError for a library error that wraps an OS error in text (safetensors: "... (os error 28)")."""
    m = re.search(r"os error (\d+)", str(exc))
    if m:
        return io_error(OSError(int(m[1]), os.strerror(int(m[1]))), what)
    return KvcIOError(f"{what}: {' '.join(str(exc).split())}")


def _describe(mode: int) -> str:
    for test, word in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return word
    return "not a regular file"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def check_file_name(path: PathLike) -> Path:
    """``path`` as a Path, unless it names a directory (``""``, ``.``, ``..``, or a trailing slash: ``out/``
    would otherwise become a file called ``out``): then :class:`KvcInputError`."""
    out = Path(os.fspath(path))
    if not str(out) or out.name in ("", ".", "..") or os.fspath(path).endswith(("/", os.sep)):
        raise KvcInputError(f"output {str(path)!r} names a directory, not a file")
    return out


def check_output(path: PathLike, inputs: Iterable[PathLike | None] = ()) -> Path:
    """Refuse an output that would destroy an input or something that is not a regular file.

    ``inputs`` are the paths the command reads (files or directories; ``None``
    and names that do not exist are ignored). An input directory (a model
    directory) protects every existing file inside it. Returns the output as a
    Path. Raises :class:`KvcInputError` with one line.
    """
    out = check_file_name(path)
    parent = out.parent
    try:
        pst = os.stat(parent)
    except FileNotFoundError:
        raise KvcInputError(f"output directory {parent} does not exist") from None
    except OSError as exc:
        raise io_error(exc, f"output directory {parent}") from None
    if not stat.S_ISDIR(pst.st_mode):
        raise KvcInputError(f"output directory {parent} is not a directory")
    try:
        ost: os.stat_result | None = os.stat(out)  # follows symlinks: a link to /dev/null is a device
    except FileNotFoundError:
        ost = None
    except OSError as exc:
        raise io_error(exc, f"output {out}") from None
    if ost is not None and not stat.S_ISREG(ost.st_mode):
        raise KvcInputError(f"output {out} exists and is {_describe(ost.st_mode)}; refusing to replace it")
    real_out = os.path.realpath(out)
    for inp in inputs:
        if inp is None:
            continue
        try:
            ist = os.stat(inp)
        except (OSError, ValueError):
            continue  # not a path (a corpus name) or unreadable: nothing there to protect
        real_in = os.path.realpath(inp)
        if stat.S_ISDIR(ist.st_mode):
            if ost is not None and os.path.commonpath([real_in, real_out]) == real_in:
                raise KvcInputError(f"output {out} is a file inside the input directory {inp}; refusing to replace it")
            continue
        if real_in == real_out or (ost is not None and _same_file(ist, ost)):
            raise KvcInputError(f"output {out} is the same file as the input {inp}; refusing to overwrite an input")
    return out


def check_input(path: PathLike) -> Path:
    """Refuse an input that is missing or not a regular file, before anything opens it.

    Why: opening a FIFO blocks until a writer appears (``kvc info fifo``
    hangs for good) and a device node can be endless; neither is a file
    kvcodec could have written.
    """
    p = Path(os.fspath(path))
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise KvcInputError(f"no such file: {p}") from None
    except (OSError, ValueError) as exc:
        raise KvcInputError(f"cannot read {p}: {exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise KvcInputError(f"input {p} is {_describe(st.st_mode)}, not a regular file")
    return p


def check_outputs_differ(outputs: Iterable[PathLike | None]) -> None:
    """Refuse two outputs of one command that name the same file (the second would replace the first)."""
    seen: dict[str, PathLike] = {}
    for p in outputs:
        if p is None:
            continue
        r = os.path.realpath(p)
        if r in seen:
            raise KvcInputError(f"outputs {seen[r]} and {p} are the same file")
        seen[r] = p


def ensure_output_dir(path: PathLike) -> Path:
    """Create an output directory (and parents); one-line errors if it cannot be one."""
    d = Path(os.fspath(path))
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise KvcInputError(f"output directory {d} exists and is not a directory") from None
    except NotADirectoryError:
        raise KvcInputError(f"output directory {d}: a path component is not a directory") from None
    except OSError as exc:
        raise io_error(exc, f"cannot create output directory {d}") from None
    return d


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    except OSError:
        return True  # cannot tell: keep the file
    return True


def collect_stale_temps(directory: PathLike, grace_s: float = GRACE_S, max_age_s: float = MAX_AGE_S) -> list[Path]:
    """Remove temp files of killed writers in ``directory``; returns what was removed.

    A temp is stale when it is older than ``grace_s`` and its writer (the pid
    in its name, on this host) is gone, or when it is older than
    ``max_age_s`` whatever its pid. Only names in our own pattern are touched;
    never raises (a directory we cannot list has nothing we can collect).
    """
    removed: list[Path] = []
    now = time.time()
    me = host_tag()
    try:
        it = os.scandir(os.fspath(directory))
    except OSError:
        return removed
    with it:
        for e in it:
            if not e.name.endswith(TEMP_SUFFIX):
                continue
            m = _TEMP_RE.match(e.name)
            if m is None:
                continue
            try:
                st = e.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            age = now - st.st_mtime
            if age < grace_s:
                continue
            ours = m["host"] == me
            if age < max_age_s and (not ours or _pid_alive(int(m["pid"]))):
                continue
            try:
                os.unlink(e.path)
                removed.append(Path(e.path))
            except OSError:
                pass
    return removed


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some filesystems cannot fsync a directory; the rename itself is still atomic
    finally:
        os.close(fd)


def _create_temp(dest: Path) -> Path:
    """Create an empty temp file next to ``dest`` (mode 0666 & ~umask, like a plain open would)."""
    for _ in range(16):
        tmp = temp_name(dest)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
        except FileExistsError:
            continue
        except OSError as exc:
            raise io_error(exc, f"cannot write {dest}") from None
        os.close(fd)
        return tmp
    raise KvcIOError(f"cannot create a temp file next to {dest}")  # pragma: no cover - 16 random collisions


@contextmanager
def atomic_path(path: PathLike, inputs: Iterable[PathLike | None] = ()) -> Iterator[Path]:
    """Yield a temp path to write ``path``'s content to (for libraries that write by file name).

    On a clean exit the temp is fsynced and renamed over ``path``; on any
    exception it is removed and ``path`` is left as it was. OSErrors from the
    body or the commit become one-line KvcIOErrors.
    """
    dest = check_output(path, inputs)
    collect_stale_temps(dest.parent)
    tmp = _create_temp(dest)
    try:
        try:
            yield tmp
        except OSError as exc:
            raise io_error(exc, f"cannot write {dest}") from None
        _commit(tmp, dest)
    finally:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        except OSError:
            pass


def _commit(tmp: Path, dest: Path) -> None:
    try:
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        check_output(dest)  # the destination may have become a device/FIFO/directory while we wrote
        os.replace(tmp, dest)
    except OSError as exc:
        raise io_error(exc, f"cannot write {dest}") from None
    _fsync_dir(dest.parent)


@contextmanager
def atomic_file(path: PathLike, mode: str = "wb", inputs: Iterable[PathLike | None] = ()) -> Iterator[IO]:
    """Yield an open file whose content replaces ``path`` atomically on a clean exit (see :func:`atomic_path`)."""
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_file writes whole files; mode {mode!r} is not 'wb' or 'w'")
    with atomic_path(path, inputs) as tmp:
        try:
            f = open(tmp, mode, encoding=None if "b" in mode else "utf-8")
        except OSError as exc:
            raise io_error(exc, f"cannot write {path}") from None
        with f:
            yield f
            f.flush()


def atomic_write_bytes(path: PathLike, data: bytes, inputs: Iterable[PathLike | None] = ()) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_file(path, "wb", inputs) as f:
        f.write(data)


def atomic_write_text(path: PathLike, text: str, inputs: Iterable[PathLike | None] = ()) -> None:
    """Write UTF-8 ``text`` to ``path`` atomically."""
    with atomic_file(path, "w", inputs) as f:
        f.write(text)
