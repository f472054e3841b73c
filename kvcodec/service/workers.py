"""The KDN service's worker processes, seen from the event loop: a bounded pool, shared fairly between tenants.

``WorkerPool(n)`` starts ``n`` processes (:mod:`kvcodec.service.worker`) and
hands them out through a :class:`~kvcodec.service.fair.FairScheduler`: at most
``per_tenant`` to one tenant at once, round-robin between waiting tenants, a
bounded queue per tenant and a deadline per job.  A job still running at its
deadline is ended by killing its process (a thread could not be stopped); a
replacement is started before the slot is handed on, so the pool never
shrinks.  Each worker may allocate at most ``memory`` bytes beyond its started
state (``RLIMIT_DATA``, set by the worker itself: :func:`kvcodec.service.worker.limit_data`); a job that
needs more is refused with one line and its worker replaced, as is a worker whose resident memory grew
past its base plus ``memory`` after a job.

Talking to a worker is asynchronous (asyncio subprocess pipes), so the event
loop never blocks on it, and no work of the job's size happens in this
process: this is what keeps one tenant's expensive request from stalling
every other request (issue 35).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any, Callable

from kvcodec.service.checks import HttpError
from kvcodec.service.fair import FairScheduler, Overloaded, TokenBucket
from kvcodec.service.worker import FRAME, MAX_HEADER

log = logging.getLogger("kvcodec.service")

_PKG_ROOT = str(Path(__file__).resolve().parents[2])
CPU_BURST = 2.0  # worker CPU-seconds a tenant may use at once before its jobs are paced to its share


class WorkerDied(Exception):
    pass


class _Proc:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.jobs = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def cpu_s(self) -> float:
        """CPU-seconds (user + system) the process has used so far; 0 if it is gone."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, ValueError, IndexError):
            return 0.0

    def rss(self) -> int:
        try:
            with open(f"/proc/{self.pid}/statm") as f:
                return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            return 0

    async def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        import json

        stdin = self.proc.stdin
        assert stdin is not None
        h = json.dumps(header, separators=(",", ":")).encode()
        try:
            stdin.write(FRAME.pack(len(h), len(payload)) + h)
            if payload:
                stdin.write(payload)
            await stdin.drain()
        except (ConnectionError, BrokenPipeError, RuntimeError) as e:
            raise WorkerDied(f"worker {self.pid} gone: {type(e).__name__}") from None

    async def recv(self) -> dict[str, Any]:
        import json

        stdout = self.proc.stdout
        assert stdout is not None
        try:
            head = await stdout.readexactly(FRAME.size)
            hl, pl = FRAME.unpack(head)
            if hl > MAX_HEADER or pl:
                raise WorkerDied(f"worker {self.pid} sent a malformed frame")
            obj = json.loads(await stdout.readexactly(hl))
        except (asyncio.IncompleteReadError, ConnectionError, ValueError):
            raise WorkerDied(f"worker {self.pid} died") from None
        if not isinstance(obj, dict):
            raise WorkerDied(f"worker {self.pid} sent a malformed reply")
        return obj

    def kill(self) -> None:
        try:
            self.proc.kill()
        except ProcessLookupError:
            pass


class WorkerPool:
    """``n`` worker processes behind a fair scheduler (see the module docstring)."""

    def __init__(self, n: int, *, per_tenant: int = 1, max_queued: int = 16, queue_timeout: float = 60.0,
                 tokenizers: dict[str, str] | None = None, memory: int = 2 << 30, base: int = 256 << 20,
                 tenant_cpu: float = 0.0, cpu_burst: float = CPU_BURST) -> None:
        self.n = n
        self.sched = FairScheduler(n, per_tenant, max_queued, name="worker")
        # each tenant's worker CPU-seconds per second (0: no share), charged after each job, in deficit form
        self.cpu = TokenBucket(tenant_cpu, max(cpu_burst, tenant_cpu))
        self.max_queued = max_queued
        self._pacing: dict[str, int] = {}  # tenant -> jobs waiting for its CPU balance to refill
        self.queue_timeout = queue_timeout
        self.tokenizers = dict(tokenizers or {})
        self.memory = memory
        self.max_rss = base + memory
        self._idle: list[_Proc] = []
        self._all: set[_Proc] = set()
        self.killed = 0
        self.recycled = 0

    # -- lifecycle -------------------------------------------------------------------------------
    async def _spawn(self) -> _Proc:
        # -c, not -m: the package imports the module already, and runpy would warn about running it twice
        args = [sys.executable, "-c", "from kvcodec.service.worker import main; main()"]
        for fp, d in self.tokenizers.items():
            args += ["--tokenizer", f"{fp}={d}"]
        args += ["--memory", str(self.memory)]
        env = dict(os.environ)
        env["PYTHONPATH"] = _PKG_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        proc = await asyncio.create_subprocess_exec(*args, stdin=asyncio.subprocess.PIPE,
                                                    stdout=asyncio.subprocess.PIPE, env=env,
                                                    limit=MAX_HEADER + FRAME.size)
        p = _Proc(proc)
        self._all.add(p)
        try:
            await p.send({"op": "ping"})
            await asyncio.wait_for(p.recv(), 120.0)
        except (WorkerDied, asyncio.TimeoutError):
            self._discard(p)
            raise WorkerDied("a worker process failed to start") from None
        return p

    def _discard(self, p: _Proc) -> None:
        p.kill()
        self._all.discard(p)

    async def start(self) -> None:
        procs = await asyncio.gather(*(self._spawn() for _ in range(self.n)))
        self._idle.extend(procs)

    async def close(self) -> None:
        for p in list(self._all):
            p.kill()
        for p in list(self._all):
            try:
                await asyncio.wait_for(p.proc.wait(), 5.0)
            except asyncio.TimeoutError:  # pragma: no cover
                pass
        self._all.clear()
        self._idle.clear()

    def pids(self) -> list[int]:
        return [p.pid for p in self._all]

    async def _replace(self, p: _Proc) -> None:
        self._discard(p)
        try:
            await p.proc.wait()
        except Exception:  # pragma: no cover
            pass
        for _ in range(3):
            try:
                self._idle.append(await self._spawn())
                return
            except WorkerDied as e:  # pragma: no cover - machine out of processes or memory
                log.error("kdn: %s; retrying", e)
                await asyncio.sleep(1.0)
        raise WorkerDied("could not replace a worker process")  # pragma: no cover

    # -- jobs ------------------------------------------------------------------------------------
    async def run(self, tenant: str, deadline: float, header: dict[str, Any], payload: bytes = b"",
                  decide: Callable[[dict[str, Any]], bool] | None = None, what: str = "job") -> dict[str, Any]:
        """Run one job for ``tenant`` before ``deadline`` (``time.monotonic()``); its final reply.

        ``decide`` (two-step jobs): called with the worker's intermediate reply (``"declared"``); it may
        raise (e.g. :class:`Overloaded` for a quota) to stop the job before its expensive step.
        A reply carrying ``error`` becomes :class:`HttpError`; the deadline becomes 504.
        """
        wait_until = min(deadline, time.monotonic() + self.queue_timeout)
        await self.pace(tenant, wait_until)
        await self.sched.acquire(tenant, wait_until)
        p = self._idle.pop()
        ok = False
        reply: dict[str, Any] = {}
        cpu0 = p.cpu_s()
        try:
            left = deadline - time.monotonic()
            if left <= 0:
                raise asyncio.TimeoutError
            reply = await asyncio.wait_for(self._exchange(p, header, payload, decide), left)
            ok = True
        except (Overloaded, HttpError):  # ``decide`` refused: the worker stopped cleanly and is idle again
            ok = True
            raise
        except asyncio.TimeoutError:
            self.killed += 1
            await self._replace(p)
            raise HttpError(504, f"the {what} did not finish before the request's deadline") from None
        except WorkerDied as e:
            await self._replace(p)
            raise HttpError(422 if header.get("op") == "check" else 500,
                            f"the {what} ended its worker process ({e})") from None
        except BaseException:
            await self._replace(p)  # mid-exchange: the worker's state is unknown
            raise
        finally:
            self.cpu.charge(tenant, max(0.0, p.cpu_s() - cpu0))  # a killed worker's is lost: at most one job's
            if ok:
                p.jobs += 1
                if reply.get("recycle") or p.rss() > self.max_rss:
                    self.recycled += 1
                    await self._replace(p)
                else:
                    self._idle.append(p)
            self.sched.release(tenant)
        if "error" in reply:
            raise HttpError(int(reply.get("status", 400)), str(reply["error"]))
        return reply

    async def pace(self, tenant: str, wait_until: float) -> None:
        """Hold a job of a tenant over its CPU share until its balance is positive again (a sleeping coroutine: no
        worker, no CPU), so that legal but expensive jobs (a costly put's decode, a large lookup) of one tenant take
        at most ``tenant_cpu`` cores on average however many it sends, and other tenants keep the rest. A job that
        would wait past ``wait_until``, or one beyond ``max_queued`` of the tenant's held jobs, is a 429 now."""
        b = self.cpu.balance(tenant)
        if self.cpu.rate <= 0 or b > 0:
            return
        wait = -b / self.cpu.rate
        if time.monotonic() + wait > wait_until or self._pacing.get(tenant, 0) >= self.max_queued:
            raise Overloaded(429, f"tenant over its worker CPU share of {self.cpu.rate:g} cores; retry later",
                             retry_after=wait)
        self._pacing[tenant] = self._pacing.get(tenant, 0) + 1
        try:
            await asyncio.sleep(wait)
        finally:
            n = self._pacing[tenant] - 1
            if n:
                self._pacing[tenant] = n
            else:
                del self._pacing[tenant]

    async def _exchange(self, p: _Proc, header: dict[str, Any], payload: bytes,
                        decide: Callable[[dict[str, Any]], bool] | None) -> dict[str, Any]:
        await p.send(header, payload)
        reply = await p.recv()
        if "declared" in reply and "ok" not in reply and "error" not in reply:
            try:
                go = decide(reply) if decide is not None else True
            except BaseException:
                await p.send({"go": False})
                await p.recv()
                raise
            await p.send({"go": bool(go)})
            reply = await p.recv()
        return reply


__all__ = ["WorkerPool", "WorkerDied", "Overloaded"]
