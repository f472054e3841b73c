"""Pure-python parts of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcInputError
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.format import KvcReader
from kvcodec.store import Store, StoreKey
from kvcodec.store.keys import codec_key
from kvcodec.integrations.vllm.config import (
    ConnectorConfig, chunk_keys, leading_run, lookup_prefix, matchable_tokens, savable_tokens,
)
from kvcodec.integrations.vllm.entries import check_entry, decode_chunk_layers, encode_chunk, learn_gather_map

FP = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, config_sha256="d" * 64)
OTHER = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0}', "a" * 64, "c" * 64, config_sha256="d" * 64)


def test_config_defaults_and_errors():
    c = ConnectorConfig.from_extra({"store_url": "/tmp/x"})
    assert (c.preset, c.namespace, c.chunk_tokens, c.save, c.load) == (None, "default", 256, True, True)
    with pytest.raises(KvcInputError, match="start-up"):  # the default is resolved from the model, at start-up
        _ = c.codec_id
    assert ConnectorConfig.from_extra({"store_url": "/tmp/x", "memory_bytes": "1M"}).memory_bytes == 1 << 20
    c = ConnectorConfig.from_extra({"store_url": "/tmp/x", "preset": "lossless"})
    assert c.codec_id == codec_key("lossless")
    for bad, word in [({}, "store_url"), ({"store_url": " "}, "store_url"), ({"store_url": "x", "preset": "nope"}, "preset"),
                      ({"store_url": "x", "namespace": "a b"}, "namespace"), ({"store_url": "x", "chunk_tokens": 0}, "chunk_tokens"),
                      ({"store_url": "x", "save": "maybe"}, "save"), ({"store_url": "x", "stor_url": "y"}, "unknown"),
                      # JSON's 1e999 and a float past int64: before, an OverflowError traceback / a 300-digit chunk size
                      ({"store_url": "x", "chunk_tokens": float("inf")}, "chunk_tokens"),
                      ({"store_url": "x", "min_load_tokens": float("-inf")}, "min_load_tokens"),
                      ({"store_url": "x", "chunk_tokens": 1e300}, "chunk_tokens"),
                      # a multiple of every block size: the start-up probe allocated [0] * 10**12 before
                      ({"store_url": "x", "chunk_tokens": 10**12}, "chunk_tokens"),
                      # before, an unhashable-type TypeError when the store opened at start-up
                      ({"store_url": "x", "memory_bytes": [1]}, "memory_bytes"),
                      ({"store_url": "x", "memory_bytes": {"a": 1}}, "memory_bytes")]:
        with pytest.raises(KvcInputError, match=word):
            ConnectorConfig.from_extra(bad)
    c.check_block_size(128)
    c.check_block_size(16)
    with pytest.raises(KvcInputError, match="multiple of vLLM's block size"):
        c.check_block_size(96)


def test_block_alignment():
    C = 256
    assert matchable_tokens(0, C) == 0 and matchable_tokens(1, C) == 0
    assert matchable_tokens(256, C) == 0          # keep >= 1 token to compute
    assert matchable_tokens(257, C) == 256
    assert matchable_tokens(600, C) == 512
    assert matchable_tokens(768, C) == 512
    assert savable_tokens(255, C) == 0 and savable_tokens(256, C) == 256 and savable_tokens(600, C) == 512


def test_chunk_keys_are_store_prefix_keys():
    ids = list(range(1000, 1700))
    ks = chunk_keys(ids, 512, model="m1", codec="lossless", namespace="t", chunk_tokens=256)
    assert [k.n_tokens for k in ks] == [256, 512]
    for k in ks:  # chunk i's key is the ordinary store key of the prefix ids[:i*C]
        assert k == StoreKey.for_tokens(ids[: k.n_tokens], model="m1", codec="lossless", namespace="t")
    other_ns = chunk_keys(ids, 512, model="m1", codec="lossless", namespace="u", chunk_tokens=256)
    other_model = chunk_keys(ids, 512, model="m2", codec="lossless", namespace="t", chunk_tokens=256)
    assert not {k.digest for k in ks} & {k.digest for k in other_ns + other_model}
    with pytest.raises(KvcInputError):
        chunk_keys(ids, 300, model="m1", codec="lossless", namespace="t", chunk_tokens=256)


def test_lookup_prefix_needs_a_leading_run(tmp_path):
    assert leading_run([True, True, False, True]) == 2 and leading_run([]) == 0
    ids = list(range(5, 1100))
    kw = dict(model="m1", codec="lossless", namespace="t", chunk_tokens=256)
    ks = chunk_keys(ids, 1024, **kw)
    with Store.open(str(tmp_path)) as st:
        assert lookup_prefix(st, ids, max_tokens=1094, **kw) == (0, [])
        st.put(ks[0], b"x")
        st.put(ks[2], b"x")  # chunk 3 without chunk 2 is useless
        n, keys = lookup_prefix(st, ids, max_tokens=1094, **kw)
        assert n == 256 and keys == ks[:1]
        st.put(ks[1], b"x")
        assert lookup_prefix(st, ids, max_tokens=1094, **kw)[0] == 768
        assert lookup_prefix(st, ids, max_tokens=600, **kw)[0] == 512


def _chunk_kv(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(3, T, 64, generator=g) for _ in range(2)]
    vs = [torch.randn(3, T, 64, generator=g) for _ in range(2)]
    return ks, vs


@pytest.mark.parametrize("preset", ["lossless", "zstd"])
def test_chunk_entry_roundtrip_and_checks(preset):
    ids = list(range(100, 612))
    ks, vs = _chunk_kv(256)
    data = encode_chunk(FP, preset, ids, 256, 512, ks, vs)
    r = KvcReader(data)
    assert check_entry(r, FP, ids, 256, 512) is None
    assert np.array_equal(r.positions, np.arange(256, 512))
    for i, k, v in decode_chunk_layers(r, 256, 512):  # [T, H, D]
        assert torch.equal(k, ks[i].transpose(0, 1)) and torch.equal(v, vs[i].transpose(0, 1))
    # a later part of the chunk (vLLM's own prefix cache covered the start)
    for i, k, _v in decode_chunk_layers(KvcReader(data), 384, 512):
        assert torch.equal(k, ks[i].transpose(0, 1)[128:])
    # never served to another model, another prefix, or another chunk
    assert "another model" in check_entry(KvcReader(data), OTHER, ids, 256, 512)
    bad = list(ids)
    bad[3] += 1
    assert "token ids" in check_entry(KvcReader(data), FP, bad, 256, 512)
    assert check_entry(KvcReader(data), FP, ids + [1] * 256, 512, 768) is not None


def test_first_chunk_and_whole_prefix_entries():
    ids = list(range(7, 519))
    ks, vs = _chunk_kv(256)
    first = KvcReader(encode_chunk(FP, "lossless", ids, 0, 256, ks, vs))
    assert first.positions is None and check_entry(first, FP, ids, 0, 256) is None
    # a whole-prefix cache (e.g. stored by another kvcodec tool) also serves its last chunk
    kw, vw = _chunk_kv(512, seed=1)
    whole = encode_chunk(FP, "lossless", ids, 0, 512, kw, vw)
    assert check_entry(KvcReader(whole), FP, ids, 256, 512) is None
    for i, _k, v in decode_chunk_layers(KvcReader(whole), 256, 512):
        assert torch.equal(v, vw[i].transpose(0, 1)[256:])


class _TiledLayer:
    """A fake attention layer whose cache update packs K and V in 16x16 tiles, transposed (like a CPU backend)."""

    class impl:
        @staticmethod
        def do_kv_cache_update(layer, k, v, kv_cache, slots):
            nb, H, bs, d2 = kv_cache.shape
            D = d2 // 2
            view = kv_cache.view(nb, H, bs * 2, D)
            kc, vc = view[:, :, :bs], view[:, :, bs:]
            for t, s in enumerate(slots.tolist()):
                b, o = divmod(s, bs)
                for h in range(H):
                    # keys: tile (o//16, d//16) stored transposed inside the block's key half
                    blk = kc[b, h].reshape(bs // 16, D // 16, 16, 16)
                    blk[o // 16, :, :, o % 16] = k[t, h].reshape(D // 16, 16)
                    vc[b, h, o] = v[t, h]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layout_probe_inverts_a_tiled_layout(dtype):
    bs, H, D = 32, 3, 64
    kv = torch.zeros(4, H, bs, 2 * D, dtype=dtype)
    gk, gv = learn_gather_map(_TiledLayer, kv, bs, H, D)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(70, H, D, generator=g).to(dtype)
    v = torch.randn(70, H, D, generator=g).to(dtype)
    slots = torch.cat([torch.arange(96, 128), torch.arange(32, 64), torch.arange(64, 70)])
    _TiledLayer.impl.do_kv_cache_update(_TiledLayer, k, v, kv, slots)
    flat = kv.reshape(4, -1)
    b, o = slots // bs, slots % bs
    assert torch.equal(flat[b[:, None, None], gk[o]], k)
    assert torch.equal(flat[b[:, None, None], gv[o]], v)


class _LossyLayer:
    class impl:
        @staticmethod
        def do_kv_cache_update(layer, k, v, kv_cache, slots):
            kv_cache.view(-1)[: k.numel()] = (k.reshape(-1) * 0.5)


def test_layout_probe_refuses_a_non_copy_op():
    kv = torch.zeros(1, 1, 32, 128)
    with pytest.raises(KvcInputError):
        learn_gather_map(_LossyLayer, kv, 32, 1, 64)


@pytest.mark.model
def test_fingerprint_from_dir_equals_fingerprint_model(lm):
    from kvcodec.models.load import resolve_model_dir
    from kvcodec.integrations.vllm.config import fingerprint_from_dir

    fp = fingerprint_from_dir(resolve_model_dir("smollm2"), tokenizer=lm.tokenizer)
    assert fp == lm.fingerprint and fp.id == lm.fingerprint.id


def test_a_narrowing_load_refuses_values_past_the_engine_dtype():
    """An entry shared across dtypes (float32 or bfloat16 from ``kvc`` / HF) loading into a float16 engine: a finite
    value past 65504 became inf in the engine's cache, silently (the staged path's plain cast). Now the chunk is
    refused (the connector counts it a miss); values in range, widening casts and equal dtypes pass unchanged."""
    from kvcodec.integrations.vllm.entries import for_cache

    kv16 = torch.zeros(2, 4, dtype=torch.float16)
    for src in (torch.tensor([[1.0, 70000.0]]), torch.tensor([[1.0, 70000.0]]).to(torch.bfloat16)):
        with pytest.raises(KvcInputError, match="past float16's range"):
            for_cache(src, kv16)
    ok = torch.tensor([[1.5, -65504.0]])
    assert torch.equal(for_cache(ok, kv16), ok.to(torch.float16))
    inf = torch.tensor([[float("inf"), 1.0]])  # an inf that was already there is the entry's own, not the cast's
    assert torch.isinf(for_cache(inf, kv16)).sum() == 1
    big16 = torch.tensor([[60000.0]], dtype=torch.float16)
    assert for_cache(big16, torch.zeros(1, dtype=torch.float32)).dtype == torch.float32
    assert for_cache(big16, kv16) is not None


@pytest.mark.parametrize("extra", ['{"store_url": "/tmp/x"}', [("store_url", "/tmp/x")], 5], ids=["json-str", "pairs", "int"])
def test_an_extra_config_that_is_not_an_object_is_one_line(extra):
    """kv_connector_extra_config left a JSON string escaped as ValueError, a number as TypeError, and a list of
    pairs was taken as the config; now one KvcInputError line."""
    with pytest.raises(KvcInputError, match="must be an object"):
        ConnectorConfig.from_extra(extra)
