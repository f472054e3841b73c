"""A capture's attention scores (mean squared attention weights, so in [0, 1]) are checked on load: 1e308 each
passed the finite check and overflowed every sum the importance takes (numpy overflow warnings on stderr, an
importance of inf and NaN, and an encode that went ahead on it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.core.kvcache import AttentionScores, KVCache, load_capture, save_capture
from kvcodec.errors import KvcFormatError
from kvcodec.testing.attacks import SMALL_FP


def _capture(path, scores: np.ndarray):
    g = np.random.default_rng(0)
    ks = [torch.from_numpy(g.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(2)]
    c = KVCache(ks, [k.clone() for k in ks], np.arange(8), SMALL_FP)
    c.attention = AttentionScores(512, scores)
    save_capture(c, path)
    return path


@pytest.mark.parametrize("suffix", [".safetensors", ".h5"])
def test_scores_outside_zero_one_are_refused(tmp_path, suffix):
    ok = np.random.default_rng(1).uniform(0, 1, (2, 8))
    ok[0, 0] = 1.0
    assert np.array_equal(load_capture(_capture(tmp_path / f"ok{suffix}", ok)).attention.scores, ok)
    for bad in (1e308, 2.0, -1e-9, np.nan):
        s = ok.copy()
        s[1, 3] = bad
        with pytest.raises(KvcFormatError, match=r"attention scores must be finite and in \[0, 1\]"):
            load_capture(_capture(tmp_path / f"bad{suffix}", s))
