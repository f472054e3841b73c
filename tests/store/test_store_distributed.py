"""Failure and topology tests of the distributed tiers against real servers.

Redis Cluster: a master killed during a run (live masters keep serving, the
dead one's keys are clean misses, writes to it are reported), and a slot
migration (``redis-cli --cluster reshard``) during a run (the client follows
MOVED/ASK; every entry stays readable).  S3: multipart uploads and
conditional (first-writer-wins) puts.
"""

from __future__ import annotations

import threading

from kvcodec.errors import KvcStoreError
from kvcodec.store import Store, StoreKey
from kvcodec.store.tenant import TenantKey
from store_fixtures import redis_cluster, s3_server  # noqa: F401  (fixtures)


def key(i: int, ns: str = "default") -> StoreKey:
    return StoreKey.for_tokens(list(range(i, i + 256)), model="m", codec="c", namespace=ns)


def name(k: StoreKey) -> str:
    """The Redis name of ``k``'s entry (its physical key under this process's tenant key)."""
    return "kvc:" + TenantKey.default().namespace(k.namespace).physical(k).to_str()


def blob(i: int, n: int = 20_000) -> bytes:
    return bytes((i * 11 + j * 5) & 0xFF for j in range(n))


def test_cluster_spreads_entries_and_survives_a_dead_master(redis_cluster, tmp_path):  # noqa: F811
    c = redis_cluster
    st = Store.open(c.url + "&timeout=0.5", memory_bytes=0)
    keys = [key(i) for i in range(30)]
    for i, k in enumerate(keys):
        assert st.put(k, blob(i)).ok
    owner = {k: c.node_of(name(k)) for k in keys}
    assert len(set(owner.values())) == 3, "30 entries should land on all three masters"
    victim = c.ports[1]
    c.kill(victim)
    dead = [k for k in keys if owner[k] == victim]
    live = [k for k in keys if owner[k] != victim]
    # The same tier object keeps serving: live masters hit, the dead one's keys are misses.
    for i, k in enumerate(keys):
        assert st.get(k) == (None if k in dead else blob(i)), k
    assert st.contains_many(keys) == [k in live for k in keys]
    new = [key(100 + i) for i in range(12)]
    stored, refused = [], []
    for k in new:
        try:
            st.put(k, blob(7))  # no local tier: a write to the dead master's slots raises, cleanly
            stored.append(k)
        except KvcStoreError:
            refused.append(k)
    assert stored and all(st.get(k) == blob(7) for k in stored)
    # With a local tier in front, a write whose slot is on the dead master keeps its local copy.
    both = Store.open(f"{tmp_path}/local,{c.url}&timeout=0.5")
    if refused:
        r = both.put(refused[0], blob(8))
        assert r.tiers["directory"] == "ok" and "redis-cluster" in r.failed
    assert {t["name"]: t for t in st.stats()["tiers"]}["redis-cluster"]["errors"] >= 1


def test_cluster_slot_migration_during_reads(redis_cluster):  # noqa: F811
    c = redis_cluster
    st = Store.open(c.url, memory_bytes=0)
    keys = [key(i) for i in range(40)]
    for i, k in enumerate(keys):
        st.put(k, blob(i))
    before = {k: c.node_of(name(k)) for k in keys}
    src = before[keys[0]]
    dst = next(p for p in c.ports if p != src)
    errors: list[str] = []
    misses = [0]
    stop = threading.Event()

    def reader() -> None:
        rd = Store.open(c.url, memory_bytes=0)
        while not stop.is_set():
            for i, k in enumerate(keys):
                got = rd.get(k)
                if got is None:
                    misses[0] += 1
                elif got != blob(i):
                    errors.append(f"wrong bytes for {k}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        c.reshard(src, dst, 4000)  # moves slots (and their keys) while the reader runs
    finally:
        stop.set()
        t.join()
    assert not errors
    assert misses[0] == 0, f"{misses[0]} reads missed during the migration (the client must follow MOVED/ASK)"
    moved = [k for k in keys if c.node_of(name(k)) != before[k]]
    assert moved and all(before[k] == src for k in moved), "the reshard moved entries off the source master"
    after = Store.open(c.url, memory_bytes=0)
    assert all(after.get(k) == blob(i) for i, k in enumerate(keys)), "every entry readable after the migration"
    assert all(st.get(k) == blob(i) for i, k in enumerate(keys)), "a client opened before the migration follows MOVED"


def test_s3_multipart_and_conditional_put(s3_server):  # noqa: F811
    srv = s3_server
    url = srv.url(multipart="5M", part_size="5M")
    st = Store.open(url, memory_bytes=0)
    big = bytes(range(256)) * (45_000)  # 11.5 MB: three parts
    assert st.put(key(1), big).ok
    head = srv.client().head_object(Bucket=srv.bucket, Key="store/" + TenantKey.default().namespace("default").physical(key(1)).to_str())
    assert head["ETag"].strip('"').endswith("-3"), head["ETag"]  # S3's multipart ETag names the part count
    assert Store.open(url, memory_bytes=0).get(key(1)) == big
    # First writer wins: an equal key is an equal prefix, so a second put is a no-op, not a rewrite.
    st.put(key(2), blob(1))
    st.put(key(2), blob(2))
    assert Store.open(url, memory_bytes=0).get(key(2)) == blob(1)
    # Without conditional writes, the last writer wins.
    plain = Store.open(srv.url(prefix="plain", conditional="0"), memory_bytes=0)
    plain.put(key(2), blob(1))
    plain.put(key(2), blob(2))
    assert plain.get(key(2)) == blob(2)
    # No multipart upload is left behind.
    assert not srv.client().list_multipart_uploads(Bucket=srv.bucket).get("Uploads")


def test_s3_multipart_zero_sends_every_entry_in_parts(s3_server):  # noqa: F811
    """multipart=0 is a meaning, not a mistake: every envelope, however small, is one multipart upload (a single
    last part may be of any size), and reads it back whole."""
    srv = s3_server
    st = Store.open(srv.url(prefix="mp0", multipart="0"), memory_bytes=0)
    assert st.put(key(3), blob(3)).ok
    name = "mp0/" + TenantKey.default().namespace("default").physical(key(3)).to_str()
    assert srv.client().head_object(Bucket=srv.bucket, Key=name)["ETag"].strip('"').endswith("-1")
    assert Store.open(srv.url(prefix="mp0"), memory_bytes=0).get(key(3)) == blob(3)
