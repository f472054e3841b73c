"""Outage bookkeeping of the remote tiers: the one place that decides how a tier behaves while its server is down.

:class:`OutageGuard` (a single server: Redis, S3, the KDN service): a transport
failure marks the tier *down*; calls within ``retry_interval`` seconds then fail
at once without touching the network, one warning is logged per outage (logger
``kvcodec.store``), and the first success afterwards logs "reachable again".

:class:`NodeOutageGuard` (a tier of many nodes: Redis Cluster): one node's
failure is never an outage of the whole tier; calls are never skipped, and
warnings are rate-limited instead of once per outage.

Reads turn the resulting :class:`KvcStoreError` into misses; writes report it,
so a store with a local tier keeps working.  A tier holds its guard as
``self.guard``; the base :class:`~kvcodec.store.tiers.base.Tier` answers
``available()`` and adds ``outages`` / ``last_error`` to ``stats()`` from it.
"""

from __future__ import annotations

import logging
import threading
import time

from kvcodec.errors import KvcStoreError

log = logging.getLogger("kvcodec.store")


class OutageGuard:
    """Fail fast while down, warn once per outage.

    ``what`` names the server in messages (``"redis redis://host:6379/0"``);
    ``writes_to`` is how the warning refers to it when saying writes fail.
    """

    def __init__(self, what: str, retry_interval: float, *, writes_to: str = "it") -> None:
        self.what = what
        self.retry_interval = retry_interval
        self.writes_to = writes_to
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
        now = time.monotonic()
        with self._lock:
            if self._down_since is not None and now < self._next_try:
                raise KvcStoreError(f"{self.what} is unreachable ({self.last_error}); {op} skipped")

    def failed(self, why: str, op: str | None = None) -> KvcStoreError:
        """Record a transport failure; returns the error to raise (naming ``op`` when given)."""
        first = False
        with self._lock:
            self.last_error = why
            self._next_try = time.monotonic() + self.retry_interval
            if self._down_since is None:
                self._down_since = time.time()
                self.outages += 1
                first = True
        if first:
            log.warning("store: %s unreachable (%s); serving from other tiers, writes to %s are reported "
                        "as failed until it returns", self.what, why, self.writes_to)
        return KvcStoreError(f"{self.what} is unreachable ({why})" + (f"; {op} failed" if op else ""))

    def ok(self) -> None:
        if self._down_since is None:
            return
        with self._lock:
            was, self._down_since = self._down_since, None
        if was is not None:
            log.warning("store: %s reachable again after %.1f s", self.what, time.time() - was)


class NodeOutageGuard(OutageGuard):
    """Failures of single nodes of a many-node tier: the tier stays up, warnings at most every ``warn_every`` s.

    ``consequence`` ends the warning (what a dead node means for callers).
    """

    def __init__(self, what: str, warn_every: float, *, consequence: str) -> None:
        super().__init__(what, 0.0)
        self.warn_every = warn_every
        self.consequence = consequence
        self._last_warn = -warn_every

    @property
    def up(self) -> bool:
        return True

    def check(self, op: str) -> None:
        """Never skips a call: live nodes keep answering for their share."""

    def failed(self, why: str, op: str | None = None) -> KvcStoreError:
        self.last_error = why
        now = time.monotonic()
        with self._lock:
            warn = now - self._last_warn >= self.warn_every
            if warn:
                self._last_warn = now
                self.outages += 1
        if warn:
            log.warning("store: %s: a node is unreachable (%s); %s", self.what, why, self.consequence)
        return KvcStoreError(f"{self.what}: {op} failed: {why}")

    def ok(self) -> None:
        pass
