"""The tier group of the plugin registry (kvcodec/store/tiers/registry.py), the lazy tier exports, and the conformance
suite's own teeth. An installed package's tier (entry points): tests/core/test_plugin_package.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvcodec.store
from kvcodec.errors import KvcInputError
from kvcodec.store import MemoryTier, Store, StoreKey, Tier
from kvcodec.store.tiers import registry
from kvcodec.store.tiers.base import MAX_TIER_META, Entry, as_bytes, check_meta
from kvcodec.testing.store import TierBackend, TierTests
from store_fixtures import subprocess_env


def test_declarations_and_classes_agree():
    """kvcodec/plugins.py declares each scheme of each built-in tier class, and nothing else for it."""
    by_class: dict[type, list[str]] = {}
    for s in registry.TIERS.builtin_names():
        cls = registry.TIERS.get(s)
        assert issubclass(cls, Tier) and cls.__name__ == registry.TIERS.target(s).rpartition(":")[2]
        by_class.setdefault(cls, []).append(s)
        assert registry.tier_class(f"{s.upper()}://somewhere") is cls  # schemes are case-insensitive
    for cls, schemes in by_class.items():
        assert tuple(schemes) == cls.schemes, f"{cls.__name__} declares {cls.schemes}, kvcodec/plugins.py {schemes}"
    assert registry.tier_class("relative/dir") is registry.tier_class("/abs/dir") is registry.tier_class("file:///x")
    assert registry.known_schemes()[:len(registry.TIERS.builtin_names())] == registry.TIERS.builtin_names()


def test_unknown_scheme_message_lists_every_known_scheme():
    with pytest.raises(KvcInputError) as e:
        Store.open("ftp://host/x")
    msg = str(e.value)
    assert msg.startswith("unsupported store tier 'ftp://host/x': use a directory path")
    for s in registry.known_schemes():
        assert f" {s}://" in msg, s


def test_every_tier_is_exported_lazily():
    for s in registry.TIERS.builtin_names():
        cls = registry.TIERS.get(s)
        assert cls.__name__ in kvcodec.store.__all__
        assert getattr(kvcodec.store, cls.__name__) is cls
    with pytest.raises(AttributeError):
        kvcodec.store.NoSuchTier  # noqa: B018


def test_client_libraries_load_only_with_their_tier(tmp_path):
    """Opening a directory store imports neither redis-py nor boto3; a redis URL imports redis-py only."""
    code = (
        "import sys\n"
        "from kvcodec.store import Store, StoreKey, TenantKey\n"
        f"st = Store.open({str(tmp_path / 's')!r}, key=TenantKey(b'k' * 32, 't'))\n"
        "st.put(StoreKey.for_tokens([1, 2], model='m', codec='c'), b'x')\n"
        "assert not [m for m in sys.modules if m.split('.')[0] in ('redis', 'boto3', 'botocore')], 'eager import'\n"
        "Store.open('redis://127.0.0.1:1/0', key=TenantKey(b'k' * 32, 't'))\n"
        "assert 'redis' in sys.modules and 'boto3' not in sys.modules\n"
    )
    r = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


class DictTier(Tier):
    """A tier defined outside kvcodec: one module-level dict, persistent for the test's lifetime."""

    kind = "dict"
    schemes = ("dict",)
    shelf: dict[StoreKey, Entry] = {}

    def __init__(self, url: str) -> None:
        super().__init__("dict", url)

    def get_entry(self, key):
        e = self.shelf.get(key)
        self.counters.add(**({"hits": 1} if e else {"misses": 1}))
        return e

    def put(self, key, data, meta=None, created=None):
        self.shelf[key] = Entry(key, as_bytes(data), check_meta(meta, MAX_TIER_META), created)

    def contains(self, key):
        return key in self.shelf

    def delete(self, key):
        return self.shelf.pop(key, None) is not None

    def ls(self, with_meta=False):
        from kvcodec.store import EntryInfo

        for k, e in list(self.shelf.items()):
            yield EntryInfo(k, len(e.data), self.name, dict(e.meta) if with_meta else None)


@pytest.fixture
def table():
    """The tier group; the schemes a test registers are removed after it."""
    before = set(registry.TIERS.names(entry_points=False))
    DictTier.shelf.clear()
    yield registry.TIERS
    for s in set(registry.TIERS.names(entry_points=False)) - before:
        registry.TIERS.unregister(s)


def test_register_a_tier_from_outside(table):
    registry.register(f"{__name__}:DictTier", ("dict",))
    st = Store.open("dict://anything")
    assert [t.kind for t in st.tiers] == ["memory", "dict"]
    k = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    assert st.put(k, b"payload", {"a": 1}).stored_in == ["memory", "dict"]
    assert Store.open("dict://anything", key=st.key).get(k) == b"payload"
    with pytest.raises(KvcInputError, match="already taken"):
        registry.register(f"{__name__}:DictTier", ("redis",))


class TestDictTier(TierTests):
    """The suite run on a tier defined in a test module: what a third-party tier would do."""

    tier_cls = DictTier

    @pytest.fixture
    def backend(self, table):
        registry.register(f"{__name__}:DictTier", ("dict",))
        return TierBackend("dict://")


# -- the suite fails on tiers that break the contract --------------------------------------------

class _Broken(MemoryTier):
    schemes = ("broken",)


class ForgetsMeta(_Broken):
    def get_entry(self, key):
        e = super().get_entry(key)
        return None if e is None else Entry(e.key, e.data, {}, e.created)


class DeleteKeepsEntry(_Broken):
    def delete(self, key):
        return self.contains(key)


class ClaimsRanges(_Broken):
    supports_ranges = True


class ListsNothing(_Broken):
    def ls(self, with_meta=False):
        return iter(())


class AnswersAnotherKey(_Broken):
    """Names entries by digest only and never checks the key (what spec/store-keys.md §9.1-2 forbids)."""

    def _name(self, key):
        return StoreKey("m", "c", key.namespace, 0, key.digest)

    def get_entry(self, key):
        e = super().get_entry(self._name(key))
        return None if e is None else Entry(key, e.data, e.meta, e.created)

    def put(self, key, data, meta=None, created=None):
        super().put(self._name(key), data, meta, created)


class SkipsMetaCheck(DictTier):
    schemes = ("broken",)

    def put(self, key, data, meta=None, created=None):
        self.shelf[key] = Entry(key, bytes(data), dict(meta or {}), created)


@pytest.mark.parametrize("broken, test", [
    (ForgetsMeta, "test_tier_put_get_contains_delete"),
    (DeleteKeepsEntry, "test_tier_put_get_contains_delete"),
    (ClaimsRanges, "test_tier_declares_schemes_and_capabilities"),
    (ListsNothing, "test_tier_listing"),
    (AnswersAnotherKey, "test_tier_hostile_names"),
    (SkipsMetaCheck, "test_tier_size_limits"),
])
def test_the_suite_fails_a_broken_tier(table, broken, test):
    registry.register(f"{__name__}:{broken.__name__}", ("broken",))

    class Suite(TierTests):
        tier_cls = broken

    with pytest.raises((AssertionError, pytest.fail.Exception)):  # a failed assert, or a pytest.raises that saw nothing
        getattr(Suite(), test)(TierBackend("broken://"))
    # the same test passes on the honest tier, so the failure above is the breakage's
    getattr(type("Honest", (TierTests,), {"tier_cls": MemoryTier})(), test)(TierBackend("mem://"))
