"""A package outside kvcodec adds a codec stage, a decoder and a store tier through entry points (issue 56).

``tests/_support/plugin_pkg`` is the project of kvc-demo-plugin: its pyproject.toml declares ``xor_demo``
(group ``kvcodec.stages``), ``demo-xor`` (``kvcodec.decoders``) and ``demo`` (``kvcodec.tiers``). The
fixture installs it into a temporary site directory as pip would (the package and a dist-info holding
those entry points: tests/_support/plugin_dist.py), edits no kvcodec file, and uninstalls it after.
"""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch

from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.kvcache import KVCache
from kvcodec.core.stage import REGISTRY, STAGES, Pipeline
from kvcodec.decode.registry import DECODERS, backend, backends, decode_with, select
from kvcodec.format import KvcReader, write_kvc
from kvcodec.store import Store, StoreKey, TenantKey
from kvcodec.store.tiers.registry import TIERS, known_schemes
from plugin_dist import PLUGIN_PKG, install, project_entry_points, uninstall

PKG = "kvc_demo_plugin"


@pytest.fixture
def plugin(tmp_path):
    site = tmp_path / "site"
    install(site, "kvc-demo-plugin", project_entry_points(), package=PLUGIN_PKG / PKG)
    try:
        yield site
    finally:
        uninstall(site, (PKG,))


def _cache() -> KVCache:
    fp = ModelFingerprint("synthetic", 2, 2, (8, 8), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, "float16", version=1)
    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(2, 5, 8, generator=g).half() for _ in range(2)]
    return KVCache(ks, [k * 2 for k in ks], np.arange(5), fp)


def test_an_installed_package_adds_a_stage_a_decoder_and_a_tier(plugin, tmp_path):
    # declared, listed, and still not imported: names come from the metadata alone
    assert "xor_demo" in STAGES.names() and "demo-xor" in DECODERS.names() and "demo" in known_schemes()
    assert STAGES.provider("xor_demo").origin == "kvc-demo-plugin"
    assert PKG not in sys.modules

    # the stage: a pipeline built by name from its JSON, a real .kvc written (and read back by the writer) and read
    pipe = Pipeline.from_json([{"name": "raw", "version": 1, "config": {}},
                               {"name": "xor_demo", "version": 1, "config": {"key": 60}}])
    assert f"{PKG}.stage" in sys.modules and ("xor_demo", 1) in REGISTRY
    cache = _cache()
    path = tmp_path / "x.kvc"
    write_kvc(cache, path, pipe)
    assert b"xor_demo" in path.read_bytes()

    # the decoder: picked for that pipeline ahead of the built-ins, and it decodes every chunk of the file
    assert "demo-xor" in [b.name for b in backends()]
    decoder = sys.modules[f"{PKG}.decoder"]
    assert backend("demo-xor") is decoder.BACKEND
    decoder.CALLS.clear()
    with KvcReader(path) as r:
        assert [p.to_json() for p in r.header.pipelines] == [pipe.to_json()]
        for j in range(r.num_chunks):
            e = r.chunk_info(j)
            want = (cache.keys if e.kind == "k" else cache.values)[e.layer].numpy()
            assert np.array_equal(r.read_chunk(j, "cpu"), want[:, e.token_start:e.token_end])
        n = r.num_chunks
        assert len(decoder.CALLS) == n
        p, payload, sides, sizes, spec, ctx = r.chunk_inputs(0)
        assert [b.name for b in select(p, spec)] == ["demo-xor", "reference"]
        trace: list[str] = []
        decode_with(p, payload, sides, sizes, spec, ctx, trace=trace)
        assert trace == ["demo-xor"]

    # the tier: demo:// opens the package's tier; a second Store (empty LRU) gets the bytes back from it
    tenant = TenantKey(b"k" * 32, "t")
    key = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    with Store.open("demo://shelf", key=tenant) as st:
        assert [t.kind for t in st.tiers] == ["memory", "demo"]
        assert st.put(key, path.read_bytes(), {"n": 1}).stored_in == ["memory", "demo"]
    with Store.open("demo://shelf", key=tenant) as st:
        assert st.get(key) == path.read_bytes()
    assert TIERS.get("demo").__module__ == f"{PKG}.tier"


def test_uninstalled_it_is_gone(plugin, tmp_path):
    """What the fixture undoes: after uninstall, the names are unknown again and the built-ins still work."""
    assert STAGES.has("xor_demo")
    uninstall(plugin, (PKG,))
    assert not STAGES.has("xor_demo") and "demo-xor" not in [b.name for b in backends()] and "demo" not in known_schemes()
    assert all(n != "xor_demo" for n, _ in REGISTRY)
