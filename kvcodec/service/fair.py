"""Fair sharing of the KDN service's expensive work between tenants.

:class:`FairScheduler` hands out a fixed number of *slots* (the decode workers,
the CPU threads): at most ``per_tenant`` of them to one tenant at a time, and,
when several tenants wait, to the tenants in round-robin order, whatever order
their requests arrived in (the tenant served least recently goes first).  So a tenant that queues a thousand expensive
requests delays another tenant's request by at most the one request of its
own that is running, never by its whole queue.  Each tenant may have at most
``max_queued`` requests waiting (more: :class:`Overloaded`, answered ``429``),
and a request waits at most until its deadline (:class:`Overloaded`, ``503``).

:class:`TokenBucket` is a per-tenant rate quota (decoded bytes per second) in
deficit form: work is admitted while the tenant's balance is positive and its
cost is charged afterwards, so one file larger than the burst still goes
through, and then the tenant waits for the balance to refill.

Both live on the event loop (no locks): every method is called from the loop.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from contextlib import asynccontextmanager
from typing import AsyncIterator


class Overloaded(Exception):
    """Refused for load: ``status`` (429 the tenant's own queue or quota, 503 the server's), ``retry_after`` seconds."""

    def __init__(self, status: int, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = max(1.0, retry_after)


class FairScheduler:
    """``slots`` slots shared by tenants round-robin, at most ``per_tenant`` each (see the module docstring)."""

    def __init__(self, slots: int, per_tenant: int, max_queued: int, name: str = "worker") -> None:
        if slots < 1 or per_tenant < 1 or max_queued < 0:
            raise ValueError("slots and per_tenant must be >= 1, max_queued >= 0")
        self.slots, self.per_tenant, self.max_queued, self.name = slots, per_tenant, max_queued, name
        self.free = slots
        self.running: dict[str, int] = {}
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._served: dict[str, int] = {}  # tenant -> serial of its last grant (who waited longest goes first)
        self._serial = 0

    def queued(self, tenant: str | None = None) -> int:
        if tenant is not None:
            return len(self._queues.get(tenant, ()))
        return sum(len(q) for q in self._queues.values())

    def _may_run(self, tenant: str) -> bool:
        return self.free > 0 and self.running.get(tenant, 0) < self.per_tenant

    def _take(self, tenant: str) -> None:
        self.free -= 1
        self.running[tenant] = self.running.get(tenant, 0) + 1
        self._serial += 1
        self._served[tenant] = self._serial
        if len(self._served) > 100_000:  # tenants come from the token file: a bound, not an expected size
            self._served.clear()

    async def acquire(self, tenant: str, deadline: float) -> None:
        """Wait for a slot (``deadline``: ``time.monotonic()`` seconds); :class:`Overloaded` when refused."""
        if self._may_run(tenant) and not self._queues.get(tenant):
            self._take(tenant)
            return
        q = self._queues.get(tenant)
        if q is not None and len(q) >= self.max_queued:
            raise Overloaded(429, f"tenant has {len(q)} requests waiting for a {self.name} already (limit "
                                  f"{self.max_queued}); retry later")
        if q is None:
            q = self._queues[tenant] = deque()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        q.append(fut)
        try:
            await asyncio.wait_for(asyncio.shield(fut), max(0.0, deadline - time.monotonic()))
        except (asyncio.TimeoutError, asyncio.CancelledError) as e:
            if fut.done() and not fut.cancelled():
                self.release(tenant)  # granted just as we gave up: hand it on
            else:
                fut.cancel()
                self._forget(tenant, fut)
            if isinstance(e, asyncio.CancelledError):
                raise
            raise Overloaded(503, f"no {self.name} became free before the request's deadline") from None

    def _forget(self, tenant: str, fut: asyncio.Future[None]) -> None:
        q = self._queues.get(tenant)
        if q is None:
            return
        try:
            q.remove(fut)
        except ValueError:
            pass
        if not q:
            del self._queues[tenant]

    def release(self, tenant: str) -> None:
        self.free += 1
        n = self.running.get(tenant, 0) - 1
        if n > 0:
            self.running[tenant] = n
        else:
            self.running.pop(tenant, None)
        self._dispatch()

    def _dispatch(self) -> None:
        """Grant free slots to waiting tenants, least recently served first (round robin across tenants)."""
        while self.free > 0:
            best: str | None = None
            for tenant, q in self._queues.items():
                if q and self.running.get(tenant, 0) < self.per_tenant and \
                        (best is None or self._served.get(tenant, -1) < self._served.get(best, -1)):
                    best = tenant
            if best is None:
                return
            q = self._queues[best]
            fut = q.popleft()
            if not q:
                del self._queues[best]
            if fut.done():  # gave up meanwhile
                continue
            self._take(best)
            fut.set_result(None)

    @asynccontextmanager
    async def slot(self, tenant: str, deadline: float) -> AsyncIterator[None]:
        await self.acquire(tenant, deadline)
        try:
            yield
        finally:
            self.release(tenant)


class TokenBucket:
    """Per-tenant quota of ``rate`` units per second, ``burst`` at most banked, in deficit form (module docstring)."""

    def __init__(self, rate: float, burst: float, max_keys: int | None = None) -> None:
        self.rate, self.burst = float(rate), float(burst)
        # tenant -> (balance, at), oldest charge first; ``max_keys`` bounds it where keys are not (client addresses):
        # the oldest is forgotten, which forgives it (a full balance), never punishes anyone else
        self._balance: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.max_keys = max_keys

    def balance(self, tenant: str, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        b, at = self._balance.get(tenant, (self.burst, now))
        return min(self.burst, b + (now - at) * self.rate)

    def check(self, tenant: str) -> None:
        """:class:`Overloaded` (429) while the tenant's balance is not positive; 0 rate: no quota."""
        if self.rate <= 0:
            return
        b = self.balance(tenant)
        if b <= 0:
            raise Overloaded(429, f"tenant over its decode quota of {self.rate / 2**20:,.0f} MiB/s; retry later",
                             retry_after=-b / self.rate)

    def charge(self, tenant: str, amount: float) -> None:
        if self.rate <= 0:
            return
        now = time.monotonic()
        self._balance[tenant] = (self.balance(tenant, now) - amount, now)
        self._balance.move_to_end(tenant)
        if self.max_keys is not None:
            while len(self._balance) > self.max_keys:
                self._balance.popitem(last=False)
