"""Throughput of the byte-level store tiers (directory, Redis, HTTP range reads).

    python benchmarks/bench_store.py [--size-mb 16] [--n 8]

Starts its own redis-server / nginx on loopback when the binaries exist.
Prints one line per measurement (MB/s of payload).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvcodec.store import HttpRangeReader, Store, StoreKey  # noqa: E402
from store_fixtures import NginxServer, RedisServer, find_binary  # noqa: E402


def bench(label: str, url: str, payloads: list[bytes]) -> None:
    keys = [StoreKey.for_tokens([i] * 10, model="bench", codec="raw") for i in range(len(payloads))]
    total = sum(map(len, payloads)) / 1e6
    st = Store.open(url, memory_bytes=0)
    t = time.perf_counter()
    for k, p in zip(keys, payloads):
        st.put(k, p)
    tp = time.perf_counter() - t
    st2 = Store.open(url, memory_bytes=0)
    t = time.perf_counter()
    for k, p in zip(keys, payloads):
        assert st2.get(k) == p
    tg = time.perf_counter() - t
    print(f"{label:28s} put {total / tp:8.0f} MB/s   get (verified) {total / tg:8.0f} MB/s")
    st.close()
    st2.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mb", type=float, default=16)
    ap.add_argument("--n", type=int, default=8)
    a = ap.parse_args()
    payloads = [os.urandom(int(a.size_mb * (1 << 20))) for _ in range(a.n)]
    with tempfile.TemporaryDirectory() as td:
        bench("directory fsync", f"{td}/d1", payloads)
        bench("directory no fsync", f"file://{td}/d2?fsync=0", payloads)
        rb = find_binary("redis-server")
        if rb:
            srv = RedisServer(rb, Path(td))
            srv.start()
            try:
                bench("redis (loopback)", srv.url, payloads)
            finally:
                srv.stop()
        nb = find_binary("nginx")
        if nb:
            srv2 = NginxServer(nb, Path(td) / "ng", Path(td) / "www")
            (srv2.root / "blob").write_bytes(payloads[0])
            srv2.start()
            try:
                r = HttpRangeReader(srv2.base + "blob")
                for piece in (4096, 1 << 20):
                    n = 0
                    t = time.perf_counter()
                    for off in range(0, min(r.size, 256 * piece), piece):
                        r.read(off, min(piece, r.size - off))
                        n += 1
                    dt = time.perf_counter() - t
                    print(f"http range {piece:>8d} B        {n / dt:8.0f} req/s  "
                          f"{n * piece / dt / 1e6:8.0f} MB/s")
            finally:
                srv2.stop()


if __name__ == "__main__":
    main()
