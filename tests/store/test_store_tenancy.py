"""Tenant isolation on every tier: A cannot list, read, delete, quarantine or evict B's entries,
and forged or tampered entries on a shared tier are refused (a miss plus a warning), never copied.

The attacker model of spec/store-keys.md §10: tenants hold different
:class:`TenantKey` secrets; a *writer to the shared tier* can put arbitrary
bytes (re-enveloped with a valid CRC) under any name.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat

import pytest

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store import MemoryTier, Store, StoreKey, TenantKey
from kvcodec.store.tiers.directory import DirectoryTier
from kvcodec.store.tiers.base import decode_envelope, encode_envelope
from store_fixtures import nginx_server, redis_server, s3_server  # noqa: F401  (fixtures)

A = TenantKey(b"A" * 32, "tenant-a")
B = TenantKey(b"B" * 32, "tenant-b")
C = TenantKey(b"C" * 32, "attacker")


def key(i: int, ns: str = "default", n: int = 300) -> StoreKey:
    return StoreKey.for_tokens(list(range(i, i + n)), model="m", codec="c", namespace=ns)


def blob(i: int, n: int = 5000) -> bytes:
    return bytes((i * 13 + j * 7) & 0xFF for j in range(n))


def reenvelope(raw: bytes, *, data: bytes | None = None, meta: dict | None = None,
               key: StoreKey | None = None) -> bytes:
    """What a writer to the shared tier can do: new bytes, a valid envelope CRC."""
    e = decode_envelope(raw)
    return encode_envelope(key or e.key, e.data if data is None else data, e.meta if meta is None else meta)


# -- the directory tier: the original bug ----------------------------------------------------

def test_mismatched_read_never_quarantines_the_owners_entry(tmp_path, caplog):
    """Issue 14: a read with another namespace's or token count's key destroyed the entry."""
    root = tmp_path / "s"
    b = Store.open(str(root), key=B)
    kb = key(1, "tenant-b")
    b.put(kb, blob(1))
    phys = b.physical(kb)
    tier = DirectoryTier(root)
    path = tier.path_for(phys)
    # the same file name, another key in the header: the old code quarantined here
    for odd in (StoreKey(phys.model, phys.codec, phys.namespace, 5, phys.digest),
                StoreKey("other", phys.codec, phys.namespace, 0, phys.digest)):
        if tier.path_for(odd) == path:
            with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
                assert tier.get(odd) is None
            assert "treated as a miss" in caplog.text
    assert tier.range_entry(StoreKey(phys.model, phys.codec, phys.namespace, 7, phys.digest)) is None
    # a Store reading B's logical key with another namespace or token count: plain misses
    a = Store.open(str(root), key=A)
    for k in (kb, key(1, "default"), StoreKey(kb.model, kb.codec, kb.namespace, 299, kb.digest),
              StoreKey(kb.model, kb.codec, "tenant-a", kb.n_tokens, kb.digest)):
        assert a.get(k) is None and a.reader(k) is None
    assert os.path.exists(path) and not os.listdir(root / "quarantine")
    assert tier.stats()["corrupt"] == 0
    b.memory.clear()
    assert b.get(kb) == blob(1)


# -- every tier ---------------------------------------------------------------------------------

def _cross_tenant(a: Store, b: Store, a_local: Store | None = None) -> None:
    """The common checks: ``a`` and ``b`` share persistent tiers, hold different keys."""
    kb = key(1, "tenant-b")
    shared = key(2, "default")          # the same logical key, written by both
    assert b.put(kb, blob(1), {"owner": "b"}).ok
    assert b.put(shared, blob(2), {"owner": "b"}).ok
    assert a.put(shared, blob(3), {"owner": "a"}).ok
    # name / read
    for st in (a, a_local) if a_local else (a,):
        st.memory.clear()
        assert st.get(kb) is None and not st.contains(kb) and st.reader(kb) is None
        assert st.get(shared) == blob(3) and st.get_meta(shared) == {"owner": "a"}
        assert st.longest_prefix(list(range(1, 301)), model="m", codec="c", namespace="tenant-b") == (None, 0)
    b.memory.clear()
    assert b.get(shared) == blob(2) and b.get(kb) == blob(1)
    # list
    assert [r.key for r in a.ls()] == [shared]
    assert {r.key for r in b.ls()} == {kb, shared}
    assert a.ls(namespace="tenant-b") == []
    own = [t for t in a.stats()["tiers"] if t["kind"] in ("directory", "redis")]
    assert own and all(t["entries"] == 1 for t in own)
    # delete
    assert a.rm(kb) is False
    assert a.rm(shared) is True
    b.memory.clear()
    assert b.get(shared) == blob(2) and b.get(kb) == blob(1)
    # gc verifies only the caller's entries and touches no one else's
    a.put(key(3), blob(4))
    res = a.gc(grace_s=0)
    assert any(r.get("auth_checked") == 1 for r in res.values() if isinstance(r, dict))
    b.memory.clear()
    assert b.get(kb) == blob(1) and b.get(shared) == blob(2)
    assert {r.key for r in b.ls()} == {kb, shared}


def test_memory_tier_cross_tenant():
    mem = MemoryTier(1 << 20)
    a, b = Store([mem], key=A), Store([mem], key=B)
    kb = key(1, "tenant-b")
    b.put(kb, blob(1))
    assert a.get(kb) is None and a.ls() == [] and a.rm(kb) is False
    assert b.get(kb) == blob(1) and [r.key for r in b.ls()] == [kb]
    # the LRU never returns another tenant's entry, even under the same logical key
    a.put(kb, blob(9))
    assert a.get(kb) == blob(9) and b.get(kb) == blob(1)


def test_for_key_shares_tiers_not_the_lru(tmp_path):
    a = Store.open(f"file://{tmp_path}/s?fsync=0", key=A, memory_bytes=10_000)
    b = a.for_key(B)
    assert b.tiers[1] is a.tiers[1] and b.memory is not a.memory and b.memory.max_bytes == 10_000
    _cross_tenant(a, b)


def test_for_key_without_a_tenant_key_is_refused(tmp_path, monkeypatch):
    """for_key(None) made a Store that fell back to this process's default key: a service whose tenant lookup
    came back empty acted as its owner, over the owner's entries."""
    monkeypatch.setenv("KVC_STORE_KEY", "ab" * 32)
    owner = Store.open(f"file://{tmp_path}/s?fsync=0")
    owner.put(key(1), blob(1))
    for bad in (None, "ab" * 32, b"x" * 32):
        with pytest.raises(KvcInputError, match="TenantKey"):
            owner.for_key(bad)  # type: ignore[arg-type]


def test_gc_grace_period_is_a_number_of_seconds(tmp_path):
    """gc(grace_s="x") escaped as TypeError at the first temp file, NaN kept every temp file for ever."""
    st = Store.open(f"file://{tmp_path}/s?fsync=0", key=A)
    st.put(key(1), blob(1))
    part = next(p for p in (tmp_path / "s" / "objects").iterdir())
    (part / "00").mkdir(exist_ok=True)
    (part / "00" / ".x.1.abc.tmp").write_bytes(b"half")
    for bad in ("x", float("nan"), -1, True, None, float("inf")):
        with pytest.raises(KvcInputError, match="grace period"):
            st.gc(grace_s=bad)  # type: ignore[arg-type]
    assert st.gc(grace_s=0)["directory"]["tmp_removed"] == 1


def test_directory_cross_tenant(tmp_path):
    url = f"file://{tmp_path}/s?fsync=0"
    _cross_tenant(Store.open(url, key=A), Store.open(url, key=B))
    assert not os.listdir(tmp_path / "s" / "quarantine")


def test_directory_cap_is_per_tenant_and_never_evicts_the_new_entry(tmp_path):
    url = f"file://{tmp_path}/s?fsync=0&max_bytes=64K"
    b = Store.open(url, key=B, memory_bytes=0)
    for i in range(5):
        b.put(key(i, "tenant-b"), blob(i, 8000))
    a = Store.open(url, key=A, memory_bytes=0)
    for i in range(40):                                   # A floods far past the cap
        a.put(key(100 + i), blob(i, 8000))
        assert a.get(key(100 + i)) == blob(i, 8000), "a put must never evict the entry it wrote"
    assert all(b.get(key(i, "tenant-b")) == blob(i, 8000) for i in range(5)), "A evicted B's entries"
    da: DirectoryTier = a.tier("directory")  # type: ignore[assignment]
    assert da.stats()["evictions"] > 0
    own_bytes = sum(os.path.getsize(da.path_for(a.physical(r.key))) for r in a.ls())
    assert own_bytes <= 64 << 10
    # an entry larger than the cap: refused with a clear error, nothing else is evicted
    before = {r.key for r in a.ls()}
    with pytest.raises(KvcStoreError, match="larger than the tier's cap"):
        a.put(key(999), blob(1, 100_000))
    assert {r.key for r in a.ls()} == before
    assert all(b.get(key(i, "tenant-b")) == blob(i, 8000) for i in range(5))


@pytest.mark.requires_redis
def test_redis_cross_tenant(redis_server, tmp_path):  # noqa: F811
    a = Store.open(redis_server.url, key=A)
    b = Store.open(redis_server.url, key=B)
    a_local = Store.open(f"{tmp_path}/a-local,{redis_server.url}", key=A)
    _cross_tenant(a, b, a_local)
    # no Redis name reveals a namespace, model or token count
    names = [n.decode() for n in a.tier("redis").r.keys("*")]
    assert names and not any("tenant-b" in n or ":m:c:" in n for n in names)


@pytest.mark.requires_nginx
def test_http_cross_tenant(nginx_server, tmp_path):  # noqa: F811
    src_a = Store.open(f"file://{tmp_path}/src?fsync=0", key=A)
    src_b = Store.open(f"file://{tmp_path}/src?fsync=0", key=B)
    kb, ka = key(1, "tenant-b"), key(2)
    src_b.put(kb, blob(1))
    src_a.put(ka, blob(2))
    shutil.copytree(tmp_path / "src", nginx_server.root / "pub")
    base = nginx_server.base + "pub/"
    a = Store.open(f"{tmp_path}/a-local,{base}", key=A)
    b = Store.open(base, key=B)
    assert b.get(kb) == blob(1) and a.get(kb) is None and a.reader(kb) is None and not a.contains(kb)
    assert a.get(ka) == blob(2) and b.get(ka) is None
    with pytest.raises(KvcStoreError):
        a.tier("http").delete(b.physical(kb))
    assert a.rm(kb) is False and b.get(kb) == blob(1)


# -- forged and tampered entries on shared tiers -------------------------------------------------

def _attacks(raw_a: bytes, raw_b: bytes, phys_a: StoreKey) -> dict[str, bytes]:
    """Envelopes a shared-tier writer can plant at A's physical name (all with valid CRCs)."""
    e = decode_envelope(raw_a)
    forged_seal = C.namespace("default").seal(
        StoreKey.from_str(e.meta["key"]), blob(66), {"owner": "a"})
    return {
        "payload changed": reenvelope(raw_a, data=bytes([raw_a[-1] ^ 1]) + e.data[1:]),
        "payload replaced whole": reenvelope(raw_a, data=blob(77, len(e.data))),
        "meta changed": reenvelope(raw_a, meta={**e.meta, "meta": {"owner": "mallory"}}),
        "seal from another key": reenvelope(raw_a, data=blob(66), meta=forged_seal),
        "B's entry moved here": reenvelope(raw_b, key=phys_a),
        "seal stripped": reenvelope(raw_a, meta={"key": e.meta["key"]}),
    }


def test_tampered_directory_entries_are_refused_and_never_back_filled(tmp_path, caplog):
    shared = f"file://{tmp_path}/shared?fsync=0"
    a_writer, b_writer = Store.open(shared, key=A), Store.open(shared, key=B)
    ka, kb = key(5), key(6, "tenant-b")
    a_writer.put(ka, blob(5))
    b_writer.put(kb, blob(6))
    tier = DirectoryTier(tmp_path / "shared")
    pa, pb = a_writer.physical(ka), b_writer.physical(kb)
    raw_a, raw_b = open(tier.path_for(pa), "rb").read(), open(tier.path_for(pb), "rb").read()
    for what, bad in _attacks(raw_a, raw_b, pa).items():
        with open(tier.path_for(pa), "wb") as f:
            f.write(bad)
        a = Store.open(f"{tmp_path}/a-local,{shared}", key=A)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
            assert a.get(ka) is None, what
            rd = a.reader(ka)
            if rd is not None:  # header intact, payload changed: caught block by block
                with pytest.raises(KvcFormatError, match="sealed hash"):
                    rd.read(0, rd.size)
        assert "refused" in caplog.text, what
        assert a.rejected >= 1, what
        assert not a.tier("directory").contains(pa) and not a.memory.contains(pa), f"{what}: copied"
        assert not os.listdir(tmp_path / "a-local" / "quarantine")
        assert os.path.exists(tier.path_for(pa)), f"{what}: a read modified the shared tier"
    # A's gc removes the forged entry at A's own name; B's entry is untouched
    res = Store.open(shared, key=A).gc(grace_s=0)
    assert res["directory"]["auth_removed"] == 1 and not os.path.exists(tier.path_for(pa))
    assert Store.open(shared, key=B).get(kb) == blob(6)


def test_range_reads_verify_every_block(tmp_path):
    st = Store.open(f"file://{tmp_path}/s?fsync=0", key=A, memory_bytes=0)
    data = os.urandom(3 * (1 << 20) + 123)
    st.put(key(1), data)
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    p = tier.path_for(st.physical(key(1)))
    raw = open(p, "rb").read()
    e = decode_envelope(raw)
    bad = bytearray(e.data)
    bad[(1 << 20) + 5] ^= 0x10                             # block 1 only
    with open(p, "wb") as f:
        f.write(reenvelope(raw, data=bytes(bad)))
    with st.reader(key(1)) as r:
        assert r.read(10, 1000) == data[10:1010]          # block 0 is intact
        assert r.read(2 << 20, 1000) == data[2 << 20:(2 << 20) + 1000]
        with pytest.raises(KvcFormatError, match="block 1"):
            r.read((1 << 20) - 10, 20)                    # touches block 1
    assert st.get(key(1)) is None


@pytest.mark.requires_redis
def test_tampered_redis_entries_are_refused_and_never_back_filled(redis_server, tmp_path, caplog):  # noqa: F811
    a_writer, b_writer = Store.open(redis_server.url, key=A), Store.open(redis_server.url, key=B)
    ka, kb = key(5), key(6, "tenant-b")
    a_writer.put(ka, blob(5))
    b_writer.put(kb, blob(6))
    rt = a_writer.tier("redis")
    na, nb = rt.rkey(a_writer.physical(ka)), rt.rkey(b_writer.physical(kb))
    raw_a, raw_b = rt.r.get(na), rt.r.get(nb)
    for what, bad in _attacks(raw_a, raw_b, a_writer.physical(ka)).items():
        rt.r.set(na, bad)
        a = Store.open(f"{tmp_path}/a-local,{redis_server.url}", key=A)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
            assert a.get(ka) is None, what
            assert a.reader(ka) is None, what
        assert "refused" in caplog.text, what
        pa = a.physical(ka)
        assert not a.tier("directory").contains(pa) and not a.memory.contains(pa), f"{what}: copied"
        assert rt.r.get(na) == bad, f"{what}: a read modified the shared tier"
    assert Store.open(redis_server.url, key=B).get(kb) == blob(6)


@pytest.mark.requires_nginx
def test_tampered_http_entries_are_refused_and_never_back_filled(nginx_server, tmp_path):  # noqa: F811
    src = Store.open(f"file://{tmp_path}/src?fsync=0", key=A)
    src_b = Store.open(f"file://{tmp_path}/src?fsync=0", key=B)
    ka, kb = key(5), key(6, "tenant-b")
    src.put(ka, os.urandom(2 * (1 << 20) + 7))
    src_b.put(kb, blob(6))
    shutil.copytree(tmp_path / "src", nginx_server.root / "pub")
    tier = DirectoryTier(nginx_server.root / "pub")
    pa, pb = src.physical(ka), src_b.physical(kb)
    raw_a, raw_b = open(tier.path_for(pa), "rb").read(), open(tier.path_for(pb), "rb").read()
    for what, bad in _attacks(raw_a, raw_b, pa).items():
        with open(tier.path_for(pa), "wb") as f:
            f.write(bad)
        a = Store.open(f"{tmp_path}/a-local,{nginx_server.base}pub/", key=A)
        assert a.get(ka) is None, what
        rd = a.reader(ka)
        if rd is not None:
            with pytest.raises(KvcFormatError):
                rd.read(0, rd.size)
        assert a.rejected >= 1, what
        assert not a.tier("directory").contains(pa) and not a.memory.contains(pa), f"{what}: copied"


# -- credentials -----------------------------------------------------------------------------------

def test_key_provisioning(tmp_path, monkeypatch):
    monkeypatch.delenv("KVC_STORE_KEY", raising=False)
    monkeypatch.delenv("KVC_STORE_KEY_FILE", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "cfg"))
    k1 = TenantKey.default()                              # created once, 0600
    p = tmp_path / "cfg" / "kvcodec" / "store.key"
    assert p.is_file() and stat.S_IMODE(p.stat().st_mode) == 0o600
    assert TenantKey.default().id == k1.id                # and reused
    kf = tmp_path / "team.key"
    k2 = TenantKey.generate(kf)
    with pytest.raises(KvcInputError, match="refusing to replace"):
        TenantKey.generate(kf)
    monkeypatch.setenv("KVC_STORE_KEY_FILE", str(kf))
    assert TenantKey.default().id == k2.id != k1.id
    monkeypatch.setenv("KVC_STORE_KEY", "ab" * 32)
    assert TenantKey.default().id == TenantKey(bytes.fromhex("ab" * 32)).id
    monkeypatch.setenv("KVC_STORE_KEY", "not hex")
    with pytest.raises(KvcInputError):
        TenantKey.default()
    os.chmod(kf, 0o666)
    with pytest.raises(KvcInputError, match="writable by group or others"):
        TenantKey.load(kf)
    os.chmod(kf, 0o644)  # was taken: any local user could read this tenant's entries, and forge them
    with pytest.raises(KvcInputError, match="readable by others"):
        TenantKey.load(kf)
    os.chmod(kf, 0o640)  # a key shared with a group of services
    assert TenantKey.load(kf).id == k2.id
    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(KvcInputError, match="not a regular file"):
        TenantKey.load(tmp_path / "fifo")                 # never blocks on a FIFO
    with pytest.raises(KvcInputError, match="no such store key file"):
        TenantKey.load(tmp_path / "missing.key")
    for bad in (5, None, 1.5, str(kf) + "\0"):  # an engine config's key_file as given: before, TypeError / ValueError
        with pytest.raises(KvcInputError, match="must be a path"):
            TenantKey.load(bad)
    # two processes with the default key share entries; a memory-only store needs no key file
    assert Store.open("mem://").key.source == "ephemeral"


def test_layout1_store_is_set_aside_not_served(tmp_path, caplog):
    root = tmp_path / "old"
    (root / "objects" / "ab").mkdir(parents=True)
    (root / "objects" / "ab" / ("ab" * 32 + ".kve")).write_bytes(b"old entry")
    (root / "kvstore.json").write_text('{"format": "kvcodec-store", "layout": 1}\n')
    with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
        st = Store.open(str(root), key=A)
    assert "layout-1" in caplog.text
    assert st.ls() == [] and [n for n in os.listdir(root) if n.startswith("objects.layout1.")]
    st.put(key(1), blob(1))
    assert Store.open(str(root), key=A).get(key(1)) == blob(1)


def test_hostile_envelopes_at_the_callers_name_are_misses(tmp_path):
    """Deep JSON, huge numbers, odd types in header and seal: a miss, never a traceback."""
    import json
    import struct

    from kvcodec.store.tiers.base import FIXED, MAGIC, crc32c_extend, crc32c

    st = Store.open(f"file://{tmp_path}/s?fsync=0", key=A)
    k = key(1)
    st.put(k, blob(1))
    phys = st.physical(k)
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    sealed = decode_envelope(open(tier.path_for(phys), "rb").read()).meta

    def raw(header: bytes, data: bytes = b"x") -> bytes:
        head0 = FIXED.pack(MAGIC, 1, 0, 0, len(header), len(data), 0)[:20]
        return head0 + struct.pack("<I", crc32c_extend(crc32c_extend(crc32c(head0), header), data)) + header + data

    ks = phys.to_str()
    headers = [
        b"[" * 100_000 + b"]" * 100_000,
        json.dumps({"key": ks, "meta": {}, "created": 10 ** 400}).encode(),
        json.dumps({"key": ks, "meta": {"a": "[" * 10}, "created": True}).encode(),
        b'{"key": "' + ks.encode() + b'", "meta": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}",
        json.dumps({"key": ks, "meta": {**sealed, "size": 10 ** 30}}).encode(),
        json.dumps({"key": ks, "meta": {**sealed, "hashes": 5}}).encode(),
        json.dumps({"key": ks, "meta": {**sealed, "v": True}}).encode(),
        json.dumps({"key": ks, "meta": {**sealed, "mac": "\u00e9" * 64}}).encode(),
        json.dumps({"key": ks, "meta": {**sealed, "mac": 12}}).encode(),
        json.dumps({"key": ks, "meta": [1, 2]}).encode(),
        json.dumps({"key": 7, "meta": {}}).encode(),
        b'{"key": "' + ks.encode() + b'", "meta": {"k": "\\udcff"}}',
    ]
    for h in headers:
        with open(tier.path_for(phys), "wb") as f:
            f.write(raw(h))
        st.memory.clear()
        assert st.get(k) is None and st.reader(k) is None
        assert st.ls() == [] or all(r.key != k for r in st.ls())
        st.stats()
        st.gc(grace_s=0)
    with pytest.raises(KvcInputError):
        st.put(k, b"x", _deep(5000))


def _deep(n: int) -> dict:
    d: dict = {}
    cur = d
    for _ in range(n):
        cur["a"] = {}
        cur = cur["a"]
    return d


def test_foreign_files_at_an_entry_name_are_misses(tmp_path):
    """A symlink, FIFO or directory planted at the caller's entry name: a quick miss, never a hang."""
    st = Store.open(f"file://{tmp_path}/s?fsync=0", key=A, memory_bytes=0)
    k = key(1)
    st.put(k, blob(1))
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    p = tier.path_for(st.physical(k))
    target = tmp_path / "elsewhere.kve"
    shutil.copy(p, target)
    for plant in ("symlink", "fifo", "dir"):
        os.unlink(p) if os.path.lexists(p) and not os.path.isdir(p) else None
        if os.path.isdir(p):
            os.rmdir(p)
        {"symlink": lambda: os.symlink(target, p), "fifo": lambda: os.mkfifo(p), "dir": lambda: os.mkdir(p)}[plant]()
        assert st.get(k) is None and st.reader(k) is None, plant
        assert st.ls() == [], plant
        assert "error" not in st.gc(grace_s=0)["directory"], plant


def test_ls_filters_no_key_can_carry_are_refused(tmp_path):
    """Store.ls(model=5 / namespace="a/b") listed nothing, as if the store were empty, and namespace="" listed every
    namespace; the CLI had its own copy of the check (kvc store ls), now Store.ls's."""
    st = Store.open(f"file://{tmp_path}/s?fsync=0", key=A)
    st.put(key(1), blob(1))
    for kw in ({"model": 5}, {"namespace": "a/b"}, {"namespace": ""}, {"codec": "x" * 200}):
        with pytest.raises(KvcInputError, match="is invalid"):
            st.ls(**kw)
    assert [r.key for r in st.ls(namespace="default")] == [key(1)]


@pytest.mark.parametrize("tier", ["directory", pytest.param("redis", marks=pytest.mark.requires_redis), "s3"])
def test_a_tenants_listing_reads_one_header_per_other_tenants_partition(tier, tmp_path, monkeypatch, request):
    """A tenant's ls read the header of every entry of every other tenant (600 entries with 50 kB of metadata
    each: 30 MB read and parsed for a tenant holding nothing), so listing often starved the others' I/O. Every
    entry of a partition is its owner's: one header of another tenant's partition tells the Store to skip it."""
    d = str(tmp_path / "s") if tier == "directory" else request.getfixturevalue(f"{tier}_server").url
    d = d() if callable(d) else d  # the S3 server's url is a method
    a, b = TenantKey.ephemeral(), TenantKey.ephemeral()
    sb = Store.open(d, key=b, memory_bytes=0)
    for i in range(60):
        for ns in ("default", "other"):
            sb.put(StoreKey.for_tokens(list(range(i, i + 16)), model="m", codec="c", namespace=ns), b"y" * 100,
                   meta={"pad": "x" * 5000})
    sa = Store.open(d, key=a, memory_bytes=0)
    mine = [StoreKey.for_tokens(list(range(i, i + 16)), model="m", codec="c") for i in range(3)]
    for k in mine:
        sa.put(k, b"z" * 10)
    reads = []
    if tier == "directory":
        orig = DirectoryTier._read_info
        monkeypatch.setattr(DirectoryTier, "_read_info", lambda self, *a, **kw: reads.append(1) or orig(self, *a, **kw))
    else:
        import importlib

        mod = importlib.import_module(f"kvcodec.store.tiers.{tier}")
        orig_parse = mod.parse_header
        monkeypatch.setattr(mod, "parse_header", lambda *a, **kw: reads.append(1) or orig_parse(*a, **kw))
    assert [r.key for r in sa.ls()] == sorted(mine)
    assert len(reads) == 3 + 2  # its own three entries, then one header of each of b's two partitions
    assert len(sb.ls()) == 120 and len(sb.ls(namespace="other")) == 60


def test_the_namespaces_a_tenant_key_remembers_are_bounded():
    """A KDN client's physical keys name any namespace string it likes (a /v1/contains takes 4,096 keys), and the
    tenant key cached the derived keys of every one for good: 50 MB more after 100,000, never given back."""
    import secrets

    from kvcodec.store.tenant import NS_CACHE, PHYS_CODEC, PHYS_MODEL

    st = Store.open("mem://", key=TenantKey.ephemeral())
    ks = [StoreKey(PHYS_MODEL, PHYS_CODEC, secrets.token_hex(16), 0, secrets.token_hex(32)) for _ in range(NS_CACHE + 904)]
    assert st.contains_many(ks) == [False] * len(ks)
    assert len(st.key._ns) <= NS_CACHE
    assert st.physical(ks[0]) == st.physical(ks[0])  # a forgotten namespace is derived again, the same
