"""Read an untrusted HDF5 capture in a child process, so corrupt metadata cannot crash kvcodec.

The HDF5 C library segfaults on some corrupted files (found by
``tests/conformance/test_bounds.py``); no amount of checking in Python prevents that, so
``kvcodec.core.kvcache.load_h5`` never opens HDF5 in its own process. The child
(``python -c ... kvcodec.h5sandbox`` on a descriptor the parent opened with
:func:`kvcodec.limits.open_regular`, so it reads exactly the file the parent
checked) imports only h5py and numpy and speaks a two-step protocol on its
pipes -- no pickle anywhere:

1. child -> parent: one JSON line describing the file: root attributes as
   strings / ints, the number of layer groups, and for each capture dataset
   its shape, dtype (``numpy`` type string, numeric kinds only) and the bytes
   HDF5 really stores for it;
2. parent -> child: a JSON list of the datasets to send (after the parent has
   checked every declared shape, the size limit and the sparse ratio);
   child -> parent: for each, ``u64 nbytes`` and the C-order little-endian
   bytes (``nbytes`` must be exactly what the declared shape needs).

A crash, a hang (``TIMEOUT_S``), or any framing error is a
:class:`~kvcodec.errors.KvcFormatError`.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.errors import KvcFormatError

TIMEOUT_S = 300.0
_MAX_DESC = 16 << 20
_ERR = (1 << 64) - 1


class H5Sandbox:
    """One HDF5 file opened by a child process: ``.desc`` (what it declares), ``.fetch(names)`` (the data)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        from kvcodec.limits import open_regular

        self.path = Path(path)
        fd = open_regular(self.path, "a capture")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", "import sys; sys.path[:0] = " + repr(_import_path())
                 + "; from kvcodec.h5sandbox import child; child()", str(fd)],
                pass_fds=(fd,), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            )
        finally:
            os.close(fd)
        self._timer = threading.Timer(TIMEOUT_S, self._proc.kill)
        self._timer.daemon = True
        self._timer.start()
        try:
            line = self._proc.stdout.readline(_MAX_DESC)  # type: ignore[union-attr]
            if not line.endswith(b"\n"):
                raise self._failed("no description")
            self.desc: dict[str, Any] = json.loads(line)
        except BaseException:
            self.close()
            raise
        if self.desc.get("error"):
            self.close()
            raise KvcFormatError(f"{self.path}: not a readable HDF5 file ({self.desc['error'][:160]})")

    def _failed(self, what: str) -> KvcFormatError:
        self._proc.kill()
        code = self._proc.wait()
        why = f"the HDF5 library crashed (signal {-code})" if code < 0 else f"reader exited with {code}"
        return KvcFormatError(f"{self.path}: corrupt HDF5 metadata ({why}; {what})")

    def fetch(self, want: dict[str, tuple[np.dtype, tuple[int, ...]]]) -> dict[str, np.ndarray]:
        """The datasets ``want`` (name -> (dtype, shape), both already validated by the caller)."""
        out: dict[str, np.ndarray] = {}
        try:
            self._proc.stdin.write(json.dumps(list(want)).encode() + b"\n")  # type: ignore[union-attr]
            self._proc.stdin.flush()  # type: ignore[union-attr]
            for name, (dt, shape) in want.items():
                n = _read(self._proc.stdout, 8)
                if n is None:
                    raise self._failed(f"while reading {name!r}")
                size = struct.unpack("<Q", n)[0]
                if size == _ERR:
                    m = _read(self._proc.stdout, 4)
                    msg = _read(self._proc.stdout, min(struct.unpack("<I", m)[0], 4096)) if m else b""
                    raise KvcFormatError(f"{self.path}: dataset {name!r} cannot be read ({(msg or b'').decode('utf-8', 'replace')[:160]})")
                need = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                if size != need:
                    raise KvcFormatError(f"{self.path}: dataset {name!r} holds {size} bytes, its shape needs {need}")
                buf = bytearray(need)
                if need and _readinto(self._proc.stdout, buf) != need:
                    raise self._failed(f"while reading {name!r}")
                out[name] = np.frombuffer(buf, dtype=dt.newbyteorder("<")).astype(dt.newbyteorder("="), copy=False).reshape(shape)
        except (BrokenPipeError, OSError) as exc:
            raise self._failed(f"pipe: {exc}") from None
        return out

    def close(self) -> None:
        self._timer.cancel()
        if self._proc.poll() is None:
            self._proc.kill()
        self._proc.wait()
        for s in (self._proc.stdin, self._proc.stdout):
            if s is not None:
                s.close()

    def __enter__(self) -> "H5Sandbox":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _import_path() -> list[str]:
    """sys.path entries the child needs to import this kvcodec (isolated mode drops the cwd and env paths)."""
    here = str(Path(__file__).resolve().parents[1])
    return [here] + [p for p in sys.path if p and "site-packages" in p]


def _read(f: Any, n: int) -> bytes | None:
    b = f.read(n)
    return b if len(b) == n else None


def _readinto(f: Any, buf: bytearray) -> int:
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        k = f.readinto(view[got:])
        if not k:
            break
        got += k
    return got


# -- the child ----------------------------------------------------------------
def _attr(v: Any) -> Any:
    if isinstance(v, bytes):
        try:
            return v.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(v, str):
        return v
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)):
        return int(v)
    return None


def child() -> None:  # pragma: no cover - runs in the sandbox process
    """Entry point of the sandbox process (argv[1]: the file descriptor to read)."""
    import h5py

    out = sys.stdout.buffer
    fd = int(sys.argv[1])
    try:
        f = h5py.File(os.fdopen(fd, "rb"), "r")
        attrs = {k: _attr(f.attrs.get(k)) for k in ("format", "format_version", "fingerprint", "meta", "dtype",
                                                     "attention_window")}
        sets: dict[str, Any] = {}
        layers = f.get("layers")
        n_layers = len(layers) if isinstance(layers, h5py.Group) else None
        names = [("token_ids", "token_ids"), ("positions", "positions"), ("attention_scores", "attention_scores")]
        names += [(f"layers.{i}.{k}", f"layers/{i}/{k}") for i in range(min(n_layers or 0, 4096)) for k in ("key", "value")]
        for name, h5name in names:
            obj = f.get(h5name)
            if obj is None:
                continue
            if not isinstance(obj, h5py.Dataset):
                sets[name] = {"error": "not a dataset"}
                continue
            dt = obj.dtype
            ok = dt.kind in "iuf" and dt.itemsize <= 8 and dt.fields is None
            sets[name] = {"shape": list(obj.shape), "dtype": dt.newbyteorder("<").str if ok else None,
                          "storage": int(obj.id.get_storage_size())}
        desc = {"attrs": attrs, "n_layers": n_layers, "datasets": sets, "error": None}
    except Exception as exc:  # noqa: BLE001 - everything is reported to the parent as a format error
        out.write(json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode() + b"\n")
        out.flush()
        return
    out.write(json.dumps(desc).encode() + b"\n")
    out.flush()
    line = sys.stdin.buffer.readline()
    if not line:
        return
    for name in json.loads(line):
        h5name = name.replace(".", "/") if name.startswith("layers.") else name
        try:
            arr = np.ascontiguousarray(f[h5name][()])
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            out.write(struct.pack("<Q", arr.nbytes))
            out.write(arr.data.cast("B"))
        except Exception as exc:  # noqa: BLE001
            msg = f"{type(exc).__name__}: {exc}".encode()[:4096]
            out.write(struct.pack("<QI", _ERR, len(msg)) + msg)
        out.flush()
