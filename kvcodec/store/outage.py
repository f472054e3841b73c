"""Outage bookkeeping shared by remote tiers (KDN service, S3): fail fast while down, warn once per outage.

A transport failure marks the tier *down*; calls within ``retry_interval``
seconds then fail at once without touching the network, one warning is logged
per outage (logger ``kvcodec.store``), and the first success afterwards logs
"reachable again".  Reads turn the resulting :class:`KvcStoreError` into
misses; writes report it, so a store with a local tier keeps working.
"""

from __future__ import annotations

import logging
import threading
import time

from kvcodec.errors import KvcStoreError

log = logging.getLogger("kvcodec.store")


class OutageGuard:
    def __init__(self, what: str, retry_interval: float) -> None:
        self.what = what
        self.retry_interval = retry_interval
        self.last_error: str | None = None
        self.outages = 0
        self._down_since: float | None = None
        self._next_try = 0.0
        self._lock = threading.Lock()

    @property
    def up(self) -> bool:
        return self._down_since is None

    def check(self, op: str) -> None:
        """Raise at once while down and inside the retry interval."""
        with self._lock:
            if self._down_since is not None and time.monotonic() < self._next_try:
                raise KvcStoreError(f"{self.what} is unreachable ({self.last_error}); {op} skipped")

    def failed(self, why: str) -> KvcStoreError:
        """Record a transport failure; returns the error to raise."""
        first = False
        with self._lock:
            self.last_error = why
            self._next_try = time.monotonic() + self.retry_interval
            if self._down_since is None:
                self._down_since = time.time()
                self.outages += 1
                first = True
        if first:
            log.warning("store: %s unreachable (%s); serving from other tiers, writes to it are reported "
                        "as failed until it returns", self.what, why)
        return KvcStoreError(f"{self.what} is unreachable ({why})")

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            was, self._down_since = self._down_since, None
        if was is not None:
            log.warning("store: %s reachable again after %.1f s", self.what, time.time() - was)
