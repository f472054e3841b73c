"""The kvcodec-store L2 adapter, loaded by the real lmcache 0.5.6 plugin adapter from its ``--l2-adapter`` JSON, on
real SmolLM2 KV chunks. Runs in .venv-lmcache (``bash .ci/lmcache.sh``); skipped in a venv without lmcache.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.l2_adapters.plugin_l2_adapter",
                    reason="lmcache is not installed (bash .ci/lmcache.sh builds its venv)")

import kvcodec  # noqa: E402
from kvcodec.errors import KvcError  # noqa: E402
from kvcodec.integrations.lmcache import register  # noqa: E402
from kvcodec.integrations.lmcache.adapter import KvcodecStoreL2Adapter  # noqa: E402
from kvcodec.store import Store, TenantKey  # noqa: E402
from lmc import CHUNK, MODEL_NAME, adapter, key, layout, load, lookup, store  # noqa: E402

pytestmark = pytest.mark.model
MODELS = {MODEL_NAME: "smollm2"}


@pytest.fixture
def tenant(tmp_path):
    TenantKey.generate(tmp_path / "a.key")
    return str(tmp_path / "a.key")


def plugin(url, key_file, namespace="default", serde=None, **params):
    spec = {"type": "plugin", "module_path": "kvcodec.integrations.lmcache.adapter", "class_name": "KvcodecStoreL2Adapter",
            "adapter_params": {"store_url": str(url), "namespace": namespace, "key_file": key_file, "models": MODELS,
                               **params}}
    if serde is not None:
        spec["serde"] = serde
    return spec


def test_plugin_round_trip_as_kvc_entries(tmp_path, chunks, l1, tenant):
    _, ts = chunks
    url = tmp_path / "store"
    ad = adapter(plugin(url, tenant), l1)
    assert isinstance(ad, KvcodecStoreL2Adapter)  # LMCache's plugin loader built ours
    keys = [key(0), key(1)]
    try:
        assert lookup(ad, keys, layout(ts[0])) == [False, False]
        assert store(ad, l1, keys, ts)
        assert lookup(ad, keys, layout(ts[0])) == [True, True]
        hits, got = load(ad, l1, keys, ts[0])
        assert hits == [True, True]
        for a, b in zip(ts, got):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
        # each chunk is a plain .kvc entry of the store, smaller than the chunk (lossless, real KV)
        with Store.open(str(url), key=TenantKey.load(tenant)) as st:
            ent = st.get_entry(ad.store_key(keys[0]))
            assert ent is not None and ent.meta["lmcache"] == "kv"
            assert len(ent.data) < ts[0].numel() * 2
            with kvcodec.open(ent.data) as r:
                assert r.header.num_tokens == CHUNK and r.header.meta["chunk_hash"] == keys[0].chunk_hash.hex()
    finally:
        ad.close()


def test_tenancy_namespace_and_seal(tmp_path, chunks, l1, tenant):
    """Another namespace does not see the entries; another tenant key's store refuses them (sealed): both a miss."""
    _, ts = chunks
    url = tmp_path / "store"
    ad = adapter(plugin(url, tenant, namespace="team-a"), l1)
    try:
        assert store(ad, l1, [key(0)], [ts[0]])
    finally:
        ad.close()
    other_ns = adapter(plugin(url, tenant, namespace="team-b"), l1)
    TenantKey.generate(tmp_path / "b.key")
    other_key = str(tmp_path / "b.key")
    other_tenant = adapter(plugin(url, other_key, namespace="team-a"), l1)
    try:
        assert load(other_ns, l1, [key(0)], ts[0])[0] == [False]
        assert load(other_tenant, l1, [key(0)], ts[0])[0] == [False]
    finally:
        other_ns.close()
        other_tenant.close()


def test_hostile_and_wrong_entries_are_misses(tmp_path, chunks, l1, tenant):
    _, ts = chunks
    url = tmp_path / "store"
    ad = adapter(plugin(url, tenant), l1)
    try:
        assert store(ad, l1, [key(0)], [ts[0]])
        with Store.open(str(url), key=TenantKey.load(tenant)) as st:
            good = st.get(ad.store_key(key(0)))
            assert good is not None
            # chunk 0's entry planted under chunk 1's key, then garbage, then a truncated entry
            for data in (good, b"\0" * 100, good[: len(good) // 2], bytes(reversed(good))):
                st.put(ad.store_key(key(1)), data, {"lmcache": "kv"})
                assert load(ad, l1, [key(1)], ts[0])[0] == [False]
    finally:
        ad.close()


def test_serde_in_front_of_the_plugin(tmp_path, chunks, l1, tenant):
    """The ``kvcodec`` serde on this adapter: LMCache hands it the serde's bytes, stored as they are."""
    register()
    _, ts = chunks
    ad = adapter(plugin(tmp_path / "store", tenant, serde={"type": "kvcodec", "models": MODELS, "pad": False}), l1)
    try:
        assert store(ad, l1, [key(0)], [ts[0]])
        hits, got = load(ad, l1, [key(0)], ts[0])
        assert hits == [True] and torch.equal(got[0].view(torch.int16), ts[0].view(torch.int16))
    finally:
        ad.close()


def test_bad_params_refused_at_configuration(tmp_path):
    for bad in ({}, {"store_url": str(tmp_path), "colour": 1}, {"store_url": str(tmp_path), "namespace": "a b"},
                {"store_url": str(tmp_path), "preset": "nope"},
                {"store_url": str(tmp_path), "preset": "faithful", "overrides": {"step0": 0}},
                {"store_url": str(tmp_path), "preset": "lossless", "overrides": {"step0": 0.1}},
                {"store_url": str(tmp_path), "models": {"x/y": "no-such-model"}},
                # before, the namespaces "None" and "5"; a key_file number was a TypeError traceback
                {"store_url": str(tmp_path), "namespace": None}, {"store_url": str(tmp_path), "namespace": 5},
                {"store_url": str(tmp_path), "key_file": 5}):
        with pytest.raises(KvcError) as e:
            KvcodecStoreL2Adapter(bad)
        assert "\n" not in str(e.value)


def test_another_serdes_bytes_are_a_miss(tmp_path, lm, l1, tenant):
    """Two deployments on one store, this adapter with the same preset and namespace, different serdes in front:
    the store key names the adapter's codec, not the serde's, so LMCache's fp8 serde got the kvcodec serde's
    object (``small``, 256 tokens: smaller than fp8's buffer) under the same key and decoded its bytes as fp8
    values into the cache (a hit, garbage). Now each object records the size of the buffer its serde allocated,
    and one from another serde (another size) is a miss; an object of the reading serde loads as before."""
    from lmc import real_chunks

    register()
    _, ts = real_chunks(lm, 2, 256)
    url = tmp_path / "store"
    ours = adapter(plugin(url, tenant, serde={"type": "kvcodec", "models": MODELS, "pad": False, "preset": "small"}), l1)
    try:
        assert store(ours, l1, [key(0)], [ts[0]])
    finally:
        ours.close()
    fp8 = adapter(plugin(url, tenant, serde={"type": "fp8", "fp8_dtype": "float8_e4m3fn"}), l1)
    try:
        assert load(fp8, l1, [key(0)], ts[0])[0] == [False]
        assert store(fp8, l1, [key(1)], [ts[1]])
        hits, got = load(fp8, l1, [key(1)], ts[1])
        assert hits == [True] and (got[0].float() - ts[1].float()).abs().max() <= 0.07 * ts[1].float().abs().max()
    finally:
        fp8.close()


def test_keys_and_objects_of_different_counts_fail_the_task(tmp_path, chunks, l1, tenant):
    """zip() cut the longer list short: a store of 2 keys with 1 object reported success for one chunk, a load
    answered a 1-bit bitmap for 2 keys. Now the task fails as a whole: the store is unsuccessful, the load misses
    every key."""
    from lmc import l1_objects, wait

    _, ts = chunks
    ad = KvcodecStoreL2Adapter({"store_url": str(tmp_path / "s"), "key_file": tenant, "models": MODELS})
    try:
        objs = l1_objects(l1, [key(0)], layout(ts[0]))
        objs[0].tensor.copy_(ts[0])
        tid = ad.submit_store_task([key(0), key(1)], objs)
        assert not wait(lambda: ad.pop_completed_store_tasks().get(tid)).is_successful()
        tid = ad.submit_load_task([key(0), key(1)], objs)
        bm = wait(lambda: ad.query_load_result(tid))
        assert [bm.test(i) for i in range(2)] == [False, False]
        l1.finish_write([key(0)], tag="test")
        l1.delete([key(0)], force=True)
    finally:
        ad.close()


def test_a_serde_load_into_a_buffer_without_memory_is_a_miss(tmp_path, tenant):
    """A serde's bytes loaded into a ``meta`` buffer: copy_ wrote nothing and the load counted a hit. Now a miss."""
    from lmc import wait

    class Obj:
        def __init__(self, t):
            self.tensor = t
            self.byte_array = t.numpy().tobytes() if t.device.type != "meta" else b""

    ad = KvcodecStoreL2Adapter({"store_url": str(tmp_path / "s"), "key_file": tenant, "models": MODELS})
    try:
        src = Obj(torch.arange(64, dtype=torch.uint8))
        tid = ad.submit_store_task([key(0)], [src])
        assert wait(lambda: ad.pop_completed_store_tasks().get(tid)).is_successful()
        for dst, hit in ((torch.zeros(64, dtype=torch.uint8), True), (torch.empty(64, dtype=torch.uint8, device="meta"), False)):
            tid = ad.submit_load_task([key(0)], [Obj(dst)])
            assert wait(lambda: ad.query_load_result(tid)).test(0) is hit
    finally:
        ad.close()


def test_params_that_are_not_an_object_are_one_line():
    """adapter_params or serde options left a JSON string: dict() escaped as ValueError for the adapter, and the
    serde named each character an unknown option; now one KvcInputError line that says what they must be."""
    from kvcodec.integrations.lmcache.serde import parse_options

    for call in (lambda: KvcodecStoreL2Adapter('{"store_url": "/tmp/x"}'), lambda: parse_options('{"preset": "x"}')):
        with pytest.raises(KvcError, match="must be an object"):
            call()
