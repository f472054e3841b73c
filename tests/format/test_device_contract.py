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


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = torch.Tensor.as_subclass(t, torch.Tensor).cpu()
    return t.view(torch.int16 if t.dtype != torch.float32 else torch.int32)


@pytest.mark.parametrize("preset", ["lossless", "balanced"])
@pytest.mark.parametrize("chunking", [{}, {"chunk_tokens": 8, "chunk_heads": 1}])
def test_reader_keeps_gpu_chunks_on_the_device(small_cache, preset, chunking, device_chunks):
    """Every layer read (read_layer) and the whole cache (read_cache) stay device tensors, bit for bit the CPU decode.

    read_cache is read_layer over every layer, and a layer is assembled from its decoded chunks the same way
    whatever codec made them (``KvcReader._read_tensor``). So the whole cache is read for ``lossless`` and, for
    ``balanced`` (whose 60 transform-codec tensors took 65-73 s per case under the Triton interpreter), the
    first and last layers: they exercise that codec's kernels and the same assembly.
    """
    from kvcodec.plan.presets import get_plan

    cache = small_cache.prefix(24)
    buf = io.BytesIO()
    write_kvc(cache, buf, get_plan(preset, cache), **chunking)
    layers = (0, cache.num_layers - 1)
    with KvcReader(buf.getvalue()) as cpu_r:
        want = [t for i in layers for t in cpu_r.read_layer(i, backend="cpu")]
        if preset == "lossless":
            whole = cpu_r.read_cache(backend="cpu")
            want += whole.keys + whole.values
    with KvcReader(buf.getvalue()) as r:
        got = [t for i in layers for t in r.read_layer(i, backend="gpu")]
        if preset == "lossless":
            whole = r.read_cache(backend="gpu")
            got += whole.keys + whole.values
    assert len(got) == len(want) > 0
    assert all(type(t) is DeviceOnly for t in got)
    for a, b in zip(want, got):  # bit for bit the CPU decode
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_bits(a), _bits(b))


def test_the_stand_in_catches_a_host_round_trip(small_cache, device_chunks):
    """The stand-in is not vacuous: numpy assembly (what the reader did before) fails on it."""
    x = torch.zeros(2, 3).as_subclass(DeviceOnly)
    with pytest.raises(TypeError):
        np.concatenate([x, x], axis=0)
    with pytest.raises(TypeError):
        np.ascontiguousarray(x)
