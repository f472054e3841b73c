"""The numba encoder loops equal the numpy definitions they replace, bit for bit (kvcodec/codecs/fastencode.py)."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.codecs.fastencode import quantize_step_symbols


@pytest.mark.parametrize("max_bits", [4, 8, 16])
def test_quantize_step_symbols_is_the_numpy_quantizer(max_bits):
    """q = clip(rint(x / st), -lim-1, lim), zigzag, max(q, -q-1), any(q != 0): on values at ties (x.5 steps round to
    even), past both clip limits, all-zero channels and odd shapes (lanes that do not fill a vector)."""
    rng = np.random.default_rng(max_bits)
    lim = (1 << (max_bits - 1)) - 1
    dt = np.uint8 if max_bits <= 8 else np.uint16
    for H, T, C in ((1, 1, 1), (3, 37, 13), (2, 300, 64)):
        st = (rng.random((H, C)) * 2 + 0.05).astype(np.float32)
        x = (rng.standard_normal((H, T, C)) * rng.choice([0.1, 3.0, 5.0 * lim], size=(1, 1, C))).astype(np.float32)
        x[:, ::5] = (np.rint(x[:, ::5] / st[:, None]) + 0.5) * st[:, None]  # ties
        x[:, :, 0] = 0.0  # an all-zero channel
        sym, qmax, nz = quantize_step_symbols(x, st, lim, dt)
        q = np.clip(np.rint(x / st[:, None, :]), -lim - 1, lim).astype(np.int64)
        assert np.array_equal(sym, np.where(q >= 0, 2 * q, -2 * q - 1).astype(dt))
        assert np.array_equal(qmax, np.maximum(q.max(axis=1), -q.min(axis=1) - 1))
        assert np.array_equal(nz, (q != 0).any(axis=1))
        assert not nz[:, 0].any()
        assert C == 1 or np.isin(q, (lim, -lim - 1)).any()  # the clip limits were exercised
