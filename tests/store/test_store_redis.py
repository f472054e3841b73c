"""Redis tier against a real redis-server on a random loopback port, including an outage."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvcodec.errors import KvcInputError, KvcStoreError
from kvcodec.store import Store, StoreKey
from store_fixtures import RedisServer, find_binary, redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.requires_redis


def key(i: int, ns: str = "default") -> StoreKey:
    return StoreKey.for_tokens(list(range(i, i + 300)), model="m", codec="c", namespace=ns)


def blob(i: int, n: int = 50_000) -> bytes:
    return bytes((i * 7 + j) & 0xFF for j in range(n))


def test_redis_roundtrip_ls_rm_stats(redis_server):  # noqa: F811
    url = redis_server.url + "?timeout=1"
    st = Store.open(url)
    r = st.put(key(1), blob(1), {"layers": 30})
    assert r.ok and r.stored_in == ["memory", "redis"]
    st.put(key(2, "tenant-b"), blob(2))
    other = Store.open(url)  # another process: nothing in its LRU
    assert other.get(key(1)) == blob(1) and other.get_meta(key(1)) == {"layers": 30}
    assert other.get(key(1, "tenant-b")) is None, "namespaces must not share entries"
    rows = other.ls(with_meta=True)
    assert {r.key for r in rows} == {key(1), key(2, "tenant-b")}
    assert {r.size for r in rows} == {len(blob(1)), len(blob(2))}
    assert other.ls(namespace="tenant-b", with_meta=True)[0].meta == {}
    red = {t["name"]: t for t in other.stats()["tiers"]}["redis"]
    assert red["entries"] == 2 and red["available"] and red["hits"] >= 1
    assert other.longest_prefix(list(range(1, 301)), model="m", codec="c") == (key(1), 300)
    assert other.rm(key(1)) and st.tier("redis").get(key(1)) is None
    # a value damaged inside Redis is a miss, and is deleted
    rt = st.tier("redis")
    name = rt.rkey(st.physical(key(2, "tenant-b")))
    raw = bytearray(rt.r.get(name))
    raw[-1] ^= 1
    rt.r.set(name, bytes(raw))
    assert Store.open(url).get(key(2, "tenant-b")) is None
    assert rt.r.get(name) is None


def test_redis_outage_falls_back_and_recovers(redis_server, tmp_path, caplog):  # noqa: F811
    url = f"{tmp_path}/local,{redis_server.url}?timeout=0.5&retry_interval=0.2"
    st = Store.open(url)
    assert st.put(key(1), blob(1)).stored_in == ["memory", "directory", "redis"]
    # an entry only Redis has (e.g. written by another host)
    Store.open(redis_server.url).put(key(9), blob(9))

    redis_server.stop()
    st.memory.clear()
    caplog.clear()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
        for _ in range(5):
            assert st.get(key(1)) == blob(1)          # served by the directory tier
            st.memory.clear()
        assert st.get(key(9)) is None                  # only Redis had it: a miss, not an exception
        res = st.put(key(2), blob(2))                  # write: local ok, Redis failure reported
        assert not res.ok and "redis" in res.failed and res.tiers["directory"] == "ok"
        assert "unreachable" in res.failed["redis"]
        assert st.contains(key(2)) and not st.contains(key(9))
        assert st.longest_prefix(list(range(2, 302)), model="m", codec="c")[1] == 300
        with pytest.raises(KvcStoreError, match="redis"):
            st.rm(key(1))                              # rm cannot be complete: says so
        rows = st.ls()
    elapsed = time.monotonic() - t0
    warns = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert len(warns) == 1, [r.getMessage() for r in caplog.records]
    assert elapsed < 5, f"a down Redis must not stall the store ({elapsed:.1f} s)"
    red = {t["name"]: t for t in st.stats()["tiers"]}["redis"]
    assert red["available"] is False and red["put_errors"] >= 1 and red["errors"] >= 1
    assert red["entries"] is None and "unreachable" in red["error"]
    assert os.path.exists(st.tier("directory").path_for(st.physical(key(2))))
    assert key(2) in {r.key for r in rows}

    redis_server.start()  # same port, empty (no persistence)
    time.sleep(0.3)       # > retry_interval
    with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
        res = st.put(key(3), blob(3))
    assert res.ok, res.tiers
    assert any("reachable again" in r.getMessage() for r in caplog.records)
    assert Store.open(redis_server.url).get(key(3)) == blob(3)
    assert {t["name"]: t for t in st.stats()["tiers"]}["redis"]["available"] is True


def test_redis_down_at_open_and_password(tmp_path):
    binary = find_binary("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found")
    srv = RedisServer(binary, tmp_path, password="s3cret")
    # nothing listening yet: opening works, the put is reported, local copy kept
    st = Store.open(f"{tmp_path}/local,{srv.url}?timeout=0.3&retry_interval=0")
    res = st.put(key(1), blob(1))
    assert not res.ok and res.tiers["directory"] == "ok"
    assert "s3cret" not in str(st.stats()) and "***" in st.tier("redis").url
    srv.start()
    try:
        assert st.put(key(1), blob(1)).ok
        bad = Store.open(f"redis://:wrong@127.0.0.1:{srv.port}/0?timeout=0.3", memory_bytes=0)
        with pytest.raises(KvcStoreError):
            bad.put(key(1), blob(1))
        assert bad.get(key(1)) is None
    finally:
        srv.stop()
    # Redis only, and down: nothing persistent took the entry -> an error, not a silent loss
    only = Store.open(f"{srv.url}?timeout=0.3")
    with pytest.raises(KvcStoreError, match="every persistent tier"):
        only.put(key(5), blob(5))


def test_redis_url_validation():
    for bad in ["redis://127.0.0.1:1/0?timeout=abc", "redis://127.0.0.1:1/0?prefix=a*",
                "redis://127.0.0.1:1/0?timeout=nan", "redis://127.0.0.1:1/0?timeout=\u0662",
                "redis://127.0.0.1:1/0?ttl=\u0663", "redis://127.0.0.1:1/0?ttl=1.5",
                "redis://127.0.0.1:1/0?retry_interval=inf", "redis://127.0.0.1:\u0661/0",
                "redis://[::1/0"]:
        with pytest.raises(KvcInputError):
            Store.open(bad)


@pytest.mark.parametrize("bad, msg", [
    # redis-py hands an option it does not parse to its connection class: the store opened, and its first call
    # escaped as TypeError (a typo, or an option of rediss:// on redis://) or ValueError (a negative timeout)
    ("redis://127.0.0.1:1/0?max_byts=1G", "unknown redis URL options"),
    ("redis://127.0.0.1:1/0?ssl_cert_reqs=none", "unknown redis URL options"),
    ("redis://127.0.0.1:1/0?socket_timeout=-1", "socket_timeout must be a positive"),
    ("redis://127.0.0.1:1/abc", "database number"),  # redis-py used database 0
])
def test_a_redis_url_option_redis_py_would_choke_on_is_refused_at_open(bad, msg):
    with pytest.raises(KvcInputError, match=msg):
        Store.open(bad)


def test_unix_socket_and_passed_on_options_open():
    """``unix:///path?db=N``, documented, never opened (urlunsplit dropped its //, which redis-py refused); options
    redis-py does take are still passed on."""
    from kvcodec.store import RedisTier

    pool = RedisTier("unix:///tmp/kvc-none.sock?db=2&timeout=0.3").r.connection_pool
    assert pool.connection_kwargs["path"] == "/tmp/kvc-none.sock" and pool.connection_kwargs["db"] == 2
    assert RedisTier("rediss://127.0.0.1:1/0?ssl_cert_reqs=none").r.connection_pool.connection_kwargs["ssl_cert_reqs"] == "none"
    assert RedisTier("redis://127.0.0.1:1/3?client_name=kvc").r.connection_pool.connection_kwargs["db"] == 3


def test_redis_outage_goes_through_the_one_guard(caplog):
    """The Redis tier's outage handling is kvcodec.store.outage.OutageGuard, with Redis's own wording."""
    from kvcodec.store import RedisTier
    from kvcodec.store.outage import OutageGuard
    from store_fixtures import free_port

    url = f"redis://:pw@127.0.0.1:{free_port()}/0?timeout=0.3&retry_interval=5"
    t = RedisTier(url)
    assert type(t.guard) is OutageGuard and t.guard.what == f"redis {t.url}" and "pw" not in t.url
    k = key(1)
    with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
        with pytest.raises(KvcStoreError, match=r"^redis redis://:\*\*\*@127\.0\.0\.1:\d+/0\?timeout=0\.3&retry_interval=5 "
                                                r"is unreachable \(ConnectionError: .*\); put failed$"):
            t.put(k, b"x")
        with pytest.raises(KvcStoreError, match=r"is unreachable \(ConnectionError: .*\); delete skipped$"):
            t.delete(k)  # inside retry_interval: fails at once, without touching the network
        assert t.get(k) is None and not t.contains(k)
    warns = [r.getMessage() for r in caplog.records]
    assert len(warns) == 1 and warns[0].startswith(f"store: redis {t.url} unreachable (ConnectionError")
    assert warns[0].endswith("serving from other tiers, writes to redis are reported as failed until it returns")
    s = t.stats()
    assert s["available"] is False and s["outages"] == 1 and s["last_error"].startswith("ConnectionError")
