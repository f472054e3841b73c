"""The device contract through the HF loader and the vLLM connector's loader (issue 36).

A cache decoded on the GPU stays on the GPU: the HF loader leaves each layer on the model's device as the
decoder produced it, and the vLLM connector decodes a chunk entry straight into the engine's paged blocks
(``decode_chunk_into``), neither through numpy nor through a staging copy on the host.

No GPU here: the GPU decoders run the real Triton kernels under the interpreter (tests/conftest.py) on CPU
tensors, so a stand-in device tensor (tests/_support/device_standin.py: numpy conversions fail, host copies
are recorded) shows any host round trip. Each check also runs with a round trip injected into its path and
must fail then. Under ``TRITON_INTERPRET=0`` on a CUDA machine (benchmarks/gpu_check.py) the same tests run
with real device tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_standin import (  # noqa: F401 - device_decode, device_lm, gpu_dev: pytest fixtures, used by name
    DeviceOnly, as_device, device_decode, device_lm, gpu_dev, host_copies, plain, round_trip)

from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.kvcache import KVCache
from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.integrations import hf
from kvcodec.integrations.vllm.entries import (
    block_table,
    decode_chunk_layers,
    encode_chunk,
    paged_views,
    write_paged_layer,
)
from kvcodec.plan.presets import get_plan

pytestmark = pytest.mark.triton




# ----------------------------------------------------------------------------------------------- HF loader
def check_hf(lm, dlm, cache, dev) -> None:
    """The HF loader on the GPU path: every layer a device tensor on ``dlm``'s device, bit for bit the CPU
    decode, the same greedy tokens, nothing copied to the host."""
    cache = cache.prefix(24)
    data = encode_kvc_bytes(cache, get_plan("lossless", cache))
    ref = hf.load_cache(data, dlm, backend="cpu")  # decoded on the host, moved once: the reference values
    got = hf.load_cache(data, dlm, backend="gpu")
    for lr, lg in zip(ref.cache.layers, got.cache.layers):
        lr.materialize()
        lg.materialize()
        for a, b in ((lr.keys, lg.keys), (lr.values, lg.values)):
            assert type(b) is DeviceOnly, f"a layer left the device path ({type(b).__name__})"
            assert b.device == dev and b.dtype == a.dtype and b.shape == a.shape
            assert torch.equal(plain(a), plain(b))
    q = [int(t) for t in cache.token_ids[:3]]
    want = hf.greedy_from(dlm, ref.cache, ref.next_position, q, 4)[0]
    assert hf.greedy_from(dlm, got.cache, got.next_position, q, 4)[0] == want
    assert host_copies().largest == 0, f"host copies on the device path: {host_copies().copies}"


@pytest.mark.model
def test_hf_loader_keeps_the_cache_on_the_device(lm, device_lm, small_cache, device_decode, gpu_dev):  # noqa: F811
    check_hf(lm, device_lm, small_cache, gpu_dev)


@pytest.mark.model
@pytest.mark.parametrize("how,error", [("numpy", "stand-in"), ("cpu", "left the device path")])
def test_the_hf_check_fails_on_a_hostround_trip(lm, device_lm, small_cache, device_decode, gpu_dev, monkeypatch, how, error):  # noqa: F811
    monkeypatch.setattr(hf, "land", round_trip(how))
    with pytest.raises((TypeError, AssertionError), match=error):
        check_hf(lm, device_lm, small_cache, gpu_dev)


@pytest.mark.model
def test_hf_loader_decodes_where_the_model_lives(lm, device_lm, small_cache, device_decode, gpu_dev, monkeypatch):  # noqa: F811
    """By default the cache lands on the model's device and is decoded there: a CPU model keeps the CPU
    decoders (today's behaviour: numpy chunks, no GPU involved); a CUDA model gets the GPU decoders."""
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    cache = small_cache.prefix(16)
    data = encode_kvc_bytes(cache, get_plan("lossless", cache))
    seen: list[str] = []
    real = KvcReader.read_layer

    def read_layer(self, i, backend=None, **kw):  # kw: the loader's apply_bias (spec/kvc-v1.md 4.6)
        seen.append(backend)
        return real(self, i, backend, **kw)

    monkeypatch.setattr(KvcReader, "read_layer", read_layer)
    wanted = hf.load_cache(data, lm, backend="cpu").cache.layers
    for each in wanted:  # all of them, so its background decoder adds nothing to `seen` below
        each.materialize()
    want = wanted[0]
    for model in (lm, device_lm):
        seen.clear()
        layers = hf.load_cache(data, model).cache.layers
        for each in layers:  # all of them: the loader's background decoder is then done with this model
            each.materialize()
        layer = layers[0]
        where = hf.decode_device(hf.model_device(model))
        assert set(seen) == {where} and layer.keys.device == hf.model_device(model)
        assert (type(layer.keys) is DeviceOnly) == (where == "gpu")
        assert torch.equal(plain(layer.keys).cpu(), want.keys)
    assert hf.decode_device("cpu") == "cpu" and hf.decode_device("cpu", "gpu") == "gpu"


# ----------------------------------------------------------------------------------------------- vLLM connector
FP = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, config_sha256="d" * 64)
BS = 16


class _FlashLayer:
    """A fake attention layer whose cache-update op writes vLLM's standard layout (FlashAttention's
    reshape_and_cache_flash): kv_cache (2, num_blocks, block_size, H, D), token slot s at [*, s // bs, s % bs]."""

    class impl:
        @staticmethod
        def do_kv_cache_update(layer, k, v, kv_cache, slots):
            kc, vc = kv_cache.unbind(0)
            b, o = slots // kc.shape[1], slots % kc.shape[1]
            kc[b, o] = k
            vc[b, o] = v


class _ShuffledLayer:
    """Standard shape, but the op stores heads in reverse: a direct write would be wrong, so no views."""

    class impl:
        @staticmethod
        def do_kv_cache_update(layer, k, v, kv_cache, slots):
            _FlashLayer.impl.do_kv_cache_update(layer, k.flip(1), v.flip(1), kv_cache, slots)


def _kv(T: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return ([torch.randn(3, T, 64, generator=g) for _ in range(2)], [torch.randn(3, T, 64, generator=g) for _ in range(2)])


def _chain_entry(ids: list[int], start: int, end: int, seed: int = 0) -> bytes:
    """A chunk entry under a transform-codec chain (rope, keep, hadamard, quantize(step), rans): the fused
    kernel's pipeline, written in 8-token chunks."""
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rans import RansStage
    from kvcodec.codecs.rope import RopeStage
    from kvcodec.codecs.rope_tables import rope_config_from_fingerprint
    from kvcodec.codecs.transform import TransformStage
    from kvcodec.core.stage import Pipeline

    ks, vs = _kv(end - start, seed)
    tail = [TransformStage(basis="hadamard"), QuantizeStage(mode="step", step=0.3, max_bits=8), RansStage(channel_group=8)]
    pipes = {"k": Pipeline([RopeStage(**rope_config_from_fingerprint(FP.rope, 64)), KeepStage(sink=2)] + tail),
             "v": Pipeline([KeepStage(sink=2)] + tail)}
    cache = KVCache(ks, vs, np.asarray(ids[:end], dtype=np.int64), FP, np.arange(start, end, dtype=np.int64) if start else None)
    return encode_kvc_bytes(cache, lambda layer, kind: pipes[kind], chunk_tokens=8)


def _paged(blocks: int, hnd: bool = False, device: torch.device | str = "cpu") -> torch.Tensor:
    """A stand-in paged cache (2, blocks, BS, 3, 64) on ``device``: NHD (contiguous) or HND (heads outside
    tokens, vLLM's other stride order) in memory."""
    if hnd:
        return as_device(torch.zeros(2, blocks, 3, BS, 64, device=device).permute(0, 1, 3, 2, 4))
    return as_device(torch.zeros(2, blocks, BS, 3, 64, device=device))


def _slots(block_ids: list[int], start: int, end: int) -> torch.Tensor:
    t = torch.arange(start, end)
    return torch.tensor(block_ids)[t // BS] * BS + t % BS


def _forbidden(*a, **k):
    raise AssertionError("the direct path decoded a layer to a staging tensor")


def check_connector(data: bytes, ids: list[int], cs: int, ce: int, start: int, dev: torch.device, hnd: bool = False) -> int:
    """Load entry ``data`` (tokens [cs, ce) of the prefix) for tokens [start, ce) both ways: straight into the
    paged blocks (the GPU path) and through the staging path's decode + the backend's op (the reference).
    The blocks must be equal bit for bit, the direct path must stage nothing and copy nothing to the host."""
    used = -(-ce // BS)
    nb = used + 3
    block_ids = list(range(nb))[::-1][:used]  # the request's blocks, out of order, three others left alone
    slots = _slots(block_ids, start, ce)
    layers = 0
    for i, k, v in decode_chunk_layers(KvcReader(data), cs, ce, "cpu"):
        lo = max(start - cs, 0)
        ref = torch.zeros(2, nb, BS, 3, 64)
        _FlashLayer.impl.do_kv_cache_update(_FlashLayer, k[lo:], v[lo:], ref, slots)
        got = _paged(nb, hnd=hnd, device=dev)  # the engine's paged cache, on the GPU decoders' device
        views = paged_views(_FlashLayer, got, BS, 3, 64)
        assert views is not None and type(views[0]) is DeviceOnly
        table = block_table(slots, start, ce, BS, got.device)
        with KvcReader(data) as r:
            r.read_layer = r.read_chunk = r.iter_layers = _forbidden  # the direct path decodes into the blocks only
            write_paged_layer(r, i, views, table, cs, ce, start)
        assert type(got) is DeviceOnly
        assert torch.equal(plain(got).cpu(), ref), f"layer {i}: the direct write differs from the backend op's"
        layers += 1
    assert host_copies().largest == 0, f"host copies on the direct path: {host_copies().copies}"
    return layers


@pytest.mark.parametrize("start", [256, 384, 392])
def test_connector_decodes_a_chunk_entry_into_the_paged_blocks(start, device_decode, gpu_dev):  # noqa: F811
    """A lossless entry (the byte stages on the host, the compressed bytes' values stored by the layout kernel)
    for a whole chunk, for its second half (vLLM's prefix cache had the first) and from mid-block."""
    ids = list(range(100, 612))
    ks, vs = _kv(256, 0)
    data = encode_chunk(FP, "lossless", ids, 256, 512, ks, vs)
    assert check_connector(data, ids, 256, 512, start, gpu_dev) == 2


@pytest.mark.parametrize("start,hnd", [(0, False), (12, True)])
def test_connector_fused_kernel_writes_the_blocks(start, hnd, device_decode, gpu_dev):  # noqa: F811
    """The lossy presets' chain: the fused kernel decodes each chunk into the blocks (a chunk before ``start``
    is skipped, one straddling it stored from its first wanted token, one whole after it); both stride orders.
    Three 8-token chunks: each chunk is a kernel launch, and the Triton interpreter runs a launch in seconds."""
    ids = list(range(7, 7 + 24))
    data = _chain_entry(ids, 0, 24)
    assert check_connector(data, ids, 0, 24, start, gpu_dev, hnd=hnd) == 2


def test_the_connector_check_fails_on_a_hostround_trip(device_decode, gpu_dev, monkeypatch):  # noqa: F811
    """Decoding into the blocks through numpy (a staging copy on the host) fails the check."""
    import kvcodec.decode.triton.backend as backend
    from kvcodec.decode.registry import decode_chunk_gpu as real

    def staged(pipeline, payload, sides, sizes, spec, ctx, dst, token_start=0, block_table=None, trace=None):
        from kvcodec.decode.triton.dequant_kernels import store_paged

        x = np.asarray(as_device(real(pipeline, payload, sides, sizes, spec, ctx)))  # to the host...
        store_paged(torch.from_numpy(x).to(dst.device), dst, block_table, token_start)  # ...and back

    monkeypatch.setattr(backend, "decode_chunk_into", staged)
    ids = list(range(100, 612))
    ks, vs = _kv(256, 0)
    with pytest.raises(TypeError, match="stand-in"):
        check_connector(encode_chunk(FP, "lossless", ids, 256, 512, ks, vs), ids, 256, 512, 256, gpu_dev)


def test_paged_views_only_for_a_layout_the_backend_op_confirms():
    kv = torch.zeros(2, 4, BS, 3, 64)
    views = paged_views(_FlashLayer, kv, BS, 3, 64)
    assert views is not None and views[0].data_ptr() == kv[0].data_ptr() and views[1].data_ptr() == kv[1].data_ptr()
    assert paged_views(_FlashLayer, _paged(4, hnd=True), BS, 3, 64) is not None
    assert paged_views(_ShuffledLayer, kv, BS, 3, 64) is None  # same shape, another placement
    assert paged_views(_FlashLayer, torch.zeros(4, 3, BS, 128), BS, 3, 64) is None  # vLLM-CPU's kind of layout
    assert paged_views(_FlashLayer, torch.zeros(2, 4, BS, 3, 32), BS, 3, 64) is None


def test_block_table_marks_positions_not_to_write():
    slots = _slots([5, 2, 7], 20, 40)
    bt = block_table(slots, 20, 40, BS, torch.device("cpu"))
    assert bt.dtype == torch.int32 and bt.tolist() == [-1, 2, 7]  # positions 0..19 are not written
    assert block_table(_slots([5, 2, 7], 0, 48), 0, 48, BS, torch.device("cpu")).tolist() == [5, 2, 7]
