"""Units of the KDN service's bounded work (issue 35): fair slots and quotas, worker processes with deadlines,
range and JSON edge cases, the entry checks' order.  No server, no model."""

from __future__ import annotations

import os

import asyncio
import json
import time

import numpy as np
import pytest

from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.service.config import ServiceConfig
from kvcodec.service.httputil import parse_range
from kvcodec.service.checks import HttpError, check_digest, check_entry, lookup_candidates, parse_json, parse_lookup
from kvcodec.service.fair import FairScheduler, Overloaded, TokenBucket
from kvcodec.service.worker import TEST_OPS_ENV
from kvcodec.service.workers import WorkerPool
from kvcodec.store import StoreKey
from kvcodec.testing.attacks import amplification_entry, costly_entry, deep_json, honest_entry


# -- fair slots ------------------------------------------------------------------------------------------
def test_a_flooding_tenant_delays_another_by_one_job_not_its_queue():
    """One slot: b queues five jobs, then a queues one; a runs right after b's first, not after all five."""
    async def main() -> list[str]:
        s = FairScheduler(1, 1, max_queued=10)
        order: list[str] = []

        async def job(tenant: str, i: int) -> None:
            async with s.slot(tenant, time.monotonic() + 10):
                order.append(f"{tenant}{i}")
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(job("b", i)) for i in range(5)]
        await asyncio.sleep(0)  # b's jobs are queued first
        tasks.append(asyncio.create_task(job("a", 0)))
        await asyncio.gather(*tasks)
        return order

    order = asyncio.run(main())
    assert order[:2] == ["b0", "a0"], order
    assert sorted(order) == ["a0", "b0", "b1", "b2", "b3", "b4"]


def test_per_tenant_slots_queue_limit_and_deadline():
    async def main() -> None:
        s = FairScheduler(3, 1, max_queued=2)
        far = time.monotonic() + 10
        await s.acquire("b", far)  # b may hold one slot only, however many are free
        waits = [asyncio.create_task(s.acquire("b", far)) for _ in range(2)]
        await asyncio.sleep(0)
        assert s.queued("b") == 2 and s.free == 2
        with pytest.raises(Overloaded) as e:
            await s.acquire("b", far)
        assert e.value.status == 429
        await s.acquire("a", far)  # another tenant is not behind b's queue
        with pytest.raises(Overloaded) as e:
            await s.acquire("a", time.monotonic() + 0.05)  # a's own limit, until its deadline
        assert e.value.status == 503 and s.queued("a") == 0
        s.release("b")
        await asyncio.wait_for(waits[0], 1)
        assert s.queued("b") == 1
        for w in waits[1:]:
            w.cancel()

    asyncio.run(main())


def test_decode_quota_is_per_tenant_and_in_deficit_form():
    q = TokenBucket(rate=1000, burst=5000)
    q.check("b")
    q.charge("b", 50_000)  # one job larger than the burst goes through, then the tenant waits
    with pytest.raises(Overloaded) as e:
        q.check("b")
    assert e.value.status == 429 and 40 <= e.value.retry_after <= 46
    q.check("a")  # another tenant's balance is its own
    TokenBucket(0, 0).check("b")  # rate 0: no quota


# -- worker processes ------------------------------------------------------------------------------------
def test_a_job_past_its_deadline_kills_its_worker_and_the_pool_recovers(monkeypatch):
    monkeypatch.setenv(TEST_OPS_ENV, "1")

    async def main() -> None:
        pool = WorkerPool(1, per_tenant=1, max_queued=4)
        await pool.start()
        try:
            pid = pool.pids()[0]
            t0 = time.monotonic()
            with pytest.raises(HttpError) as e:
                await pool.run("b", time.monotonic() + 0.5, {"op": "spin", "seconds": 30})
            assert e.value.status == 504 and time.monotonic() - t0 < 10
            assert pool.killed == 1 and pool.pids() != [pid]
            rep = await pool.run("a", time.monotonic() + 30, {"op": "ping"})
            assert rep["ok"] and rep["pid"] == pool.pids()[0]
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_tenant_s_jobs_are_paced_to_its_worker_cpu_share_and_others_are_not(monkeypatch):
    """tenant_cpu 0.25 cores, burst 0.25 CPU-s: b's spinning job is charged its worker's CPU time after it runs (what it used,
    not its wall time), so b's next job waits for its balance to refill (or is a 429 when that would pass its
    deadline), while a's jobs run at once."""
    monkeypatch.setenv(TEST_OPS_ENV, "1")

    async def main() -> None:
        pool = WorkerPool(2, per_tenant=1, max_queued=4, tenant_cpu=0.25, cpu_burst=0.25)
        await pool.start()
        try:
            used0 = sum(p.cpu_s() for p in pool._all)
            assert (await pool.run("b", time.monotonic() + 60, {"op": "spin", "cpu_seconds": 0.5}))
            used = sum(p.cpu_s() for p in pool._all) - used0
            # a spin of 0.5 CPU-s (a wall-time spin gets 0.13 CPU-s on a busy box); /proc counts whole clock ticks for
            # user and system apart, so two readings may fall up to two ticks short of the worker's own clock
            assert used >= 0.5 - 2 / os.sysconf("SC_CLK_TCK"), used
            assert pool.cpu.balance("b") == pytest.approx(0.25 - used, abs=0.05)  # charged what its worker used
            t0 = time.monotonic()
            assert (await pool.run("a", time.monotonic() + 60, {"op": "ping"}))["ok"]
            assert time.monotonic() - t0 < 0.5, "another tenant is not paced"
            with pytest.raises(Overloaded) as e:
                await pool.run("b", time.monotonic() + 0.05, {"op": "ping"})
            assert e.value.status == 429 and "CPU share" in str(e.value)
            t0 = time.monotonic()
            assert (await pool.run("b", time.monotonic() + 60, {"op": "ping"}))["ok"]
            assert time.monotonic() - t0 >= 0.05, "b waited for its share to refill"
            assert pool.cpu.balance("a") > 0
        finally:
            await pool.close()

    asyncio.run(main())


def test_a_job_over_the_worker_memory_limit_is_one_line_and_the_worker_is_replaced(monkeypatch):
    """--worker-memory is a hard limit (RLIMIT_DATA in the worker): a job that needs more gets one line, and its
    worker is replaced; the same job under a larger limit succeeds (so the refusal is the limit's doing)."""
    monkeypatch.setenv(TEST_OPS_ENV, "1")

    async def main() -> None:
        small = WorkerPool(1, per_tenant=1, max_queued=4, memory=64 << 20)
        large = WorkerPool(1, per_tenant=1, max_queued=4, memory=1 << 30)
        await small.start()
        await large.start()
        try:
            pid = small.pids()[0]
            with pytest.raises(HttpError) as e:
                await small.run("a", time.monotonic() + 60, {"op": "alloc", "bytes": 256 << 20})
            assert e.value.status == 413 and "--worker-memory" in str(e.value) and "\n" not in str(e.value)
            assert small.pids() != [pid], "a worker that ran out of memory is replaced"
            assert (await small.run("a", time.monotonic() + 60, {"op": "alloc", "bytes": 8 << 20}))["ok"]
            assert (await large.run("a", time.monotonic() + 60, {"op": "alloc", "bytes": 256 << 20}))["ok"]
        finally:
            await small.close()
            await large.close()

    asyncio.run(main())


def test_worker_checks_an_entry_in_two_steps_and_stops_when_refused():
    async def main() -> None:
        pool = WorkerPool(1, per_tenant=1, max_queued=4)
        await pool.start()
        try:
            key, data = honest_entry(5, 64)
            job = {"op": "check", "key": key.to_str(), "max_decoded_bytes": 1 << 30, "max_decoded_ratio": 256.0,
                   "max_chunk_bytes": 1 << 30, "verify": True, "crc": None}
            seen: list[int] = []
            rep = await pool.run("a", time.monotonic() + 60, job, data, decide=lambda r: seen.append(r["declared"]) or True)
            assert rep["ok"] and seen == [2 * 2 * 2 * 64 * 4 * 4]

            def refuse(r: dict) -> bool:
                raise Overloaded(429, "quota")

            with pytest.raises(Overloaded):
                await pool.run("a", time.monotonic() + 60, job, data, decide=refuse)
            assert (await pool.run("a", time.monotonic() + 60, {"op": "ping"}))["ok"], "the worker is idle again"
            akey, amp = amplification_entry(7, 500)
            with pytest.raises(HttpError) as e:
                await pool.run("a", time.monotonic() + 60, {**job, "key": akey.to_str()}, amp, decide=lambda r: True)
            assert e.value.status == 422 and "its size" in str(e.value)
        finally:
            await pool.close()

    asyncio.run(main())


# -- the checks, cheapest first --------------------------------------------------------------------------
def test_entry_checks_run_cheapest_first():
    """A damaged chunk under a key naming another model: refused for the model (read from the header),
    never decoded; the digest search is bounded; the ratio limit comes before the token ids."""
    key, data = costly_entry(3, 64)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF  # inside a chunk: only a decode (its CRC) finds it
    wrong_model = StoreKey.for_tokens(np.arange(3, 67), model="0" * 32, codec="c", namespace="default")
    with pytest.raises(KvcInputError, match="for model"):
        check_entry(wrong_model, bytes(bad), max_decoded_bytes=1 << 30, max_decoded_ratio=256)
    with pytest.raises(KvcFormatError, match="does not verify"):
        check_entry(key, bytes(bad), max_decoded_bytes=1 << 30, max_decoded_ratio=256)
    assert check_entry(key, data, max_decoded_bytes=1 << 30, max_decoded_ratio=256) == 64 * 128 * 1024
    akey, amp = amplification_entry(7, 500)
    with pytest.raises(KvcFormatError, match="its size"):
        check_entry(akey, amp, max_decoded_bytes=1 << 40, max_decoded_ratio=256)
    with pytest.raises(KvcFormatError, match="smaller chunks"):
        check_entry(key, data, max_decoded_bytes=1 << 30, max_decoded_ratio=256, max_chunk_bytes=1 << 17)


def test_digest_search_is_bounded():
    ids = np.arange(720_720) % 50_000  # 240 divisors: an unbounded search hashes ~170M token ids
    k = StoreKey("m", "c", "n", 720_720, "0" * 64)
    t0 = time.monotonic()
    with pytest.raises(KvcInputError, match="do not hash"):
        check_digest(ids, k)
    assert time.monotonic() - t0 < 20
    from kvcodec.store.keys import chunk_hashes

    for c in (256, 720_720, 5040):  # what honest clients chain with is still found (largest first)
        d = chunk_hashes(ids, c, model="m", codec="c", namespace="n")[-1].hex()
        check_digest(ids, StoreKey("m", "c", "n", 720_720, d))


# -- JSON and lookups ------------------------------------------------------------------------------------
def test_json_bodies_deep_or_malformed_are_one_line_400s():
    for raw in (deep_json(), b"[" * 5000, b"\xff\xfe", b'{"a":', b"[]", b"1e999999"):
        with pytest.raises(HttpError) as e:
            parse_json(raw)
        assert e.value.status == 400 and "\n" not in str(e.value)
    assert parse_json(b'{"keys": []}') == {"keys": []}


def test_lookups_are_bounded():
    ns = ["a"]
    base = {"model": "m", "codec": "c", "namespace": "a"}
    q = parse_lookup({**base, "token_ids": list(range(5000)), "chunk": 1}, ns)
    with pytest.raises(HttpError, match="larger 'chunk'"):
        lookup_candidates(q, q.token_ids)
    with pytest.raises(HttpError) as e:
        parse_lookup({**base, "namespace": "b", "token_ids": [1]}, ns)
    assert e.value.status == 403
    with pytest.raises(HttpError) as e:
        parse_lookup({**base, "text": "x" * 101}, ns, max_text=100)
    assert e.value.status == 413
    for bad in ([-1], [1 << 31], [True], [[1]], "12"):
        with pytest.raises(HttpError):
            parse_lookup({**base, "token_ids": bad}, ns)


# -- ranges ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("header,size,want", [
    ("bytes=0-9", 100, (0, 10)), ("bytes=90-", 100, (90, 100)), ("bytes=90-500", 100, (90, 100)),
    ("bytes=-10", 100, (90, 100)), ("bytes=-500", 100, (0, 100)), ("bytes=0-0", 100, (0, 1)),
    ("bytes=-0", 100, "unsatisfiable"), ("bytes=100-", 100, "unsatisfiable"), ("bytes=0-", 0, "unsatisfiable"),
    ("bytes=-5", 0, "unsatisfiable"), ("bytes=" + "9" * 40 + "-", 100, "unsatisfiable"),
    ("bytes=0-" + "9" * 5000, 100, (0, 100)), ("bytes=5-3", 100, None), ("bytes=0-1,5-6", 100, None),
    ("items=0-1", 100, None), ("bytes=a-b", 100, None), ("bytes=-", 100, None), ("bytes=\u0661-", 100, None),
    ("BYTES = 1-2", 100, (1, 3)),
])
def test_range_edge_cases(header, size, want):
    assert parse_range(header, size) == want


def test_service_config_refuses_out_of_range_limits():
    ServiceConfig().check()
    for bad in ({"workers": 0}, {"header_timeout": 0}, {"body_timeout": float("nan")}, {"max_decoded_ratio": -1},
                {"tenant_decode_rate": float("inf")}, {"max_body": True}):
        with pytest.raises(KvcInputError):
            ServiceConfig(**bad).check()  # type: ignore[arg-type]
    assert json.dumps(ServiceConfig().max_decoded_bytes) == str(4 << 30)
    with pytest.raises(KvcInputError, match="worker-memory"):  # a worker must be able to hold the body it checks
        ServiceConfig(max_body=1 << 30, worker_memory=1 << 30).check()


def test_the_stated_memory_bound_counts_every_enforced_term():
    c = ServiceConfig(workers=3, worker_memory=512 << 20, max_inflight_body=256 << 20, max_body=128 << 20,
                      tenant_inflight_body=128 << 20)
    one, two = c.memory_bound(1), c.memory_bound(2)
    assert two - one == 64 << 20, "each tenant's cache"
    assert ServiceConfig(workers=4, worker_memory=512 << 20, max_inflight_body=256 << 20, max_body=128 << 20,
                         tenant_inflight_body=128 << 20).memory_bound(1) - one > 512 << 20, "each worker's limit"
