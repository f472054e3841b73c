"""The ONE bounded cache helper (decoder tables and matrices, parsed pipelines, device copies).

Why one: four hand-rolled ``OrderedDict`` caches each had their own bound (or none on bytes) and
their own locking. :class:`BoundedLRU` is thread-safe and bounded by entry count *and* by the
bytes of the numpy arrays / torch tensors it holds, so a long-lived reader of many large or many
different files keeps a bounded cache.
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from typing import Any, Generic, Hashable, TypeVar

V = TypeVar("V")


def _nbytes(v: Any) -> int:
    items = v if isinstance(v, tuple) else (v,)
    total = 0
    for a in items:
        n = getattr(a, "nbytes", None)
        if isinstance(n, int):
            total += n
    return total


class BoundedLRU(Generic[V]):
    """A thread-safe LRU of at most ``n`` entries and ``max_bytes`` bytes of arrays (a larger value is not kept)."""

    def __init__(self, n: int, max_bytes: int = 256 << 20) -> None:
        self.n = n
        self.max_bytes = max_bytes
        self.bytes = 0
        self._d: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> V | None:
        with self._lock:
            v = self._d.get(key)
            if v is None:
                return None
            self._d.move_to_end(key)
            return v[0]

    def put(self, key: Hashable, v: V) -> None:
        size = _nbytes(v)
        if size > self.max_bytes:
            return
        with self._lock:
            old = self._d.pop(key, None)
            if old is not None:
                self.bytes -= old[1]
            self._d[key] = (v, size)
            self.bytes += size
            while len(self._d) > self.n or self.bytes > self.max_bytes:
                self.bytes -= self._d.popitem(last=False)[1][1]

    def __len__(self) -> int:
        return len(self._d)

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.bytes = 0


def weak(a: Any) -> Any:
    """A weak reference to ``a`` for an identity-keyed cache entry (an always-miss reference if ``a`` takes none).

    Why: caches of matrices derived from attachment arrays are keyed by the arrays' ids; holding only weak
    references keeps them from keeping every file's arrays alive, and a reused id cannot alias because the
    entry is used only while ``ref() is array`` still holds.
    """
    try:
        return weakref.ref(a)
    except TypeError:
        return lambda: None
