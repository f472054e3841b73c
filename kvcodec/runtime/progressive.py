"""The link of the adaptive client: a range reader filled in the background, its index (trailer) first.

Why a module of its own: it is the one piece of :mod:`kvcodec.runtime.stream` that two threads share (the
planner fills it, the main thread's decoder reads it, each read waiting only for the bytes it needs), and it
knows nothing of levels, models or budgets: only bytes, their arrival times and when to give up.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

from kvcodec.errors import KvcStoreError
from kvcodec.store.ranged import RangeReader


class ProgressiveReader(RangeReader):
    """A range reader filled in the background: trailer first, then the body in order.

    ``fill()`` (run by the planner thread) reads the inner reader in pieces;
    ``read`` (the main thread's decoder) blocks until the bytes it asks for
    have arrived, the fill failed, or ``give_up()`` is called. Arrival times
    give the chunk's throughput.
    """

    def __init__(self, inner: RangeReader, piece: int, name: str, tail: int = 64 << 10) -> None:
        self.inner, self.size, self.name = inner, inner.size, name
        self.piece = max(4096, int(piece))
        n = -(-self.size // self.piece)
        last = max(0, n - 1)
        tail_first = max(0, (self.size - tail) // self.piece)
        self.order = list(range(tail_first, last + 1)) + list(range(0, tail_first))
        self._have: dict[int, bytes] = {}
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._abandoned = False
        self.started = time.perf_counter()
        self.finished: float | None = None
        self.last_progress = self.started
        self.received = 0
        self.first_at: float | None = None  # when the first piece arrived, and its size (the give-up rule's rate)
        self.first_bytes = 0
        self.slow_Bps: float | None = None  # set when abandoned as too slow (not failed): the rate it showed

    def fill(self) -> None:
        try:
            for p in self.order:
                with self._cond:
                    if self._abandoned:
                        return
                start = p * self.piece
                buf = self.inner.read(start, min(self.piece, self.size - start))
                with self._cond:
                    self._have[p] = buf
                    self.received += len(buf)
                    self.last_progress = time.perf_counter()
                    if self.first_at is None:
                        self.first_at, self.first_bytes = self.last_progress, len(buf)
                    self._cond.notify_all()
            with self._cond:
                self.finished = time.perf_counter()
                self._cond.notify_all()
        except BaseException as e:  # reported to the reader thread, which falls back to text
            with self._cond:
                self._error = e
                self._cond.notify_all()
        finally:
            try:
                self.inner.close()
            except Exception:  # pragma: no cover - best effort
                pass

    def give_up(self, why: str) -> None:
        with self._cond:
            self._abandoned = True
            if self._error is None:
                self._error = KvcStoreError(why)
            self._cond.notify_all()

    def wait_until(self, pred: Callable[[], bool], check: Callable[[], str | None]) -> None:
        """Wait for ``pred`` (under the lock); ``check()`` returning a reason gives up."""
        with self._cond:
            while not pred():
                if self._error is not None:
                    raise KvcStoreError(f"{self.name}: transfer failed: {one_line(self._error)}")
                why = check()
                if why:
                    self._abandoned = True
                    self._error = KvcStoreError(why)
                    raise KvcStoreError(f"{self.name}: {why}")
                self._cond.wait(0.02)

    def _read(self, offset: int, length: int) -> bytes:
        first, last = offset // self.piece, (offset + length - 1) // self.piece
        self.wait_until(lambda: all(p in self._have for p in range(first, last + 1)), self.check or (lambda: None))
        with self._cond:
            joined = b"".join(self._have[p] for p in range(first, last + 1))
        lo = offset - first * self.piece
        return joined[lo:lo + length]

    check: Callable[[], str | None] | None = None  # set by the consumer: a reason to stop waiting, or None

    def throughput(self) -> float | None:
        if self.finished is None or self.finished <= self.started:
            return None
        return self.size / (self.finished - self.started)


def one_line(exc: BaseException) -> str:
    """An exception as one line of text (its message, whitespace folded; its type when it has none)."""
    return " ".join(str(exc).split()) or type(exc).__name__
