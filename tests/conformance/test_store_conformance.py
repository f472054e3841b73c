"""Store conformance: every persistent tier keeps the same guarantees, against real servers.

Backends: the directory tier, one redis-server, a 3-master Redis Cluster
(redis-server in cluster mode, joined by redis-cli --cluster create) and an
S3-protocol server (moto's standalone server).  Each test runs on every
backend: round trip across processes (fresh Store objects), namespace
isolation, prefix lookup, listing, removal, a damaged value is a miss, large
entries and ranged reads, atomic visibility under concurrent writers of one
key, and a clean miss (with the write reported) when the server is down.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Callable

import pytest

from kvcodec.errors import KvcStoreError
from kvcodec.store import Store, StoreKey
from kvcodec.store.tenant import TenantKey
from store_fixtures import redis_cluster, redis_server, s3_server  # noqa: F401  (fixtures)


def key(i: int, ns: str = "default") -> StoreKey:
    return StoreKey.for_tokens(list(range(i, i + 256)), model="m", codec="c", namespace=ns)


def blob(i: int, n: int = 30_000) -> bytes:
    return bytes((i * 7 + j * 13) & 0xFF for j in range(n))


@dataclass
class Backend:
    name: str
    url: str
    tier: str                      # tier name in the store
    corrupt: Callable[[StoreKey], None]
    stop: Callable[[], None]


def phys(k: StoreKey) -> StoreKey:
    """The name ``k`` has on the tiers (this process's tenant key, spec/store-keys.md §8)."""
    return TenantKey.default().namespace(k.namespace).physical(k)


@pytest.fixture(params=["directory", "redis", "redis-cluster", "s3"])
def backend(request, tmp_path):
    kind = request.param
    if kind == "directory":
        from kvcodec.store.tiers.directory import DirectoryTier

        d = tmp_path / "dir"
        t = DirectoryTier(d)

        def corrupt(k: StoreKey) -> None:
            p = t.path_for(phys(k))
            b = bytearray(open(p, "rb").read())
            b[-1] ^= 1
            open(p, "wb").write(bytes(b))

        yield Backend(kind, str(d), "directory", corrupt, lambda: pytest.skip("a directory has no outage"))
        return
    if kind == "redis":
        srv = request.getfixturevalue("redis_server")
        import redis

        r = redis.Redis(port=srv.port)

        def corrupt(k: StoreKey) -> None:
            n = "kvc:" + phys(k).to_str()
            b = bytearray(r.get(n))
            b[-1] ^= 1
            r.set(n, bytes(b))

        yield Backend(kind, srv.url + "?timeout=0.5&retry_interval=0.2", "redis", corrupt, srv.stop)
        return
    if kind == "redis-cluster":
        c = request.getfixturevalue("redis_cluster")
        from redis.cluster import RedisCluster as Client

        rc = Client(host="127.0.0.1", port=c.ports[0])

        def corrupt(k: StoreKey) -> None:
            n = "kvc:" + phys(k).to_str()
            b = bytearray(rc.get(n))
            b[-1] ^= 1
            rc.set(n, bytes(b))

        yield Backend(kind, c.url + "&timeout=0.5", "redis-cluster", corrupt, c.stop)
        rc.close()
        return
    srv = request.getfixturevalue("s3_server")
    cl = srv.client()

    def corrupt(k: StoreKey) -> None:
        n = "store/" + phys(k).to_str()
        b = bytearray(cl.get_object(Bucket=srv.bucket, Key=n)["Body"].read())
        b[-1] ^= 1
        cl.put_object(Bucket=srv.bucket, Key=n, Body=bytes(b))

    yield Backend(kind, srv.url(timeout="2", retry_interval="0.2", multipart="5M"), "s3", corrupt, srv.stop)


def test_roundtrip_isolation_prefix_ls_rm(backend):
    st = Store.open(backend.url)
    res = st.put(key(1), blob(1), {"layers": 30})
    assert res.ok and res.stored_in == ["memory", backend.tier]
    st.put(key(2, "tenant-b"), blob(2))
    other = Store.open(backend.url)  # another process: empty LRU
    assert other.get(key(1)) == blob(1) and other.get_meta(key(1)) == {"layers": 30}
    assert other.get(key(1, "tenant-b")) is None, "namespaces must not share entries"
    assert other.get(key(3)) is None
    assert other.contains_many([key(3), key(1), key(2, "tenant-b")]) == [False, True, True]
    assert other.longest_prefix(list(range(1, 257)) + [7] * 50, model="m", codec="c") == (key(1), 256)
    rows = other.ls(with_meta=True)
    assert {r.key for r in rows} == {key(1), key(2, "tenant-b")}
    assert {r.key: r.size for r in rows} == {key(1): len(blob(1)), key(2, "tenant-b"): len(blob(2))}
    assert [r.meta for r in other.ls(with_meta=True, namespace="default")] == [{"layers": 30}]
    tier = {t["name"]: t for t in other.stats()["tiers"]}[backend.tier]
    assert tier["entries"] == 2 and tier["hits"] >= 1 and tier["available"]
    assert other.rm(key(1)) is True and Store.open(backend.url).get(key(1)) is None
    assert other.rm(key(1)) is False


def test_damaged_value_is_a_miss(backend):
    st = Store.open(backend.url)
    st.put(key(5), blob(5))
    backend.corrupt(key(5))
    fresh = Store.open(backend.url)
    assert fresh.get(key(5)) is None
    assert {t["name"]: t for t in fresh.stats()["tiers"]}[backend.tier]["corrupt"] == 1


def test_large_entry_and_ranged_reads(backend):
    data = os.urandom(6 << 20)  # above the S3 backend's 5M multipart threshold: uploaded in parts
    st = Store.open(backend.url, memory_bytes=0)
    assert st.put(key(7), data, {"big": True}).ok
    fresh = Store.open(backend.url, memory_bytes=0)
    assert fresh.get(key(7)) == data
    rd = fresh.reader(key(7))
    assert rd is not None and rd.size == len(data)
    for off, n in ((0, 100), (len(data) - 4096, 4096), (3 << 20, 1 << 20)):
        assert rd.read(off, n) == data[off:off + n]
    rd.close()


def test_concurrent_writers_atomic_visibility(backend):
    """Writers race on one key with different payloads; every read is one whole payload or a miss."""
    versions = [blob(i, 200_000) for i in range(4)]
    stop = threading.Event()
    bad: list[str] = []

    def write(v: bytes) -> None:
        st = Store.open(backend.url, memory_bytes=0)
        for _ in range(5):
            st.put(key(9), v)

    def read() -> None:
        st = Store.open(backend.url, memory_bytes=0)
        while not stop.is_set():
            got = st.get(key(9))
            if got is not None and got not in versions:
                bad.append(f"read {len(got)} bytes matching no written version")

    readers = [threading.Thread(target=read) for _ in range(2)]
    writers = [threading.Thread(target=write, args=(v,)) for v in versions]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in readers:
        t.join()
    assert not bad, bad[:3]
    assert Store.open(backend.url).get(key(9)) in versions


def test_outage_is_a_clean_miss(backend, tmp_path):
    url = f"{tmp_path}/local,{backend.url}"
    st = Store.open(url)
    st.put(key(1), blob(1))
    Store.open(backend.url).put(key(2), blob(2))  # only the remote tier has it
    backend.stop()
    st.memory.clear()
    assert st.get(key(1)) == blob(1)                # from the directory tier
    assert st.get(key(2)) is None                   # remote down: a miss, not an exception
    assert st.contains_many([key(1), key(2)]) == [True, False]
    res = st.put(key(3), blob(3))
    assert not res.ok and backend.tier in res.failed and res.tiers["directory"] == "ok"
    with pytest.raises(KvcStoreError):
        Store.open(backend.url).put(key(4), blob(4))  # no persistent tier took it: an error, not a silent loss
