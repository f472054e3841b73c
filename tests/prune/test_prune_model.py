"""Pruning on the real model: exactness at 100 %, original positions, metadata, errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcInputError
from kvcodec.models.quality import continue_logits
from kvcodec.core.kvcache import KVCache, load_h5, save_h5
from kvcodec.prune import (
    SCORES_META_KEY,
    apply_prune,
    capture_lingua,
    capture_with_scores,
    evaluate_pruned,
    h2o_prune,
    kept_fraction,
    masked_prefill_logits,
    original_indices,
    parse_prune,
    scores_to_meta,
)

pytestmark = pytest.mark.model
T, N = 96, 12


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    # these forwards are tiny; on a shared 2-core box, intra-op threads mostly spin (10x slower)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def scored(lm, gpl3_ids):
    return capture_with_scores(lm, token_ids=gpl3_ids[:T], window=16)


@pytest.fixture(scope="module")
def cont(gpl3_ids):
    return gpl3_ids[T : T + N]


@pytest.fixture(scope="module")
def exact_logits(lm, scored, cont):
    return continue_logits(lm, scored[0], cont)


def test_scoring_prefill_returns_the_exact_cache(lm, scored, gpl3_ids):
    from kvcodec.models.capture import capture

    cache, scores = scored
    ref = capture(lm, token_ids=gpl3_ids[:T])
    assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, ref.keys + ref.values))
    assert scores.shape == (30, 3, T) and np.isfinite(scores).all()
    # each of the 16 window queries distributes probability 1 per query head; 3 query heads per KV head
    np.testing.assert_allclose(scores.sum(-1), 16 * 3, rtol=1e-5)


@torch.inference_mode()
def test_scores_are_the_real_attention_weights(lm, gpl3_ids):
    """Scores equal eager attention probabilities, summed over the window's queries and each GQA group."""
    ids = gpl3_ids[:40]
    _, scores = capture_with_scores(lm, token_ids=ids, window=8)
    old = lm.model.config._attn_implementation
    lm.model.config._attn_implementation = "eager"
    try:
        out = lm.model(input_ids=torch.as_tensor(ids)[None], output_attentions=True)
    finally:
        lm.model.config._attn_implementation = old
    for li in (0, 7, 29):
        att = out.attentions[li][0]  # [9 query heads, T, T]
        want = att[:, -8:].sum(1).view(3, 3, -1).sum(1).numpy()
        np.testing.assert_allclose(scores[li], want, atol=2e-5)
    assert lm.model.config._attn_implementation == "sdpa"  # scoring restores the model's attention


def test_budget_100_percent_reproduces_unpruned_logits_exactly(lm, scored, cont, exact_logits):
    cache, scores = scored
    rand = np.random.default_rng(0).random(scores.shape)
    for spec, sc in (("h2o:1.0", scores), (f"h2o:heavy={T - 10},recent=10", rand)):
        full = h2o_prune(cache, sc, parse_prune(spec))
        assert full.num_tokens == T and full.next_position == T
        got = continue_logits(lm, full, cont)
        assert torch.equal(got, exact_logits), spec  # bit-exact in fp32
    lin = apply_prune(cache, "lingua:100%", lm=lm)
    assert np.array_equal(lin.token_ids, cache.token_ids)
    assert torch.equal(continue_logits(lm, lin, cont), exact_logits)


def test_pruned_cache_continues_at_original_positions(lm, scored, gpl3_ids, cont, exact_logits):
    """Reference: ONE full prefill of context + continuation (natural positions, no cache, no
    position_ids) in which, per layer and KV head, the continuation queries cannot see the dropped
    context tokens. A correctly loaded per-head pruned cache must match it; a cache whose positions
    are renumbered (continuing at T_kept) must not."""
    cache, scores = scored
    pruned = h2o_prune(cache, scores, parse_prune("h2o:0.25"))
    assert pruned.positions.shape == (30, 3, 24)  # heads really keep different tokens
    assert len({tuple(pruned.positions[5, h]) for h in range(3)}) > 1
    assert pruned.next_position == T
    ref = masked_prefill_logits(lm, gpl3_ids[: T + N], T, pruned.positions)
    got = continue_logits(lm, pruned, cont)
    err = float((got - ref).abs().max())
    assert err < 1e-3
    # the pruning itself changes the output (so the match above is not trivial)
    assert float((ref - exact_logits).abs().max()) > 100 * err
    renumbered = KVCache(pruned.keys, pruned.values, cache.token_ids[: pruned.num_tokens], cache.fingerprint)
    assert renumbered.next_position == 24
    bad = continue_logits(lm, renumbered, cont)
    assert float((bad - ref).abs().max()) > 100 * err
    # sanity of the reference: hiding nothing reproduces the exact cache's continuation
    ref_full = masked_prefill_logits(lm, gpl3_ids[: T + N], T, np.arange(T))
    assert float((ref_full - exact_logits).abs().max()) < 1e-3


def test_per_head_positions_survive_h5_round_trip(lm, scored, cont, tmp_path):
    cache, scores = scored
    pruned = h2o_prune(cache, scores, parse_prune("h2o:heavy=0.2,recent=0.1"))
    save_h5(pruned, tmp_path / "p.h5")
    back = load_h5(tmp_path / "p.h5")
    assert np.array_equal(back.positions, pruned.positions) and back.meta["prune"] == pruned.meta["prune"]
    assert torch.equal(continue_logits(lm, back, cont), continue_logits(lm, pruned, cont))
    assert kept_fraction(back) == pytest.approx(pruned.num_tokens / T)
    json.dumps(back.meta)


def test_apply_prune_uses_scores_from_meta_or_recomputes(lm, scored):
    cache, scores = scored
    spec = "h2o:0.5,window=16"
    direct = apply_prune(cache, spec, lm=lm, scores=scores)
    recomputed = apply_prune(cache, spec, lm=lm)
    assert np.array_equal(direct.positions, recomputed.positions)
    with_meta = KVCache(cache.keys, cache.values, cache.token_ids, cache.fingerprint,
                        meta={**cache.meta, SCORES_META_KEY: scores_to_meta(scores, 16)})
    from_meta = apply_prune(with_meta, spec)  # no lm needed: scores travel with the cache
    assert SCORES_META_KEY not in from_meta.meta
    assert (direct.positions == from_meta.positions).mean() > 0.99  # float16 storage may flip near-ties


def test_lingua_capture_meta_and_eval(lm, gpl3_ids, scored, cont, exact_logits):
    cache = capture_lingua(lm, token_ids=gpl3_ids[:T], budget="lingua:0.5,segment=40")
    rec = cache.meta["prune"]
    json.dumps(cache.meta)
    assert cache.num_tokens == 48 and cache.positions is None and cache.next_position == 48
    idx = original_indices(cache)
    assert idx[0] == 0 and np.array_equal(cache.token_ids, gpl3_ids[:T][idx])
    assert rec["method"] == "lingua" and rec["positions"] == "renumbered" and rec["kept_fraction"] == 0.5
    assert rec["dropped_mean_nll"] < rec["kept_mean_nll"]
    q = evaluate_pruned(lm, scored[0], cache, cont, greedy_tokens=2, exact_logits=exact_logits)
    assert np.isfinite(q.kl_mean) and q.kl_mean > 0
    qa = apply_prune(scored[0], "lingua:0.5,segment=40", lm=lm, question="Who may copy the license?")
    assert qa.meta["prune"]["question_aware"] and len(qa.meta["prune"]["segment_relevance"]) == 3
    assert qa.num_tokens == 48


def test_evaluate_pruned_checks_the_context(lm, scored, gpl3_ids, cont):
    cache, scores = scored
    other = capture_with_scores(lm, token_ids=gpl3_ids[1 : T + 1], window=16)[0]
    pruned = h2o_prune(cache, scores, parse_prune("h2o:0.5"))
    with pytest.raises(KvcInputError, match="different tokens"):
        evaluate_pruned(lm, other, pruned, cont, greedy_tokens=0)


def test_apply_prune_refuses_bad_requests(lm, scored):
    cache, scores = scored
    pruned = h2o_prune(cache, scores, parse_prune("h2o:0.5"))
    with pytest.raises(KvcInputError, match="already pruned"):
        apply_prune(pruned, "h2o:0.5", lm=lm)
    with pytest.raises(KvcInputError, match="only 96"):
        apply_prune(cache, "h2o:4096", lm=lm)
    with pytest.raises(KvcInputError, match="only 96"):
        apply_prune(cache, "lingua:500", lm=lm)
    with pytest.raises(KvcInputError, match="above 1"):
        apply_prune(cache, "h2o:1.5", lm=lm)
    with pytest.raises(KvcInputError, match="shape"):
        h2o_prune(cache, scores[:, :, :10], parse_prune("h2o:0.5"))
