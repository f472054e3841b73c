"""The default resolver of a `.kvc` file's external attachments: the per-model calibration store.

Why here and not in ``format/``: the container only knows that an attachment is referenced by
name + sha256; where such arrays live (kvcodec's calibration cache and the calibrations shipped
in the package) is the lossy codec's business. The reader and the writer's read-back call
:func:`default_resolver`, which imports the calibration store only when a file references an
external attachment.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
from typing import Any

import numpy as np


def array_sha256(arr: Any) -> str:
    """sha256 of an array's C-order little-endian bytes: the identity of an attachment (spec/kvc-v1.md).

    Memoised per array object for *frozen* arrays (read-only, over read-only arrays down to an
    immutable buffer, as a loaded calibration's are): every file that references a calibration
    checks its attachments' sha256 on open, and rehashing 4.7 MB of Gemma 3 bases cost more
    than decoding a small file. A writable array is hashed every time.
    """
    arr = np.asarray(arr)
    frozen = _frozen(arr)
    if frozen:
        with _MEMO_LOCK:
            hit = _MEMO.get(id(arr))
        if hit is not None and hit[0]() is arr:
            return hit[1]
    sha = hashlib.sha256(np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<")).tobytes()).hexdigest()
    if frozen:
        key = id(arr)
        ref = weakref.ref(arr, functools.partial(_forget, key))
        with _MEMO_LOCK:
            _MEMO[key] = (ref, sha)
    return sha


_MEMO: dict[int, tuple[Any, str]] = {}
_MEMO_LOCK = threading.Lock()


def _forget(key: int, ref: Any) -> None:
    with _MEMO_LOCK:
        if key in _MEMO and _MEMO[key][0] is ref:
            del _MEMO[key]


def _frozen(arr: np.ndarray) -> bool:
    """Whether nothing can change ``arr``'s bytes through numpy: it and every array it views are
    read-only, and the buffer at the bottom is an immutable ``bytes`` or owned by a read-only array."""
    a: Any = arr
    while isinstance(a, np.ndarray):
        if a.flags.writeable:
            return False
        if a.base is None:
            return True
        a = a.base
    return isinstance(a, bytes)


def default_resolver(name: str, info: Any) -> np.ndarray | None:
    """The array named ``name`` whose sha256 is ``info`` (a sha256 string or an object with ``.sha256``), or None."""
    sha = info if isinstance(info, str) else getattr(info, "sha256", None)
    if sha is None:
        return None
    import importlib

    # by name, like the stage table in kvcodec.stages: the container never imports the lossy codec statically
    return importlib.import_module("kvcodec.quant.calibrate").resolve_attachment(name, sha)
