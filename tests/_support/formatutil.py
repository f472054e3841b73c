"""Helpers shared by the tests/test_format*.py files."""

from __future__ import annotations

import numpy as np
import torch

from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.kvcache import KVCache

SYNTH_FP = ModelFingerprint("synthetic", 2, 2, (8, 8), "{}", "0" * 64, "1" * 64, config_sha256="2" * 64)


def synthetic_cache(dtype=torch.float16, T: int = 8, n_ctx: int | None = None, positions=None) -> KVCache:
    t = np.arange(T)[None, :, None]
    d = np.arange(8)[None, None, :]
    h = np.arange(2)[:, None, None]
    ks = [torch.from_numpy(((1 + d) * np.sin(0.3 * t + d + h + i)).astype(np.float32)).to(dtype) for i in range(2)]
    vs = [torch.from_numpy((np.cos(0.1 * t * (d + 1) + i) - h).astype(np.float32)).to(dtype) for i in range(2)]
    return KVCache(ks, vs, np.arange(n_ctx or T) + 100, SYNTH_FP, positions)


def ragged_cache(dtype=torch.float16) -> KVCache:
    """12 context tokens; layer 0 a sliding-window layer that keeps its last 5, layer 1 keeps all 12."""
    full = synthetic_cache(dtype, T=12)
    return KVCache([full.keys[0][:, 7:].clone(), full.keys[1]], [full.values[0][:, 7:].clone(), full.values[1]],
                   full.token_ids, SYNTH_FP)


def assert_same_cache(a: KVCache, b: KVCache) -> None:
    assert a.fingerprint == b.fingerprint
    assert np.array_equal(a.token_ids, b.token_ids)
    assert (a.positions is None) == (b.positions is None)
    if a.positions is not None:
        assert np.array_equal(a.positions, b.positions)
    assert a.num_layers == b.num_layers
    for x, y in zip(a.keys + a.values, b.keys + b.values):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x.contiguous().view(torch.uint8).numpy(), y.contiguous().view(torch.uint8).numpy())


class RangeObj:
    """The store's range-reader protocol: ``size`` + ``read(offset, length)``; records what was read."""

    def __init__(self, data: bytes) -> None:
        self._d = bytes(data)
        self.size = len(self._d)
        self.calls = 0
        self.touched: list[tuple[int, int]] = []

    def read(self, offset: int, length: int) -> bytes:
        self.calls += 1
        self.touched.append((offset, offset + length))
        return self._d[offset : offset + length]
