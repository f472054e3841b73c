"""What every store tier must do, as tests: subclass :class:`TierTests` once per tier (as zarr's ``StoreTests``).

A subclass names the class under test and provides one fixture, ``backend``,
giving the tier's URL (against a real server where the tier has one) and the
raw hooks the tests cannot get through the tier itself: ``corrupt`` (damage
the stored object of a key behind the tier's back) and ``stop`` (take the
server down)::

    class TestRedisTier(TierTests):
        tier_cls = RedisTier

        @pytest.fixture
        def backend(self, redis_server):
            ...
            return TierBackend(redis_server.url, corrupt=flip_last_byte, stop=redis_server.stop)

The tests read the tier's declared capabilities (``supports_writes``,
``supports_deletes``, ``supports_listing``, ``supports_ranges``,
``persistent``, ``remote``) and check each one both ways: what a tier says it
does, it does; what it says it does not, it refuses (a read-only tier's
``put`` raises) or the Store does not ask of it (a tier without ranges is
range-read through a verified whole get).

Two levels:

* the tier alone (``test_tier_*``): physical keys as the Store would pass
  them, put / get / contains / contains_many / delete / ls / range_entry,
  hostile key names, metadata and payload size limits (spec/store-keys.md §6, §9);
* the tier inside a :class:`~kvcodec.store.Store` (``test_store_*``, persistent
  tiers): round trip to another process, tenant namespaces, prefix lookup,
  listing, removal, a damaged value is a miss, large entries and ranged reads,
  atomic visibility under concurrent writers, and a clean miss (with the write
  reported) while the server is down.

A read-only tier (the published-directory HTTP tier) is written through
``TierBackend.writer_url`` (the directory the server publishes) and read
through its own URL.
"""

from __future__ import annotations

import os
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import pytest

from kvcodec.errors import KvcInputError, KvcStoreError
from kvcodec.store import Store, StoreKey, TenantKey
from kvcodec.store.ranged import BytesRangeReader
from kvcodec.store.tenant import AuthRangeReader
from kvcodec.store.tiers.base import MAX_TIER_META, Tier
from kvcodec.store.tiers import registry
from kvcodec.store.tiers.registry import open_tier, scheme_of

__all__ = ["TierBackend", "TierTests", "TEST_TENANT"]

TEST_TENANT = TenantKey(b"\x5a" * 32, "kvcodec.testing.store")  # the tenant of every Store the tests open

# Valid key ids (spec/store-keys.md §4) that a tier's naming must keep apart and give back exactly:
# the longest id, every punctuation mark allowed, a bare digit, ids differing only in case.
ODD_IDS = ("x" * 128, "Z.9+=-a..b", "0", "Case", "case")


@dataclass
class TierBackend:
    """One tier under test: its URL and the raw hooks a subclass provides."""

    url: str
    corrupt: Callable[[StoreKey], None] | None = None  # flip a byte of the object stored under this tier-level key
    stop: Callable[[], None] | None = None              # take the server down (remote tiers)
    writer_url: str | None = None                       # where entries are written when the tier is read-only


class TierTests:
    """Conformance tests of one tier; subclass with ``tier_cls`` and a ``backend`` fixture."""

    tier_cls: type[Tier]
    model = "m"                    # key fields of the test keys
    codec = "c"
    namespaces = ("default", "tenant-b")
    free_fields = ("model", "codec", "namespace")  # key fields the tier lets a test choose (hostile names)
    opaque_payloads = True         # stores any bytes (False: a subclass's payload() builds what the tier accepts)
    large_size = 6 << 20           # the large entry: above the S3 tests' 5M multipart threshold
    large_tokens = 256             # tokens of the large entry's key

    # -- what a subclass provides -------------------------------------------------------
    @pytest.fixture
    def backend(self, *args: Any, **kwargs: Any) -> TierBackend:
        raise NotImplementedError("a TierTests subclass provides the `backend` fixture")

    def payload(self, i: int, size: int = 30_000, *, variant: int = 0, n_tokens: int = 256) -> bytes:
        """The bytes stored under ``key(i, n_tokens=n_tokens)``; ``variant`` gives another payload of the same key."""
        return random.Random(i * 1000 + variant).randbytes(size)

    def assert_damage_handled(self, store: Store, tier_name: str) -> None:
        """After a damaged value was read as a miss: the tier counted the damage."""
        assert self._tier_stats(store, tier_name)["corrupt"] == 1

    # -- helpers ---------------------------------------------------------------------------
    def key(self, i: int, ns: str | None = None, *, n_tokens: int = 256, model: str | None = None,
            codec: str | None = None) -> StoreKey:
        return StoreKey.for_tokens(list(range(i, i + n_tokens)), model=model or self.model,
                                   codec=codec or self.codec, namespace=ns or self.namespaces[0])

    def writer_url(self, backend: TierBackend) -> str:
        return backend.writer_url or backend.url

    def open_pair(self, backend: TierBackend) -> tuple[Tier, Tier]:
        """``(writer, reader)`` tier objects: separate objects of one persistent tier, one object otherwise."""
        writer = open_tier(self.writer_url(backend))
        reader = open_tier(backend.url) if self.tier_cls.persistent else writer
        return writer, reader

    def store(self, url: str, **kw: Any) -> Store:
        return Store.open(url, key=TEST_TENANT, **kw)

    @staticmethod
    def _tier_stats(store: Store, name: str) -> dict[str, Any]:
        return {t["name"]: t for t in store.stats()["tiers"]}[name]

    def _need_persistent(self) -> None:
        if not self.tier_cls.persistent:
            pytest.skip(f"{self.tier_cls.__name__} does not outlive its Store: no other process can read it")

    # -- the tier alone ------------------------------------------------------------------------
    def test_tier_declares_schemes_and_capabilities(self, backend: TierBackend) -> None:
        cls = self.tier_cls
        assert cls.schemes and all(s == s.lower() and "://" not in s for s in cls.schemes), cls.schemes
        assert scheme_of(backend.url) in cls.schemes
        for s in cls.schemes:
            assert registry.TIERS.has(s), f"{s}:// is not registered (kvcodec.registry, group kvcodec.tiers)"
            assert registry.tier_class(f"{s}://x") is cls, f"{s}:// opens another tier"
        flags = ("supports_writes", "supports_deletes", "supports_listing", "supports_ranges", "persistent", "remote")
        assert all(isinstance(getattr(cls, f), bool) for f in flags)
        assert (cls.range_entry is not Tier.range_entry) == cls.supports_ranges, \
            "range_entry is implemented exactly when supports_ranges is declared"
        tier = open_tier(backend.url)
        try:
            assert type(tier) is cls
            assert tier.available()
            st = tier.stats()
            assert st["writable"] is cls.supports_writes and st["persistent"] is cls.persistent
            assert (st["entries"] is None) == (not cls.supports_listing)
            assert ("outages" in st) == (tier.guard is not None)
            if tier.guard is not None:
                assert st["outages"] == 0 and cls.remote
            # what a tier says it does not do, it refuses
            k = self.key(1)
            if not cls.supports_writes:
                with pytest.raises(KvcStoreError):
                    tier.put(k, self.payload(1))
            if not cls.supports_deletes:
                with pytest.raises(KvcStoreError):
                    tier.delete(k)
            if not cls.supports_listing:
                assert list(tier.ls()) == []
        finally:
            tier.close()

    def test_tier_put_get_contains_delete(self, backend: TierBackend) -> None:
        writer, reader = self.open_pair(backend)
        ns_a, ns_b = self.namespaces
        k1, k2, k3 = self.key(1, ns_a), self.key(2, ns_b), self.key(3, ns_a)
        p1, p2 = self.payload(1), self.payload(2)
        writer.put(k1, p1, {"layers": 30})
        writer.put(k2, p2)
        e = reader.get_entry(k1)
        assert e is not None and e.key == k1 and e.data == p1 and e.meta == {"layers": 30}
        assert reader.get(k2) == p2 and reader.get_entry(k2).meta == {}  # type: ignore[union-attr]
        assert reader.get(k3) is None and reader.get_entry(k3) is None
        assert reader.contains(k1) and not reader.contains(k3)
        assert reader.contains_many([k3, k1, k2]) == [False, True, True]
        assert reader.contains_many([k1, k3, k2, k3]) == [True, False, True, False]  # in the order asked
        assert reader.contains_many([]) == []
        assert writer.delete(k1) is True
        assert reader.get(k1) is None and not reader.contains(k1) and reader.get(k2) == p2
        assert writer.delete(k1) is False
        c = reader.counters
        assert c.hits >= 2 and c.misses >= 2 and c.corrupt == 0
        writer.close()
        reader.close()

    def test_tier_listing(self, backend: TierBackend) -> None:
        writer, reader = self.open_pair(backend)
        ns_a, ns_b = self.namespaces
        k1, k2 = self.key(1, ns_a), self.key(2, ns_b)
        p1, p2 = self.payload(1, 20_000), self.payload(2, 30_000)
        writer.put(k1, p1, {"layers": 30})
        writer.put(k2, p2, {"doc": "b"})
        rows = list(reader.ls(with_meta=True))
        if not reader.supports_listing:
            assert rows == [] and reader.stats()["entries"] is None
            return
        assert {r.key: r.size for r in rows} == {k1: len(p1), k2: len(p2)}
        assert {r.key: r.meta for r in rows} == {k1: {"layers": 30}, k2: {"doc": "b"}}
        assert {r.tier for r in rows} == {reader.name}
        assert all(r.meta is None for r in reader.ls())
        n, size = reader.usage()
        assert n == 2 and size >= len(p1) + len(p2)
        writer.delete(k1)
        assert [r.key for r in reader.ls()] == [k2]

    def test_tier_ranges(self, backend: TierBackend) -> None:
        writer, reader = self.open_pair(backend)
        if not reader.supports_ranges:
            with pytest.raises(NotImplementedError):
                reader.range_entry(self.key(1))
            return
        k, data = self.key(4), self.payload(4, 300_000)
        writer.put(k, data, {"x": 1})
        got = reader.range_entry(k)
        assert got is not None
        rd, meta = got
        try:
            assert meta == {"x": 1} and rd.size == len(data)
            for off, n in ((0, 100), (len(data) - 4096, 4096), (len(data) // 3, len(data) // 2), (len(data), 0)):
                assert rd.read(off, n) == data[off:off + n], (off, n)
        finally:
            rd.close()
        assert reader.range_entry(self.key(5)) is None

    def test_tier_hostile_names(self, backend: TierBackend) -> None:
        """Odd but valid ids round-trip without colliding; a key sharing an object's name is a miss that leaves it be."""
        writer, reader = self.open_pair(backend)
        keys = [self.key(10)]
        for v in ODD_IDS:
            if "model" in self.free_fields:
                keys.append(self.key(10, model=v))
            if "codec" in self.free_fields:
                keys.append(self.key(10, codec=v))
            if "namespace" in self.free_fields:
                keys.append(self.key(10, v))
        assert len(set(keys)) == len(keys)
        for i, k in enumerate(keys):
            writer.put(k, self.payload(10, 2000 + i, variant=i) if self.opaque_payloads else
                       self.payload(10, variant=i), {"i": i})
        for i, k in enumerate(keys):
            e = reader.get_entry(k)
            assert e is not None and e.key == k and e.meta == {"i": i}, k
        if reader.supports_listing:
            assert {r.key for r in reader.ls()} == set(keys)
        # Same namespace and digest (what name-by-digest tiers file it under), another key: a miss, never
        # modified, moved or deleted (spec/store-keys.md §9.2).
        k = keys[0]
        others = [StoreKey(k.model, k.codec, k.namespace, k.n_tokens + 1, k.digest),
                  StoreKey(k.model, "other-codec", k.namespace, k.n_tokens, k.digest)]
        if "model" in self.free_fields:
            others.append(StoreKey("other-model", k.codec, k.namespace, k.n_tokens, k.digest))
        for o in others:
            assert reader.get(o) is None, o
            if reader.supports_ranges:
                assert reader.range_entry(o) is None
        fresh = open_tier(backend.url) if self.tier_cls.persistent else reader
        e = fresh.get_entry(k)
        assert e is not None and e.meta == {"i": 0}, "reading another key at its name must leave the entry alone"
        assert fresh.counters.corrupt == 0 and reader.counters.corrupt == 0

    def test_tier_size_limits(self, backend: TierBackend) -> None:
        writer, reader = self.open_pair(backend)
        k = self.key(6)
        with pytest.raises(KvcInputError):
            writer.put(k, self.payload(6), {"pad": "x" * MAX_TIER_META})
        with pytest.raises(KvcInputError):
            writer.put(k, self.payload(6), {"bad": object()})
        assert reader.get(k) is None
        meta = {"pad": "m" * 40_000}  # larger than one network packet or HTTP header line, within every limit
        writer.put(k, self.payload(6), meta)
        e = reader.get_entry(k)
        assert e is not None and e.meta == meta and e.data == self.payload(6)
        if self.opaque_payloads:
            writer.put(self.key(7), b"")
            e0 = reader.get_entry(self.key(7))
            assert e0 is not None and e0.data == b""
        big_key = self.key(8, n_tokens=self.large_tokens)
        big = self.payload(8, self.large_size, n_tokens=self.large_tokens)
        writer.put(big_key, big)
        assert reader.get(big_key) == big

    # -- the tier inside a Store -------------------------------------------------------------------
    def test_store_roundtrip_isolation_prefix_ls_rm(self, backend: TierBackend) -> None:
        self._need_persistent()
        ns_a, ns_b = self.namespaces
        st = self.store(self.writer_url(backend))
        wname = st.tiers[-1].name
        res = st.put(self.key(1), self.payload(1), {"layers": 30})
        assert res.ok and res.stored_in == ["memory", wname]
        st.put(self.key(2, ns_b), self.payload(2))
        other = self.store(backend.url)  # another process: empty LRU
        name = other.tiers[-1].name
        assert other.get(self.key(1)) == self.payload(1) and other.get_meta(self.key(1)) == {"layers": 30}
        assert other.get(self.key(1, ns_b)) is None, "namespaces must not share entries"
        assert other.get(self.key(3)) is None
        assert other.contains_many([self.key(3), self.key(1), self.key(2, ns_b)]) == [False, True, True]
        assert other.longest_prefix(list(range(1, 257)) + [7] * 50, model=self.model, codec=self.codec,
                                    namespace=ns_a) == (self.key(1), 256)
        rows = other.ls(with_meta=True)
        tier = self._tier_stats(other, name)
        assert tier["hits"] >= 1 and tier["available"]
        if self.tier_cls.supports_listing:
            assert {r.key for r in rows} == {self.key(1), self.key(2, ns_b)}
            assert {r.key: r.size for r in rows} == {self.key(1): len(self.payload(1)),
                                                       self.key(2, ns_b): len(self.payload(2))}
            assert [r.meta for r in other.ls(with_meta=True, namespace=ns_a)] == [{"layers": 30}]
            assert tier["entries"] == 2
        else:
            assert all(r.tier == "memory" for r in rows)  # only what this process's own gets cached
            assert tier["entries"] is None
        remover = self.store(self.writer_url(backend)) if not self.tier_cls.supports_deletes else other
        assert remover.rm(self.key(1)) is True and self.store(backend.url).get(self.key(1)) is None
        assert self.store(self.writer_url(backend)).rm(self.key(1)) is False

    def test_store_damaged_value_is_a_miss(self, backend: TierBackend) -> None:
        self._need_persistent()
        if backend.corrupt is None:
            pytest.skip(f"{self.tier_cls.__name__} holds no raw bytes to damage")
        st = self.store(self.writer_url(backend))
        st.put(self.key(5), self.payload(5))
        backend.corrupt(st.physical(self.key(5)))
        fresh = self.store(backend.url)
        assert fresh.get(self.key(5)) is None
        self.assert_damage_handled(fresh, fresh.tiers[-1].name)

    def test_store_large_entry_and_ranged_reads(self, backend: TierBackend) -> None:
        self._need_persistent()
        k = self.key(7, n_tokens=self.large_tokens)
        data = self.payload(7, self.large_size, n_tokens=self.large_tokens)
        st = self.store(self.writer_url(backend), memory_bytes=0)
        assert st.put(k, data, {"big": True}).ok
        fresh = self.store(backend.url, memory_bytes=0)
        assert fresh.get(k) == data
        rd = fresh.reader(k)
        assert rd is not None and rd.size == len(data)
        # the Store reads ranges from a tier that declares them, and a verified whole get from one that does not
        assert isinstance(rd, AuthRangeReader if self.tier_cls.supports_ranges else BytesRangeReader), type(rd)
        for off, n in ((0, 100), (len(data) - 4096, 4096), (len(data) // 2, 1 << 20)):
            assert rd.read(off, n) == data[off:off + n]
        rd.close()
        assert fresh.reader(self.key(99)) is None

    def test_store_concurrent_writers_atomic_visibility(self, backend: TierBackend) -> None:
        """Writers race on one key with different payloads; every read is one whole payload or a miss."""
        self._need_persistent()
        versions = [self.payload(9, 200_000, variant=v) for v in range(4)]
        assert len(set(versions)) == 4
        stop = threading.Event()
        bad: list[str] = []

        def write(v: bytes) -> None:
            try:
                st = self.store(self.writer_url(backend), memory_bytes=0)
                for _ in range(5):
                    st.put(self.key(9), v)
            except Exception as e:  # a thread's exception would not fail the test by itself
                bad.append(f"writer: {type(e).__name__}: {e}")

        def read() -> None:
            try:
                st = self.store(backend.url, memory_bytes=0)
                while not stop.is_set():
                    got = st.get(self.key(9))
                    if got is not None and got not in versions:
                        bad.append(f"read {len(got)} bytes matching no written version")
            except Exception as e:
                bad.append(f"reader: {type(e).__name__}: {e}")

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
        assert self.store(backend.url).get(self.key(9)) in versions

    def test_store_outage_is_a_clean_miss(self, backend: TierBackend, tmp_path: Path) -> None:
        if backend.stop is None:
            pytest.skip(f"{self.tier_cls.__name__} has no server to take down")
        assert self.tier_cls.remote
        st = self.store(f"{tmp_path}/local,{backend.url}")
        remote = st.tiers[-1].name
        st.put(self.key(1), self.payload(1))
        self.store(self.writer_url(backend)).put(self.key(2), self.payload(2))  # only the remote tier has it
        backend.stop()
        st.memory.clear()
        assert st.get(self.key(1)) == self.payload(1)   # from the directory tier
        assert st.get(self.key(2)) is None              # remote down: a miss, not an exception
        assert st.contains_many([self.key(1), self.key(2)]) == [True, False]
        if not self.tier_cls.supports_writes:
            return
        res = st.put(self.key(3), self.payload(3))
        assert not res.ok and remote in res.failed and res.tiers["directory"] == "ok"
        with pytest.raises(KvcStoreError):
            self.store(backend.url).put(self.key(4), self.payload(4))  # no persistent tier took it: an error


def flip_last_byte(path: str | os.PathLike[str]) -> None:
    """Damage a file the way a bad disk or a bad copy would: its last byte flipped."""
    p = Path(path)
    b = bytearray(p.read_bytes())
    b[-1] ^= 1
    p.write_bytes(bytes(b))
