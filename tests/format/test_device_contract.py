"""The device contract: a chunk decoded on the GPU stays a device tensor through the reader; nothing
converts it to numpy or copies it to the host on the way.

No GPU here: the GPU path runs the real Triton kernels under the interpreter (tests/conftest.py), whose
tensors live on the CPU, so numpy would accept them and hide a host round trip. A stand-in device tensor
(a torch.Tensor subclass that refuses every conversion to numpy) makes any such conversion fail.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from kvcodec.format import KvcReader, write_kvc

pytestmark = pytest.mark.triton


class DeviceOnly(torch.Tensor):
    """A tensor that, like a CUDA tensor, cannot be turned into a numpy array."""

    def numpy(self, *a, **k):  # type: ignore[override]
        raise TypeError("can't convert a device tensor to numpy (stand-in)")

    def __array__(self, *a, **k):
        raise TypeError("can't convert a device tensor to numpy (stand-in)")


@pytest.fixture
def device_chunks(monkeypatch):
    """Every chunk the GPU path decodes comes back as a DeviceOnly tensor."""
    pytest.importorskip("triton")
    from kvcodec.decode.device import resolve_device
    from kvcodec.format import reader

    real = reader.decode_chunk

    def decode(*a):
        out = real(*a)
        if resolve_device(a[-1]) != "gpu":
            return out
        assert isinstance(out, torch.Tensor), "the GPU path must return torch tensors"
        return out.as_subclass(DeviceOnly)

    monkeypatch.setattr(reader, "decode_chunk", decode)


@pytest.mark.parametrize("preset", ["lossless", "balanced"])
@pytest.mark.parametrize("chunking", [{}, {"chunk_tokens": 8, "chunk_heads": 1}])
def test_reader_keeps_gpu_chunks_on_the_device(small_cache, preset, chunking, device_chunks):
    from kvcodec.plan.presets import get_plan

    cache = small_cache.prefix(24)
    buf = io.BytesIO()
    write_kvc(cache, buf, get_plan(preset, cache), **chunking)
    with KvcReader(buf.getvalue()) as cpu_r:
        want = cpu_r.read_cache(backend="cpu")
    with KvcReader(buf.getvalue()) as r:
        k, v = r.read_layer(1, backend="gpu")
        got = r.read_cache(backend="gpu")
    assert type(k) is DeviceOnly and type(v) is DeviceOnly
    assert all(type(t) is DeviceOnly for t in got.keys + got.values)
    for a, b in zip(want.keys + want.values, got.keys + got.values):  # bit for bit the CPU decode
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.view(torch.int16 if a.dtype != torch.float32 else torch.int32),
                           torch.Tensor.as_subclass(b, torch.Tensor).cpu()
                           .view(torch.int16 if b.dtype != torch.float32 else torch.int32))


def test_the_stand_in_catches_a_host_round_trip(small_cache, device_chunks):
    """The stand-in is not vacuous: numpy assembly (what the reader did before) fails on it."""
    x = torch.zeros(2, 3).as_subclass(DeviceOnly)
    with pytest.raises(TypeError):
        np.concatenate([x, x], axis=0)
    with pytest.raises(TypeError):
        np.ascontiguousarray(x)
