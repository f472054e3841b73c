"""The one plugin registry (kvcodec/registry.py): one-line errors for unknown, doubly declared, broken and wrongly
typed plugins, each failing only its own name; kvcodec's own names never read the installed metadata and cannot be
taken over. The working plugin package: tests/core/test_plugin_package.py."""

from __future__ import annotations

import sys
import warnings

import pytest

from kvcodec import registry
from kvcodec.core.stage import REGISTRY, STAGES, Pipeline, stage_from_json
from kvcodec.decode.registry import DECODERS, backend, backends, select
from kvcodec.errors import KvcBackendError, KvcCodecError, KvcError, KvcInputError
from kvcodec.format import KvcReader
from kvcodec.plugins import BUILTINS
from kvcodec.store import Store, TenantKey
from kvcodec.store.tiers import registry as tiers
from plugin_dist import install, uninstall
from test_imports import ROOT

LOSSLESS = ROOT / "spec" / "vectors" / "kvc" / "smollm2_8tok_f16_lossless.kvc"
BROKEN = "kvc_broken_plugin"  # the package the broken plugins' targets live in


def _one_line(exc: pytest.ExceptionInfo) -> str:
    msg = str(exc.value)
    assert "\n" not in msg and isinstance(exc.value, KvcError), msg
    return msg


@pytest.fixture
def site(tmp_path):
    """A site folder for fake distributions; everything they brought is forgotten after the test."""
    path = tmp_path / "site"
    path.mkdir()
    (path / BROKEN).mkdir()
    (path / BROKEN / "__init__.py").write_text("")
    (path / BROKEN / "explodes.py").write_text("raise RuntimeError('first line\\nsecond line')\n")
    (path / BROKEN / "stages.py").write_text(
        "from kvcodec.core.stage import BytesToBytes, register\n"
        "@register\n"
        "class Hijack(BytesToBytes):\n"
        "    name = 'zstd'\n    version = 7\n"
        "    def encode(self, data, ctx): return data\n"
        "    def decode(self, data, max_size, ctx): return bytes(data)\n")
    (path / BROKEN / "decoders.py").write_text(
        "from kvcodec.decode.registry import Backend\n"
        "FAKE_REF = Backend('fake-ref', 'cpu', 99, 'kvcodec.decode.registry', '_supports_all', '_reference_decode',"
        " reference=True)\n")
    yield path
    uninstall(path, (BROKEN,))


@pytest.fixture
def broken(site):
    """One distribution declaring every kind of broken plugin, and two declaring the same name."""
    install(site, "kvc-broken", {
        "kvcodec.stages": {"gone": "kvc_no_such_module:Stage", "explodes": f"{BROKEN}.explodes:X",
                           "wrongtype": "os:sep", "misnamed": "kvcodec.codecs.lossless:Raw",
                           "hijack": f"{BROKEN}.stages", "twin": "os:sep", "rans": "os:sep"},
        "kvcodec.decoders": {"bad-dec": "os:sep", "fake-ref": f"{BROKEN}.decoders:FAKE_REF",
                             "impostor": "kvcodec.decode.registry:NUMBA_FUSED"},
        "kvcodec.tiers": {"badtier": "os:sep", "wrongscheme": "kvcodec.store.tiers.base:MemoryTier",
                          "nomod": "kvc_no_such_module:T"},
    })
    install(site, "kvc-twin", {"kvcodec.stages": {"twin": "os:path"}})
    return site


def test_unknown_names_are_one_line_errors():
    with pytest.raises(KvcCodecError) as e:
        stage_from_json({"name": "brotli9000", "version": 1, "config": {}})
    assert _one_line(e).startswith("unknown codec 'brotli9000' version 1 (known: cast, raw,")
    with pytest.raises(KvcBackendError) as e:
        backend("nope")
    assert _one_line(e).startswith("unknown decoder backend 'nope' (known: reference, numba-fused,")
    with pytest.raises(KvcInputError) as e:
        Store.open("nope://x", key=TenantKey(b"k" * 32, "t"))
    assert _one_line(e).startswith("unsupported store tier 'nope://x'")


def test_register_refuses_a_name_declared_in_code():
    with pytest.raises(KvcCodecError) as e:
        STAGES.register("rans", "kvcodec.codecs.rans")
    assert _one_line(e) == ("codec 'rans' is already registered (kvcodec.codecs.rans, from kvcodec); "
                            "cannot register kvcodec.codecs.rans")
    with pytest.raises(KvcInputError, match="already taken"):
        tiers.register("kvcodec.store.tiers.base:MemoryTier", ("redis",))
    with pytest.raises(KvcCodecError, match="was not added with register"):
        STAGES.unregister("raw")


@pytest.mark.filterwarnings("ignore:kvcodec. codec 'rans' of kvcodec kept:RuntimeWarning")
def test_broken_plugins_fail_only_their_own_names(broken):
    msgs = {}
    for name in ("gone", "explodes", "wrongtype", "misnamed", "hijack", "twin"):
        with pytest.raises(KvcCodecError) as e:
            stage_from_json({"name": name, "version": 1, "config": {}})
        msgs[name] = _one_line(e)
    assert msgs["gone"] == ("codec 'gone' (kvc_no_such_module:Stage, from kvc-broken) failed to load: "
                            "ModuleNotFoundError: No module named 'kvc_no_such_module'")
    assert msgs["explodes"].endswith("failed to load: RuntimeError: first line")
    assert msgs["wrongtype"].endswith("is a str, not a Stage subclass or a module that registers one")
    assert msgs["misnamed"].endswith("is the stage 'raw', not 'misnamed'")
    assert "codec 'zstd' is provided by kvcodec.codecs.lossless" in msgs["hijack"]  # no versions added to a built-in
    assert ("zstd", 7) not in REGISTRY
    assert msgs["twin"] == ("codec 'twin' is declared by two installed packages (os:sep from kvc-broken and os:path "
                            "from kvc-twin): uninstall one")
    with pytest.raises(KvcBackendError) as e:
        backend("bad-dec")
    assert _one_line(e).endswith("is a str, not a kvcodec.decode.registry.Backend")
    with pytest.raises(KvcBackendError, match="only kvcodec's own are"):
        backend("fake-ref")
    with pytest.raises(KvcBackendError, match="is the backend 'numba-fused', not 'impostor'"):
        backend("impostor")
    for url, why in (("badtier://x", "is a str, not a kvcodec.store.tiers.base.Tier subclass"),
                     ("wrongscheme://x", "is registered for wrongscheme:// but declares schemes ('mem',)"),
                     ("nomod://x", "failed to load: ModuleNotFoundError")):
        with pytest.raises(KvcInputError) as e:
            Store.open(url, key=TenantKey(b"k" * 32, "t"))
        assert why in _one_line(e)

    # everything else works: kvcodec's own stages, decoders (the broken ones skipped, with a warning) and tiers
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        names = [b.name for b in backends()]
    assert names == ["reference", "numba-fused", "triton-stages", "triton-fused"]
    skipped = sorted(str(w.message).split("'")[1] for w in caught if "kvcodec: skipped: decoder backend" in str(w.message))
    assert skipped == ["bad-dec", "fake-ref", "impostor"]
    with KvcReader(LOSSLESS) as r:
        for j in range(r.num_chunks):
            r.read_chunk(j, "cpu")
        p, _, _, _, spec, _ = r.chunk_inputs(0)
        assert [b.name for b in select(p, spec)] == ["numba-fused", "reference"]
    assert tiers.tier_class("/some/dir").__name__ == "DirectoryTier"
    problems = STAGES.problems()
    assert any("'rans' of kvcodec kept; the entry point(s) os:sep from kvc-broken ignored" in p for p in problems)
    assert any("declared by two installed packages" in p for p in problems)


def test_an_entry_point_cannot_take_over_a_builtin_name(broken):
    with pytest.warns(RuntimeWarning, match="codec 'rans' of kvcodec kept"):
        assert "rans" in STAGES.names()
    assert STAGES.get("rans").__name__ == "kvcodec.codecs.rans"
    assert STAGES.provider("rans").origin == "kvcodec"


def test_builtin_names_never_read_the_installed_metadata(monkeypatch):
    """Looking up kvcodec's own stages and tiers reads no entry points (opening a file stays light); listing does."""
    def no_scan():
        raise AssertionError("entry points read")

    monkeypatch.setattr(registry, "_entry_points", no_scan)
    pipe = Pipeline.from_json([{"name": "raw"}, {"name": "zstd", "config": {"level": 3}}])
    assert [s.name for s in pipe.stages] == ["raw", "zstd"]
    for name in STAGES.builtin_names():
        assert STAGES.has(name)
    assert tiers.tier_class("redis://h/0").__name__ == "RedisTier"
    with pytest.raises(AssertionError, match="entry points read"):
        STAGES.names()


def test_the_builtin_table_is_what_the_classes_say():
    """kvcodec/plugins.py declares each built-in once, in the three groups, and each target is what its group holds."""
    assert set(BUILTINS) == set(registry.GROUPS)
    assert STAGES.builtin_names() == list(BUILTINS[registry.STAGES_GROUP])
    assert DECODERS.builtin_names() == list(BUILTINS[registry.DECODERS_GROUP])
    assert tiers.TIERS.builtin_names() == list(BUILTINS[registry.TIERS_GROUP])
    for name in DECODERS.builtin_names():
        assert backend(name).name == name


def test_registering_from_code(monkeypatch):
    """register()/unregister(): what an application does without packaging; the listing follows the generation."""
    from kvcodec.core.stage import ArraySpec
    from kvcodec.decode.registry import REFERENCE, Backend

    before = registry.generation()
    mine = Backend("mine", "cpu", -5, "kvcodec.decode.registry", "_supports_all", "_reference_decode")
    DECODERS.register("mine", mine)
    try:
        assert registry.generation() != before and backends()[-1] is mine
        p = Pipeline.from_json([{"name": "raw"}])
        # a backend ranked below the reference still never comes after it: the reference is always last
        assert [b.name for b in select(p, ArraySpec((1, 2, 8), "float16"))][-1] == REFERENCE.name
    finally:
        DECODERS.unregister("mine")
    assert "mine" not in [b.name for b in backends()]


def test_refresh_rereads_the_metadata(site):
    assert not STAGES.has("late")
    install(site, "kvc-late", {"kvcodec.stages": {"late": "os:sep"}})  # install() calls registry.refresh()
    assert STAGES.has("late")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        uninstall(site, (BROKEN,))
    assert not STAGES.has("late") and str(site) not in sys.path
