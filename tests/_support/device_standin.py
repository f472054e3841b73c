"""A stand-in for a GPU tensor, so the Triton-interpreter tests catch a host round trip without a GPU.

Under ``TRITON_INTERPRET=1`` the "GPU" decoders run the real Triton kernels on CPU tensors, so numpy
would accept their results and a device -> host -> device round trip would go unnoticed (it fails, or
costs a PCIe copy per layer, only on a real GPU). :class:`DeviceOnly` is a ``torch.Tensor`` subclass that,
like a CUDA tensor, refuses every conversion to numpy (``.numpy()``, ``np.asarray``, ``np.concatenate``)
and records every explicit copy to the host (``.cpu()``, ``.to("cpu")``, ``.tolist()``) with its size; torch
operations on it return it again, so whatever is computed from a decoded tensor is a device tensor too.

:func:`host_copies` tells a test how many elements went to the host in its largest copy: a K/V tensor
(heads x tokens x head_dim) is far larger than the per-token metadata (selected rows, scores) a loader
may legitimately read back. :func:`as_device` / :func:`plain` convert to and from the stand-in.

On a real CUDA device the same tests run with real device tensors (``gpu_device()`` is ``cuda``), where a
numpy conversion fails for real.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import torch

__all__ = ["DeviceOnly", "HostCopies", "as_device", "host_copies", "plain"]


class HostCopies:
    """Explicit copies of stand-in tensors to the host: (what, elements), in order."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.copies: list[tuple[str, int]] = []

    def add(self, what: str, n: int) -> None:
        with self._lock:
            self.copies.append((what, n))

    def clear(self) -> None:
        with self._lock:
            self.copies.clear()

    @property
    def largest(self) -> int:
        with self._lock:
            return max((n for _, n in self.copies), default=0)


_COPIES = HostCopies()


def host_copies() -> HostCopies:
    """The process-wide record of host copies of :class:`DeviceOnly` tensors (clear it before a test)."""
    return _COPIES


def plain(x: Any) -> Any:
    """``x`` as a plain ``torch.Tensor`` (same storage; no copy)."""
    return torch.Tensor.as_subclass(x, torch.Tensor) if isinstance(x, torch.Tensor) else x


def as_device(x: torch.Tensor) -> "DeviceOnly":
    """``x`` as a :class:`DeviceOnly` tensor (same storage; no copy)."""
    return torch.Tensor.as_subclass(x, DeviceOnly)


def _refuse(*a: Any, **k: Any) -> Any:
    raise TypeError("can't convert a device tensor to numpy (stand-in for a CUDA tensor: copy it to the host first)")


class DeviceOnly(torch.Tensor):
    """A tensor that, like a CUDA tensor, cannot be turned into a numpy array; host copies are recorded."""

    numpy = _refuse  # type: ignore[assignment]
    __array__ = _refuse

    def cpu(self, *a: Any, **k: Any) -> torch.Tensor:  # type: ignore[override]
        _COPIES.add("cpu", self.numel())
        return plain(torch.Tensor.cpu(plain(self), *a, **k))

    def tolist(self) -> Any:  # type: ignore[override]
        _COPIES.add("tolist", self.numel())
        return plain(self).tolist()

    def to(self, *a: Any, **k: Any) -> Any:  # type: ignore[override]
        device = torch._C._nn._parse_to(*a, **k)[0]
        if device is not None and device.type == "cpu":
            _COPIES.add("to(cpu)", self.numel())
            return plain(torch.Tensor.to(plain(self), *a, **k))
        return torch.Tensor.to(self, *a, **k)


# ----------------------------------------------------------------------------------------------- fixtures
# The device-path test modules import these by name (pytest finds fixtures in a module's namespace).
import pytest  # noqa: E402


@pytest.fixture
def device_decode(monkeypatch):
    """Every chunk the GPU decoders hand the container reader comes back as a :class:`DeviceOnly` tensor,
    and the record of host copies starts empty. Yields that record."""
    pytest.importorskip("triton")
    from kvcodec.decode.device import resolve_device
    from kvcodec.format import reader

    real = reader.decode_chunk

    def decode(*a: Any) -> Any:
        out = real(*a)
        if resolve_device(a[-1]) != "gpu":
            return out
        assert isinstance(out, torch.Tensor), "the GPU path must return torch tensors"
        return as_device(out)

    monkeypatch.setattr(reader, "decode_chunk", decode)
    _COPIES.clear()
    yield _COPIES
    _COPIES.clear()


@pytest.fixture(scope="session")
def gpu_dev():
    """The device the GPU decoders write to: ``cuda`` on a GPU, the CPU under the Triton interpreter."""
    pytest.importorskip("triton")
    from kvcodec.decode.device import gpu_device

    return gpu_device()


@pytest.fixture(scope="session")
def device_lm(lm, gpu_dev):
    """The embedded model on :func:`gpu_dev`: the ``lm`` fixture itself under the interpreter, a copy on a GPU."""
    if gpu_dev.type == "cpu":
        return lm
    import copy

    from kvcodec.models.load import LoadedModel

    return LoadedModel(model=copy.deepcopy(lm.model).to(gpu_dev), tokenizer=lm.tokenizer, name=lm.name, path=lm.path)


def round_trip(how: str):
    """A ``land`` (``kvcodec.integrations.hf.land``'s signature) that sends the tensor through the host first
    (``"numpy"``: a numpy conversion; ``"cpu"``: an explicit copy): what the device contract forbids."""
    from kvcodec.integrations import hf

    real = hf.land

    def numpy_trip(x, target, dtype=None):
        return real(torch.from_numpy(np.asarray(x)), target, dtype)

    def cpu_trip(x, target, dtype=None):
        return real(x.cpu(), target, dtype)

    return {"numpy": numpy_trip, "cpu": cpu_trip}[how]
