"""A shaped loopback link: a throttling TCP proxy for tests and benchmarks (no root needed).

``ShapedLink(target_port, rate_bps=10e6, latency_s=0.01)`` listens on a random
loopback port and forwards every connection to ``127.0.0.1:target_port``
through one shared token bucket per direction (a link's capacity is shared by
its connections, as on a real access link), delaying each piece by
``latency_s`` (one way) without limiting throughput by it (pieces are
pipelined, each released at ``arrival + latency``).

``drop_after`` bytes of server-to-client traffic later the link *drops*:
``drop_mode="stall"`` stops forwarding but keeps connections open (a black
hole: the client learns only from its own timeouts), ``"reset"`` aborts
every connection and resets new ones. ``drop()`` does the same at once.

Why a proxy and not ``tc`` in a network namespace: it needs no root,
capabilities or kernel modules, so it runs the same on any CI machine. Its
limits: it shapes at the application layer (pieces of up to 64 KiB), and on
the project's 2-vCPU box Python forwards at a few hundred MB/s at most, so
a "1 Gbit/s" link is as fast as the proxy can go (benchmarks report the
throughput they measured).
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass

PIECE = 64 << 10


class TokenBucket:
    """``rate`` bytes per second, at most ``burst`` bytes ahead (asyncio, one event loop)."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate, self.burst = float(rate), float(burst)
        self.tokens = self.burst
        self.t = time.monotonic()

    async def take(self, n: int) -> None:
        while True:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t = now
            if self.tokens >= n or (self.tokens >= self.burst and n > self.burst):
                self.tokens -= n
                return
            await asyncio.sleep(max((n - self.tokens) / self.rate, 0.0005))


@dataclass
class LinkStats:
    down_bytes: int = 0
    up_bytes: int = 0
    connections: int = 0
    dropped: bool = False


class ShapedLink:
    """The proxy (see the module docstring). Use as a context manager; ``port`` is where clients connect."""

    def __init__(self, target_port: int, *, rate_bps: float | None = None, latency_s: float = 0.0,
                 drop_after: int | None = None, drop_mode: str = "stall", target_host: str = "127.0.0.1") -> None:
        if drop_mode not in ("stall", "reset"):
            raise ValueError("drop_mode is 'stall' or 'reset'")
        self.target = (target_host, int(target_port))
        self.rate = None if rate_bps is None else rate_bps / 8.0  # bytes per second
        self.latency = float(latency_s)
        self.drop_after = drop_after
        self.drop_mode = drop_mode
        self.stats = LinkStats()
        self.port = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    # -- control ---------------------------------------------------------------
    def start(self) -> "ShapedLink":
        self._thread = threading.Thread(target=self._run, name="kvc-shaped-link", daemon=True)
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("shaped link did not start")
        return self

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)

    def drop(self) -> None:
        """Drop the link now (as ``drop_mode`` says)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drop)

    def __enter__(self) -> "ShapedLink":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- loop -------------------------------------------------------------------
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)

        def quiet(lp: asyncio.AbstractEventLoop, ctx: dict) -> None:  # connections cancelled at stop are expected
            if not isinstance(ctx.get("exception"), (asyncio.CancelledError, ConnectionError)):
                lp.default_exception_handler(ctx)

        loop.set_exception_handler(quiet)
        self._loop = loop
        if self.rate is None:
            self._down = self._up = None
        else:
            burst = max(PIECE, self.rate * 0.005)
            self._down, self._up = TokenBucket(self.rate, burst), TokenBucket(self.rate, burst)

        async def serve() -> None:
            self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
            self.port = self._server.sockets[0].getsockname()[1]
            self._ready.set()

        loop.run_until_complete(serve())
        try:
            loop.run_forever()
        finally:
            for w in list(self._writers):
                w.transport.abort()
            if self._server is not None:
                self._server.close()
            tasks = asyncio.all_tasks(loop)
            for t in tasks:
                t.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    def _drop(self) -> None:
        self.stats.dropped = True
        if self.drop_mode == "reset":
            for w in list(self._writers):
                w.transport.abort()

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.stats.connections += 1
        if self.stats.dropped and self.drop_mode == "reset":
            cw.transport.abort()
            return
        try:
            sr, sw = await asyncio.open_connection(*self.target)
        except OSError:
            cw.transport.abort()
            return
        self._writers.update((cw, sw))
        try:
            await asyncio.gather(self._pump(cr, sw, self._up, down=False), self._pump(sr, cw, self._down, down=True))
        finally:
            for w in (cw, sw):
                self._writers.discard(w)
                w.transport.abort() if self.stats.dropped and self.drop_mode == "reset" else w.close()

    async def _pump(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, bucket: TokenBucket | None,
                    down: bool) -> None:
        q: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                got = await q.get()
                if got is None:
                    break
                at, data = got
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                while self.stats.dropped and self.drop_mode == "stall":
                    await asyncio.sleep(3600)  # black hole: held open, never delivered
                if self.stats.dropped:
                    return
                w.write(data)
                await w.drain()
            try:
                w.write_eof()
            except (OSError, RuntimeError):
                pass

        task = asyncio.ensure_future(deliver())
        try:
            while True:
                data = await r.read(PIECE)
                if not data:
                    break
                if self.stats.dropped:
                    if self.drop_mode == "stall":
                        continue
                    break
                if down and self.drop_after is not None and self.stats.down_bytes + len(data) > self.drop_after:
                    data = data[:max(0, self.drop_after - self.stats.down_bytes)]
                    self.stats.down_bytes += len(data)
                    if data:
                        await q.put((time.monotonic() + self.latency, data))
                    self._drop()
                    continue
                if bucket is not None:
                    await bucket.take(len(data))
                if down:
                    self.stats.down_bytes += len(data)
                else:
                    self.stats.up_bytes += len(data)
                await q.put((time.monotonic() + self.latency, data))
        except (ConnectionError, OSError):
            pass
        finally:
            await q.put(None)
            try:
                await task
            except (ConnectionError, OSError):
                pass
