"""A tenant's bytes over all its namespaces on a directory tier are bounded (tenant_bytes), and so is how many
namespaces it makes (tenant_namespaces): one tenant cannot starve another of disk through the KDN, whose
clients' physical keys name any namespace tag they like (each tag was a partition with a cap of its own)."""

from __future__ import annotations

import os
import threading

import pytest

from kvcodec.errors import KvcInputError, KvcQuotaError, KvcStoreError
from kvcodec.store import Store, StoreKey, TenantKey
from kvcodec.store.tenant import PHYS_CODEC, PHYS_MODEL
from kvcodec.store.tiers.directory import DirectoryTier

SERVER = TenantKey(b"S" * 32, "server")
A = TenantKey(b"A" * 32, "tenant-a")
B = TenantKey(b"B" * 32, "tenant-b")
CAP = 64 << 10


def client_key(i: int, tag: str) -> StoreKey:
    """What a KDN client sends: a physical key whose namespace (its own tag) the service cannot check."""
    return StoreKey(PHYS_MODEL, PHYS_CODEC, tag, 0, f"{i:064x}")


def view(url: str, tenant: TenantKey) -> Store:
    """A tenant's view of the backing store, as KdnService.store_for builds it."""
    return Store.open(url, key=SERVER, memory_bytes=0).for_key(tenant)


def test_through_the_services_own_tenant_views(tmp_path):
    """The path a KDN PUT takes (KdnService.store_for, then Store.put of the client's physical key)."""
    from kvcodec.service.app import KdnService
    from kvcodec.service.auth import Principal, TokenTable

    p = Principal("a", ("default",))
    svc = KdnService(Store.open(f"{tmp_path}/s?fsync=0&max_bytes=64K", key=SERVER, memory_bytes=0),
                     TokenTable({"0" * 64: p}))
    st = svc.store_for(p)
    keys = [client_key(i, f"tag{i}") for i in range(40)]
    for k in keys:
        st.put(k, os.urandom(8000), {})
    assert tenant_bytes(st, keys) <= CAP  # was 339 kB: 40 partitions of a 64K cap each


def tenant_bytes(st: Store, keys: list[StoreKey]) -> int:
    d: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    return sum(os.path.getsize(p) for p in (d.path_for(st.physical(k)) for k in keys) if os.path.exists(p))


def test_a_tenant_spreading_entries_over_many_namespaces_stays_within_its_quota(tmp_path):
    url = f"file://{tmp_path}/s?fsync=0&max_bytes=64K"
    a = view(url, A)
    keys = [client_key(i, f"tag{i}") for i in range(40)]  # 40 namespaces, each far under the partition cap
    for k in keys:
        a.put(k, os.urandom(8000), {})
        assert a.get(k) is not None, "a put must never evict the entry it wrote"
    assert tenant_bytes(a, keys) <= CAP  # was 5x the cap: each namespace had a cap of its own
    assert a.tier("directory").stats()["evictions"] > 0
    assert a.get(keys[-1]) is not None and a.get(keys[0]) is None  # its own least recently used went first


def test_another_tenants_entries_are_untouched_while_one_hits_its_quota(tmp_path):
    url = f"file://{tmp_path}/s?fsync=0&max_bytes=64K&tenant_namespaces=16"
    b = view(url, B)
    bkeys = [client_key(i, "b-tag") for i in range(6)]
    blobs = [os.urandom(8000) for _ in bkeys]
    for k, v in zip(bkeys, blobs):
        b.put(k, v, {})
    d: DirectoryTier = b.tier("directory")  # type: ignore[assignment]
    before = {k: os.stat(d.path_for(b.physical(k))) for k in bkeys}
    a = view(url, A)
    akeys = [client_key(i, f"tag{i % 16}") for i in range(60)]
    for k in akeys:
        a.put(k, os.urandom(8000), {})
    with pytest.raises(KvcStoreError, match="tenant_namespaces=16"):  # a 17th namespace of A's is refused
        a.put(client_key(99, "tag-17"), b"x", {})
    assert tenant_bytes(a, akeys) <= CAP
    for k, v in zip(bkeys, blobs):
        st = os.stat(d.path_for(b.physical(k)))
        assert (st.st_ino, st.st_mtime) == (before[k].st_ino, before[k].st_mtime), "A's quota touched B's entry"
        assert b.get(k) == v
    b.put(client_key(7, "b-tag-2"), b"y", {})  # B's own namespaces are B's to make


def test_the_quota_holds_across_a_restart_and_concurrent_puts(tmp_path):
    url = f"file://{tmp_path}/s?fsync=0&max_bytes=64K&tenant_namespaces=8"
    a = view(url, A)
    for i in range(8):
        a.put(client_key(i, f"tag{i}"), os.urandom(4000), {})
    a = view(url, A)  # another process, or the service restarted: the owners are on disk
    with pytest.raises(KvcStoreError, match="already has 8 namespaces"):
        a.put(client_key(9, "tag-new"), b"x", {})
    keys = [client_key(100 + i, f"tag{i % 8}") for i in range(64)]

    def put(part: list[StoreKey]) -> None:
        for k in part:
            a.put(k, os.urandom(6000), {})

    threads = [threading.Thread(target=put, args=(keys[j::4],)) for j in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tenant_bytes(a, keys + [client_key(i, f"tag{i}") for i in range(8)]) <= CAP


def test_quota_options_are_checked_in_one_line(tmp_path):
    with pytest.raises(KvcInputError, match="tenant_namespaces"):
        Store.open(f"file://{tmp_path}/s?tenant_namespaces=0", key=A)
    with pytest.raises(KvcInputError, match="tenant_namespaces"):
        Store.open(f"file://{tmp_path}/s?tenant_namespaces=lots", key=A)
    with pytest.raises(KvcInputError, match="bad size"):
        Store.open(f"file://{tmp_path}/s?tenant_bytes=-1", key=A)
    st = Store.open(f"file://{tmp_path}/s?max_bytes=1M&tenant_bytes=4M", key=A).tier("directory").stats()
    assert (st["max_bytes"], st["tenant_bytes"], st["tenant_namespaces"]) == (1 << 20, 4 << 20, 1024)
    big = Store.open(f"file://{tmp_path}/t?fsync=0&max_bytes=1M&tenant_bytes=16K", key=A, memory_bytes=0)
    with pytest.raises(KvcStoreError, match="larger than a tenant's quota"):
        big.put(StoreKey.for_tokens([1, 2, 3], model="m", codec="c"), os.urandom(20000))


def test_an_uncapped_directory_still_bounds_a_tenants_namespaces(tmp_path):
    """With no max_bytes a directory tier had no quota at all: tenant_namespaces went unenforced, so a KDN
    client naming a new namespace tag per put made partitions (directories, locks, counters) without end."""
    a = view(f"file://{tmp_path}/s?fsync=0&tenant_namespaces=4", A)
    for i in range(4):
        a.put(client_key(i, f"tag{i}"), b"x" * 100, {})
    with pytest.raises(KvcQuotaError, match="tenant_namespaces=4"):
        a.put(client_key(4, "tag4"), b"x" * 100, {})
    assert a.tier("directory").stats()["tenant_bytes"] is None  # no byte bound was asked for


def test_a_service_over_an_uncapped_directory_shares_the_free_disk_between_its_tenants(tmp_path, monkeypatch):
    """kvc serve's default store is an uncapped directory: one tenant could fill the disk under the others.
    Each of n tenants now holds at most 1/n of the space free when the service starts."""
    from collections import namedtuple

    from kvcodec.service.app import KdnService
    from kvcodec.service.auth import Principal, TokenTable
    from kvcodec.store.tiers import directory

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(directory.shutil, "disk_usage", lambda p: usage(1 << 30, 0, 2 * CAP))
    pa, pb = Principal("a", ("default",)), Principal("b", ("default",))
    svc = KdnService(Store.open(f"{tmp_path}/s?fsync=0", key=SERVER, memory_bytes=0),
                     TokenTable({"0" * 64: pa, "1" * 64: pb}))
    a, b = svc.store_for(pa), svc.store_for(pb)
    bkey = client_key(999, "btag")
    b.put(bkey, os.urandom(8000), {})
    bpath = b.tier("directory").path_for(b.physical(bkey))
    before = os.stat(bpath)
    keys = [client_key(i, f"tag{i}") for i in range(40)]
    for k in keys:
        a.put(k, os.urandom(8000), {})
    assert a.tier("directory").stats()["tenant_bytes"] == CAP
    assert tenant_bytes(a, keys) <= CAP  # was 330 kB: nothing bounded a tenant on an uncapped directory
    st = os.stat(bpath)
    assert (st.st_ino, st.st_mtime) == (before.st_ino, before.st_mtime), "A's share touched B's entry"
    # one tenant starves nobody: no share is set
    one = KdnService(Store.open(f"{tmp_path}/t?fsync=0", key=SERVER, memory_bytes=0), TokenTable({"0" * 64: pa}))
    assert one.store.tier("directory").stats()["tenant_bytes"] is None
    # a tenant_bytes in the URL is the operator's choice and stays
    set_ = KdnService(Store.open(f"{tmp_path}/u?fsync=0&tenant_bytes=1M", key=SERVER, memory_bytes=0),
                      TokenTable({"0" * 64: pa, "1" * 64: pb}))
    assert set_.store.tier("directory").stats()["tenant_bytes"] == 1 << 20
