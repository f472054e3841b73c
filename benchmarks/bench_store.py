"""Throughput of the byte-level store tiers (directory, Redis, HTTP range reads).

    python benchmarks/bench_store.py [--size-mb 16] [--n 8]

Starts its own redis-server / nginx on loopback when the binaries exist.
Prints one line per measurement (MB/s of payload).  For the directory and
Redis tiers it also measures the cost of tenant isolation side by side: the
Store (HMAC name, sealed metadata, block hashes checked on every get) against
the same tier driven directly (envelope CRC32C only, what a Store did before
tenant keys), same payloads, same process, alternating runs.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import harness
from kvcodec.store import HttpRangeReader, Store, StoreKey, TenantKey  # noqa: E402
from kvcodec.testing.servers import NginxServer, RedisServer, find_binary  # noqa: E402


ROWS: list[dict] = []  # every measurement printed, for the result document


def bench(label: str, url: str, payloads: list[bytes]) -> None:
    keys = [StoreKey.for_tokens([i] * 10, model="bench", codec="raw") for i in range(len(payloads))]
    total = sum(map(len, payloads)) / 1e6
    st = Store.open(url, memory_bytes=0)
    with harness.stopwatch(cpu=None) as sw:
        for k, p in zip(keys, payloads):
            st.put(k, p)
    tp = sw.wall
    st2 = Store.open(url, memory_bytes=0)
    with harness.stopwatch(cpu=None) as sw:
        for k, p in zip(keys, payloads):
            assert st2.get(k) == p
    tg = sw.wall
    ROWS.append({"tier": label, "put_mb_s": total / tp, "get_verified_mb_s": total / tg})
    print(f"{label:28s} put {total / tp:8.0f} MB/s   get (verified) {total / tg:8.0f} MB/s")
    st.close()
    st2.close()


def bench_seal(label: str, url: str, payloads: list[bytes], repeats: int = 3) -> None:
    """Store put/get (sealed, verified) vs the bare tier (CRC only): best of ``repeats``."""
    keys = [StoreKey.for_tokens([i] * 10, model="bench", codec="seal") for i in range(len(payloads))]
    total = sum(map(len, payloads)) / 1e6
    st = Store.open(url, memory_bytes=0, key=TenantKey(b"k" * 32))
    tier = st.tiers[1]
    phys = [st.physical(k) for k in keys]
    best: dict[str, float] = {}

    def timed(name: str, fn) -> None:  # alternating runs, so one call at a time; best of `repeats`
        best[name] = min(best.get(name, 1e9), harness.timeit(fn, 1, cpu=None).min)

    for _ in range(repeats):
        timed("tier put", lambda: [tier.put(p, d, {}) for p, d in zip(phys, payloads)])
        timed("tier get", lambda: [tier.get_entry(p) for p in phys])
        timed("store put", lambda: [st.put(k, d) for k, d in zip(keys, payloads)])
        timed("store get", lambda: [st.get(k) for k in keys])
    assert all(st.get(k) == d for k, d in zip(keys, payloads))
    for op in ("put", "get"):
        a, b = best[f"tier {op}"], best[f"store {op}"]
        ROWS.append({"tier": label, "op": op, "tier_mb_s": total / a, "store_seal_mb_s": total / b, "time_ratio": b / a})
        print(f"{label:28s} {op}: tier {total / a:7.0f} MB/s   store+seal {total / b:7.0f} MB/s   "
              f"store/tier time {b / a:5.2f}x")
    st.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size-mb", type=float, default=16)
    ap.add_argument("--n", type=int, default=8)
    run = harness.cli(ap, argv, case="store")
    a = run.args
    payloads = [os.urandom(int(a.size_mb * (1 << 20))) for _ in range(a.n)]
    with tempfile.TemporaryDirectory() as td:
        bench("directory fsync", f"{td}/d1", payloads)
        bench("directory no fsync", f"file://{td}/d2?fsync=0", payloads)
        bench_seal("seal cost, directory no fsync", f"file://{td}/d3?fsync=0", payloads)
        rb = find_binary("redis-server")
        if rb:
            srv = RedisServer(rb, Path(td))
            srv.start()
            try:
                bench("redis (loopback)", srv.url, payloads)
                bench_seal("seal cost, redis (loopback)", srv.url, payloads)
            finally:
                srv.stop()
        nb = find_binary("nginx")
        if nb:
            srv2 = NginxServer(nb, Path(td) / "ng", Path(td) / "www")
            (srv2.root / "blob").write_bytes(payloads[0])
            pub = Store.open(f"file://{srv2.root}/pub?fsync=0", key=TenantKey(b"k" * 32))
            k0 = StoreKey.for_tokens([0] * 10, model="bench", codec="seal")
            pub.put(k0, payloads[0])
            srv2.start()
            try:
                st = Store.open(srv2.base + "pub/", memory_bytes=0, key=TenantKey(b"k" * 32))
                for label, r in (("raw", HttpRangeReader(srv2.base + "blob")), ("sealed", st.reader(k0))):
                    n = 0
                    with harness.stopwatch(cpu=None) as sw:
                        for off in range(0, r.size, 1 << 20):
                            r.read(off, min(1 << 20, r.size - off))
                            n += 1
                    dt = sw.wall
                    ROWS.append({"tier": f"http 1 MiB pieces, {label}", "req_s": n / dt, "mb_s": r.size / dt / 1e6})
                    print(f"http 1 MiB pieces, {label:6s}    {n / dt:8.0f} req/s  {r.size / dt / 1e6:8.0f} MB/s")
                r = HttpRangeReader(srv2.base + "blob")
                for piece in (4096, 1 << 20):
                    n = 0
                    with harness.stopwatch(cpu=None) as sw:
                        for off in range(0, min(r.size, 256 * piece), piece):
                            r.read(off, min(piece, r.size - off))
                            n += 1
                    dt = sw.wall
                    ROWS.append({"tier": f"http range {piece} B", "req_s": n / dt, "mb_s": n * piece / dt / 1e6})
                    print(f"http range {piece:>8d} B        {n / dt:8.0f} req/s  "
                          f"{n * piece / dt / 1e6:8.0f} MB/s")
            finally:
                srv2.stop()
    run.emit({"size_mb": a.size_mb, "entries": a.n, "redis": bool(rb), "nginx": bool(nb), "rows": ROWS})


if __name__ == "__main__":
    main()
