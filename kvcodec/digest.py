"""Content identities: the sha256 of an array, of token ids and of canonical JSON.

A leaf module (numpy and hashlib only): the container, the calibration store, the store keys
and the fingerprint all name content by these digests, so none of them imports another for it.
"""

from __future__ import annotations

import functools
import hashlib
import threading
import weakref
import json
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


def token_ids_sha256(ids: Any) -> str:
    """sha256 hex of token ids as little-endian int64: the context hash of the .kvc header (spec/kvc-v1.md),
    of pruning records and of capture caches. In the leaf digest module, so the container hashes without torch."""
    return hashlib.sha256(np.asarray(ids, dtype="<i8").tobytes()).hexdigest()


def json_sha256(obj: Any) -> str:
    """sha256 hex of canonical JSON (sorted keys, ASCII): the identity of a config or parameter object."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, ensure_ascii=True, default=str).encode()).hexdigest()


