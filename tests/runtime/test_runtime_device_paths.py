"""The device contract through CacheBlend and adaptive streaming (issue 36).

Chunks decoded on the GPU stay on the GPU: CacheBlend places, re-rotates and recomputes them on the
model's device and copies only per-token results (selected positions, deviations) to the host; the
streamer appends each level chunk's layers, as decoded, to a cache on the model's device.

No GPU here: the GPU decoders run the real Triton kernels under the interpreter on CPU tensors, and a
stand-in device tensor (tests/_support/device_standin.py) makes every numpy conversion fail and records
every host copy. Each check also runs with a host round trip injected into its path and must fail then.
On a CUDA machine (benchmarks/gpu_check.py, ``TRITON_INTERPRET=0``) the same tests use real device tensors.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from device_standin import (  # noqa: F401 - device_decode, device_lm, gpu_dev: pytest fixtures, used by name
    DeviceOnly, device_decode, device_lm, gpu_dev, host_copies, plain, round_trip)

from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.integrations import hf
from kvcodec.plan.presets import get_plan
from kvcodec.runtime import blend as blend_mod

pytestmark = [pytest.mark.triton, pytest.mark.model]




def _decoded(cache, backend: str):
    """``cache`` through a lossless `.kvc`, decoded by ``backend`` (the GPU path: stand-in device tensors)."""
    with KvcReader(encode_kvc_bytes(cache, get_plan("lossless", cache))) as r:
        return r.read_cache(backend=backend)


# ----------------------------------------------------------------------------------------------- CacheBlend
def check_blend(lm, dlm, gpl3_ids, real_cache, dev) -> None:
    """Two chunk caches decoded on the GPU path, blended on ``dlm``'s device at a partial ratio: the same
    selection, logits and cache as blending the host-decoded chunks there; the blended cache stays a device
    tensor; only per-token vectors went to the host."""
    from kvcodec.models.capture import capture

    a, b = real_cache(24), capture(lm, token_ids=gpl3_ids[24:40])  # two chunks, each captured from position 0
    chunks_gpu = [_decoded(a, "gpu"), _decoded(b, "gpu")]
    assert all(type(k) is DeviceOnly for c in chunks_gpu for k in c.keys)
    chunks_ref = [_decoded(a, "cpu"), _decoded(b, "cpu")]
    q = gpl3_ids[100:104]
    host_copies().clear()
    got = blend_mod.blend(dlm, chunks_gpu, q, recompute_ratio=0.5)
    copies = host_copies().largest
    want = blend_mod.blend(dlm, chunks_ref, q, recompute_ratio=0.5)
    assert np.array_equal(got.selected, want.selected) and np.array_equal(got.deviation, want.deviation)
    assert torch.equal(plain(got.logits_last), plain(want.logits_last))
    for x, y in zip(got.cache.keys + got.cache.values, want.cache.keys + want.cache.values):
        assert type(x) is DeviceOnly, f"the blended cache left the device path ({type(x).__name__})"
        assert x.device == dev and torch.equal(plain(x), plain(y))
    n_ctx = got.num_context_tokens
    assert copies <= n_ctx, f"more than per-token vectors went to the host: {host_copies().copies}"
    toks = blend_mod.continue_from(dlm, got, 3)
    assert toks == blend_mod.continue_from(dlm, want, 3)


def test_blend_keeps_decoded_chunks_on_the_device(lm, device_lm, gpl3_ids, real_cache, device_decode, gpu_dev):  # noqa: F811
    check_blend(lm, device_lm, gpl3_ids, real_cache, gpu_dev)


@pytest.mark.parametrize("how,error", [("numpy", "stand-in"), ("cpu", "left the device path|per-token")])
def test_the_blend_check_fails_on_a_hostround_trip(lm, device_lm, gpl3_ids, real_cache, device_decode, gpu_dev, monkeypatch,  # noqa: F811
                                                    how, error):
    monkeypatch.setattr(blend_mod, "land", round_trip(how))
    with pytest.raises((TypeError, AssertionError), match=error):
        check_blend(lm, device_lm, gpl3_ids, real_cache, gpu_dev)


def test_blend_reads_back_only_per_token_vectors(lm, device_lm, gpl3_ids, real_cache, device_decode, gpu_dev, monkeypatch):  # noqa: F811
    """The selection's scores are read back with an explicit copy (``.cpu()``): a bare ``.numpy()`` on them,
    which a CUDA tensor refuses, fails here too."""
    real = torch.Tensor.cpu
    monkeypatch.setattr(DeviceOnly, "cpu", lambda self, *a, **k: plain(real(self)) if self.dim() == 0 else self)
    with pytest.raises(TypeError, match="stand-in|numpy"):
        check_blend(lm, device_lm, gpl3_ids, real_cache, gpu_dev)


# ----------------------------------------------------------------------------------------------- streaming
N = 256


@pytest.fixture(scope="module")
def level_entry(lm, gpl3_ids, real_cache, tmp_path_factory):
    from kvcodec.runtime.level_encode import encode_levels
    from kvcodec.store import Store

    d = tmp_path_factory.mktemp("device-levels") / "store"
    ids = gpl3_ids[:N]
    with Store.open(str(d)) as st:
        encode_levels(lm, st, ids, ["lossless"], cache=real_cache(N))
    return d, ids


def check_stream(lm, dlm, level_entry, dev) -> None:
    """A lossless level streamed with the GPU decoders onto ``dlm``'s device: every layer a device tensor,
    bit for bit what the CPU decoders give, nothing copied to the host."""
    from kvcodec.runtime.stream import AdaptiveStreamer
    from kvcodec.store import Store

    d, ids = level_entry
    with Store.open(str(d)) as st:
        host_copies().clear()
        got = AdaptiveStreamer(dlm, st, fixed="lossless", backend="gpu").load(ids, budget_s=None)
        copies = host_copies().copies
    with Store.open(str(d)) as st:
        want = AdaptiveStreamer(dlm, st, fixed="lossless", backend="cpu").load(ids, budget_s=None)
    assert [c.choice for c in got.report.chunks] == ["lossless"]
    for lg, lw in zip(got.cache.layers, want.cache.layers):
        for x, y in ((lg.keys, lw.keys), (lg.values, lw.values)):
            assert type(x) is DeviceOnly, f"a streamed layer left the device path ({type(x).__name__})"
            assert x.device == dev and torch.equal(plain(x), plain(y))
    assert not copies, f"host copies on the device path: {copies}"


def test_stream_keeps_level_chunks_on_the_device(lm, device_lm, level_entry, device_decode, gpu_dev):  # noqa: F811
    check_stream(lm, device_lm, level_entry, gpu_dev)


@pytest.mark.parametrize("how,error", [("numpy", "stand-in"), ("cpu", "left the device path")])
def test_the_stream_check_fails_on_a_hostround_trip(lm, device_lm, level_entry, device_decode, gpu_dev, monkeypatch, how,  # noqa: F811
                                                     error):
    monkeypatch.setattr(hf, "land", round_trip(how))
    with pytest.raises((TypeError, AssertionError), match=error):
        check_stream(lm, device_lm, level_entry, gpu_dev)


def test_stream_decodes_where_the_model_lives(lm, device_lm, monkeypatch):  # noqa: F811
    """By default the streamer decodes on the model's device: the CPU decoders for a CPU model (as before)."""
    from kvcodec.runtime.stream import AdaptiveStreamer

    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    for model in (lm, device_lm):
        s = AdaptiveStreamer(model, store=None, fixed="lossless")  # type: ignore[arg-type]
        assert s.device == hf.model_device(model) and s.backend == hf.decode_device(s.device)
    assert AdaptiveStreamer(lm, store=None).backend == "cpu"  # type: ignore[arg-type]
