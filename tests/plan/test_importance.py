"""Token importance from the cache (a forward of the last queries over the cached prefix) is the prefill's, exactly."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.models.importance import attention_importance, cache_importance

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


def test_capture_observes_the_importance_so_the_encoder_runs_no_forward(lm, gpl3_ids, monkeypatch):
    """capture(score_window=W) attaches exactly the prefill's importance and leaves the KV bit-identical;
    cache_importance then returns it without touching the model (issue 33: no forward at encode)."""
    import torch

    from kvcodec.models.capture import capture

    ids = gpl3_ids[:200]
    plain = capture(lm, token_ids=ids)
    scored = capture(lm, token_ids=ids, score_window=64)
    assert all(torch.equal(a, b) for a, b in zip(plain.keys + plain.values, scored.keys + scored.values))
    assert plain.attention is None and scored.attention.window == 64
    np.testing.assert_array_equal(scored.attention.scores, attention_importance(lm, ids, 64))

    def no_forward(*a, **k):
        raise AssertionError("the encoder ran a forward pass")

    monkeypatch.setattr(lm.model, "forward", no_forward)
    assert cache_importance(lm, scored, 64) is scored.attention.scores
    with pytest.raises(AssertionError, match="forward pass"):  # another window is measured again, not reused
        cache_importance(lm, scored, 32)


def test_observed_importance_follows_only_caches_of_the_same_tokens(lm, gpl3_ids):
    import dataclasses

    import torch

    from kvcodec.core.kvcache import AttentionScores
    from kvcodec.errors import KvcFormatError, KvcInputError
    from kvcodec.models.capture import capture

    scored = capture(lm, token_ids=gpl3_ids[:96], score_window=32)
    assert scored.to(torch.float32).attention is scored.attention  # a cast keeps the tokens: the scores stand
    assert scored.prefix(50).attention is None  # other tokens: measured again if needed
    with pytest.raises(KvcFormatError, match="attention scores"):
        dataclasses.replace(scored, attention=AttentionScores(32, scored.attention.scores[:, :50]))
    with pytest.raises(KvcInputError, match="score_window"):
        capture(lm, token_ids=gpl3_ids[:16], score_window=0)


def test_encoding_text_runs_the_model_once(lm, monkeypatch):
    """kvcodec.encode(text=...) with a lossy preset: the capture's prefill is the only forward pass (issue 33: the
    token importance is observed by it, the step comes from the rate model); without the observation the
    encoder would run a second, scoring forward."""
    import kvcodec
    from kvcodec.texts import load_text

    calls = []
    real = lm.model.forward

    def counted(*a, **k):
        calls.append(k.get("input_ids", a[0] if a else None).shape[-1])
        return real(*a, **k)

    monkeypatch.setattr(lm.model, "forward", counted)
    out = kvcodec.encode(None, None, preset="balanced", model=lm, text=load_text("c-stdio"), max_tokens=160)
    assert calls == [160] and out.plan.params["rate"]["mode"] == "predict"


@pytest.mark.parametrize("window", [None, 48])
def test_eager_weights_give_the_tapped_importance(lm, real_cache, window, monkeypatch):
    """A model the tap cannot observe (Falcon, Bloom, GPT-J, MPT, ...) is scored from the weights its eager attention
    returns, in chunks of queries: on a model both can read, the same scores as the tap's (float rounding apart),
    over a full prefill and over a cached prefix, whatever the chunk size."""
    import torch

    from kvcodec.models import attention_tap, importance

    cache = real_cache(160)
    tapped = attention_importance(lm, cache.token_ids, window)
    monkeypatch.setattr(attention_tap, "EAGER_BYTES", 4 * 30 * 9 * 160 * 7)  # 7 queries a chunk: the chunks must add up
    ids = torch.as_tensor(np.asarray(cache.token_ids, np.int64))[None]
    eager = importance._eager_scores(lm, ids, window, 160, True)
    np.testing.assert_allclose(eager, tapped, rtol=1e-4, atol=1e-9)
    monkeypatch.setattr(importance, "tap_sees", lambda lm: False)
    blind = cache_importance(lm, cache, window)  # over the cache's prefix when the window is shorter than the context
    np.testing.assert_allclose(blind, tapped, rtol=1e-4, atol=1e-9)
    assert not np.array_equal(importance._eager_scores(lm, ids, window, 160, False), eager)  # a, not a^2: other scores


def test_capture_of_a_model_the_tap_cannot_observe(lm, gpl3_ids, monkeypatch):
    """capture(score_window=W) on such a model: the plain prefill's K/V bit for bit, and the importance from its
    eager weights."""
    import torch

    from kvcodec.models import attention_tap, importance
    from kvcodec.models.capture import capture

    ids = gpl3_ids[:200]
    want = capture(lm, token_ids=ids, score_window=64)
    monkeypatch.setattr(attention_tap, "tap_sees", lambda lm: False)
    monkeypatch.setattr(importance, "tap_sees", lambda lm: False)
    eager = []
    monkeypatch.setattr(importance, "_eager_scores", lambda *a, f=importance._eager_scores: eager.append(1) or f(*a))
    got = capture(lm, token_ids=ids, score_window=64)
    assert all(torch.equal(a, b) for a, b in zip(want.keys + want.values, got.keys + got.values))
    assert got.attention.window == 64
    np.testing.assert_allclose(got.attention.scores, want.attention.scores, rtol=1e-4, atol=1e-9)
    assert eager == [1]


def test_h2o_scores_of_a_model_the_tap_cannot_observe(lm, gpl3_ids, monkeypatch):
    """H2O's per-KV-head scores read from the eager weights equal the tap's (float rounding apart), and the cache is
    the plain prefill's, bit for bit."""
    import torch

    from kvcodec.prune import h2o

    ids = gpl3_ids[:160]
    past, want = h2o.attention_scores(lm, ids, window=48)
    monkeypatch.setattr(h2o, "tap_sees", lambda lm: False)
    past2, got = h2o.attention_scores(lm, ids, window=48)
    assert got.shape == want.shape == (lm.fingerprint.num_layers, lm.fingerprint.num_kv_heads, 160)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    assert all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(past.layers, past2.layers))


def test_a_model_without_eager_weights_is_one_line(lm, monkeypatch):
    """A model the tap cannot observe and that has no eager attention (or returns no weights from it) is refused in
    one KvcInputError line, never a raw error from transformers."""
    import torch

    from kvcodec.errors import KvcInputError
    from kvcodec.models.attention_tap import eager_attention_sums

    ids = torch.arange(100, 140).reshape(1, -1)

    def no_eager(name):
        raise ValueError(f"{name} is not supported by this model")

    monkeypatch.setattr(lm.model, "set_attn_implementation", no_eager)
    with pytest.raises(KvcInputError, match="attention weights in eager mode"):
        eager_attention_sums(lm, ids, 16, 40, True)
    monkeypatch.undo()
    real = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: real(*a, **{**k, "output_attentions": False}))
    with pytest.raises(KvcInputError, match="returns no attention weights"):
        eager_attention_sums(lm, ids, 16, 40, True)
