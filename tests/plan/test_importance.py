"""Token importance from the cache (a forward of the last queries over the cached prefix) is the prefill's, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.plan.importance import attention_importance, cache_importance

pytestmark = pytest.mark.model


@pytest.mark.parametrize("window", [32, 100])
def test_cache_importance_equals_a_full_prefill(lm, real_cache, window):
    cache = real_cache(256)
    full = attention_importance(lm, cache.token_ids, window)  # one prefill of the whole context
    fast = cache_importance(lm, cache, window)  # only the last `window` tokens, over the cache's prefix
    assert fast.shape == full.shape == (lm.fingerprint.num_layers, 256)
    # same queries and keys; a forward of fewer tokens runs other matmul shapes, so float rounding differs
    np.testing.assert_allclose(fast, full, rtol=1e-4, atol=1e-9)
    assert (full[:, : 256 - window] > 0).any(), "keys before the window must be scored too"


def test_window_covering_the_context_is_a_prefill(lm, real_cache):
    cache = real_cache(64)
    np.testing.assert_array_equal(cache_importance(lm, cache, 64), attention_importance(lm, cache.token_ids, 64))
    np.testing.assert_array_equal(cache_importance(lm, cache, None), attention_importance(lm, cache.token_ids, None))
