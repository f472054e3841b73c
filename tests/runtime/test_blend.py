"""Issue 9: CacheBlend over position-independent chunk caches, on the real model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.models.cachelayout import cache_for_model
from kvcodec.runtime.blend import (
    blend, concat_chunks, continue_from, generate_blended, layer_inv_freqs, rerotate_keys,
)
from kvcodec.models.capture import capture, prefill
from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache

pytestmark = pytest.mark.model

# Small pieces of real text: chunks of 40/48/32 tokens, an 8-token query.
SPANS = {"A": (0, 40), "B": (40, 88), "C": (88, 120)}
QUERY = (120, 128)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Run this module's many small forward passes on one torch thread, then restore.

    On the shared 2-core box, 2 torch threads under load oversubscribe and make
    these small ops ~4x slower (measured 165 s vs 45 s for this file).
    """
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pieces(gpl3_ids):
    return {k: gpl3_ids[a:b] for k, (a, b) in SPANS.items()}, gpl3_ids[QUERY[0]:QUERY[1]]


@pytest.fixture(scope="module")
def chunk_caches(lm, pieces):
    texts, _ = pieces
    return {k: capture(lm, token_ids=v) for k, v in texts.items()}


def test_rerotated_keys_equal_keys_computed_in_context(lm, pieces, chunk_caches):
    """B captured alone and re-rotated by len(A) == B's keys inside [A, B], at layer 0.

    Only layer 0 is comparable: its K/V are projections of each token's own
    embedding, so position is the only thing that differs. From layer 1 on, B's
    hidden states inside [A, B] have attended to A (cross-attention), so its
    keys there genuinely differ from B's stand-alone keys — that difference is
    what blend repairs, not a re-rotation error.
    """
    texts, _ = pieces
    a, b = texts["A"], texts["B"]
    in_ctx = capture(lm, token_ids=np.concatenate([a, b]))
    alone = chunk_caches["B"]
    k = rerotate_keys(alone.keys[0], len(a), layer_inv_freqs(lm)[0])
    ref = in_ctx.keys[0][:, len(a):]
    err = (k - ref).abs().max().item()
    assert err <= 1e-4 * max(1.0, ref.abs().max().item()), err
    # Values carry no position: identical.
    assert torch.equal(alone.values[0], in_ctx.values[0][:, len(a):])
    # Without re-rotation they would be far off (the test has teeth).
    assert (alone.keys[0] - ref).abs().max().item() > 100 * err
    # The fingerprint's float64 frequencies agree with the model's own fp32 rotary buffer to fp32 rounding.
    k2 = rerotate_keys(alone.keys[0], len(a), lm.model.model.rotary_emb.inv_freq.double().numpy())
    assert (k2 - k).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())
    # Rotations compose: by 7 then by len(a) - 7 == by len(a).
    inv = layer_inv_freqs(lm)[0]
    two = rerotate_keys(rerotate_keys(alone.keys[0], 7, inv), len(a) - 7, inv)
    assert (two - k).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item())


def test_ratio_one_equals_full_prefill(lm, pieces, chunk_caches):
    """Recomputing every token == HF full prefill of the concatenated text (any chunk order)."""
    texts, query = pieces
    order = ["C", "A", "B"]
    ids = np.concatenate([texts[k] for k in order] + [query])
    past, full_logits = prefill(lm, ids, logits_to_keep=0)
    res = blend(lm, [chunk_caches[k] for k in order], query, recompute_ratio=1.0, return_query_logits=True)
    assert np.array_equal(res.cache.token_ids, ids)
    assert res.next_position == len(ids)
    assert np.array_equal(res.selected, np.arange(len(ids)))
    logit_diff = (res.query_logits - full_logits[-len(query):]).abs().max().item()
    assert (res.logits_last - full_logits[-1]).abs().max().item() <= logit_diff
    assert logit_diff <= 1e-3, logit_diff  # measured ~4e-5 (fp32)
    kv_diff = max(
        max((res.cache.keys[i] - layer.keys[0]).abs().max().item(), (res.cache.values[i] - layer.values[0]).abs().max().item())
        for i, layer in enumerate(past.layers)
    )
    assert kv_diff <= 1e-3, kv_diff


def test_ratio_zero_equals_naive_concatenation_exactly(lm, pieces, chunk_caches):
    """Recomputing no context token == the query fed by HF onto the re-rotated, concatenated caches."""
    texts, query = pieces
    chunks = [chunk_caches[k] for k in ("B", "C", "A")]
    naive = concat_chunks(lm, chunks)
    n = naive.num_tokens
    with torch.inference_mode():
        out = lm.model(
            input_ids=torch.as_tensor(query).unsqueeze(0), past_key_values=cache_for_model(lm, naive),
            position_ids=torch.arange(n, n + len(query)).unsqueeze(0), use_cache=True,
        )
    res = blend(lm, chunks, query, recompute_ratio=0.0, return_query_logits=True)
    assert torch.equal(res.query_logits, out.logits[0].float())
    assert np.array_equal(res.selected, np.arange(n, n + len(query)))
    for i, layer in enumerate(out.past_key_values.layers):
        assert torch.equal(res.cache.keys[i], layer.keys[0]) and torch.equal(res.cache.values[i], layer.values[0])


def test_partial_blend_selects_queries_and_is_closer_than_naive(lm, pieces, chunk_caches):
    texts, query = pieces
    order = ["B", "A", "C"]
    chunks = [chunk_caches[k] for k in order]
    n_ctx = sum(len(texts[k]) for k in order)
    _, full_logits = prefill(lm, np.concatenate([texts[k] for k in order] + [query]), logits_to_keep=0)
    ref = torch.log_softmax(full_logits[-1].double(), -1)

    def kl(logits):
        return float((ref.exp() * (ref - torch.log_softmax(logits.double(), -1))).sum())

    res = blend(lm, chunks, query, recompute_ratio=0.25)
    sel = res.selected
    assert np.all(np.diff(sel) > 0)
    assert set(range(n_ctx, n_ctx + len(query))) <= set(sel.tolist())  # every query token
    assert len(sel) == round(0.25 * n_ctx) + len(query)
    assert res.deviation is not None and res.deviation.shape == (n_ctx,)
    # The first chunk sits at its own positions and sees nothing before it: its keys are exact.
    assert res.deviation[: len(texts[order[0]])].max() < 1e-6 * res.deviation.max()
    # Each later chunk's first token was an attention sink when captured alone: selected.
    assert {len(texts["B"]), len(texts["B"]) + len(texts["A"])} <= set(sel.tolist())
    naive = blend(lm, chunks, query, recompute_ratio=0.0)
    assert kl(res.logits_last) < kl(naive.logits_last)
    # A tiny ratio still selects every query token.
    tiny = blend(lm, chunks, query, recompute_ratio=1e-3, select_layer=2)
    assert set(range(n_ctx, n_ctx + len(query))) <= set(tiny.selected.tolist())
    assert set(res.timings) >= {"rerotate_s", "early_s", "select_s", "recompute_s", "total_s"}


def test_generation_continues_from_blended_cache(lm, pieces, chunk_caches):
    """At ratio 1 greedy generation from the blend == greedy generation after a full prefill."""
    texts, query = pieces
    chunks = [chunk_caches["A"], chunk_caches["B"]]
    ids = np.concatenate([texts["A"], texts["B"], query])
    gen = generate_blended(lm, chunks, query, max_new_tokens=5, recompute_ratio=1.0, stop_at_eos=False)
    with torch.inference_mode():
        out = lm.model.generate(
            torch.as_tensor(ids).unsqueeze(0), max_new_tokens=5, do_sample=False, pad_token_id=0,
        )
    assert gen.token_ids == out[0, len(ids):].tolist()
    assert isinstance(gen.text, str) and gen.timings["ttft_s"] > 0
    assert continue_from(lm, gen.blend, 0) == []


def test_accepts_decoded_low_precision_chunks(lm, pieces, chunk_caches):
    """Chunk caches may come in fp16 (e.g. decoded from a .kvc); the result is in the model dtype."""
    _, query = pieces
    half = [chunk_caches["A"].to(torch.float16), chunk_caches["C"].to(torch.float16)]
    res = blend(lm, half, query, recompute_ratio=0.5)
    assert res.cache.dtype == torch.float32
    assert torch.isfinite(res.logits_last).all()


@pytest.mark.parametrize("ratio", [-0.01, 1.01, float("nan"), "x", None])
def test_bad_ratio_is_input_error(lm, pieces, chunk_caches, ratio):
    _, query = pieces
    with pytest.raises(KvcInputError):
        blend(lm, [chunk_caches["A"]], query, recompute_ratio=ratio)


def test_bad_inputs_are_input_errors(lm, pieces, chunk_caches):
    _, query = pieces
    a = chunk_caches["A"]
    with pytest.raises(KvcInputError):
        blend(lm, [], query)
    with pytest.raises(KvcInputError):
        blend(lm, [a], np.zeros(0, dtype=np.int64))
    with pytest.raises(KvcInputError):
        blend(lm, [a], query, select_layer=0)
    with pytest.raises(KvcInputError):
        blend(lm, [a], query, select_layer=a.num_layers)
    with pytest.raises(KvcInputError):
        blend(lm, [a], [10**9])
    pruned = KVCache([k[:, ::2] for k in a.keys], [v[:, ::2] for v in a.values], a.token_ids, a.fingerprint,
                     positions=np.arange(0, a.num_tokens, 2))
    with pytest.raises(KvcInputError):
        blend(lm, [pruned], query)
    with pytest.raises(KvcInputError):
        blend(lm, ["not a cache"], query)


def test_query_ids_answer_length_and_window_are_checked_before_the_work(lm, pieces, chunk_caches):
    """Query ids that are not integers were coerced or escaped ("abc" ValueError, [1.7] read as [1], 2**63 as
    OverflowError); an answer length that is not an integer escaped as TypeError after the whole blend (2.5 was
    taken); chunks and a query past the model's window were blended, and an answer was generated past it."""
    from kvcodec.models.capture import max_context

    _, query = pieces
    a = chunk_caches["A"]
    for bad in (["abc"], [1.7, 2.2], np.array([2**63 + 5], dtype=np.uint64)):
        with pytest.raises(KvcInputError, match="query token ids must be integers"):
            blend(lm, [a], bad)
    for bad in ("x", None, 2.5, True, -1):
        with pytest.raises(KvcInputError, match="max_new_tokens must be an integer"):
            generate_blended(lm, [a], query, max_new_tokens=bad)
    window = max_context(lm)
    with pytest.raises(KvcInputError, match=r"context window .*\(give a shorter text\)$"):
        blend(lm, [a], np.full(window, 5))
    # the one message said "use --max-tokens" to every caller: from Python it names the argument, from kvc the flag
    with pytest.raises(KvcInputError, match=r"context window .*\(lower max_new_tokens, or give a shorter text\)$") as ei:
        generate_blended(lm, [a], query, max_new_tokens=window)
    assert ei.value.cli_message().endswith("(lower --max-new-tokens, or give a shorter text)")
    import pickle  # a worker process's error comes back whole (its constructor's arguments are not its message)

    assert str(pickle.loads(pickle.dumps(ei.value))) == str(ei.value)  # noqa: S301 - our own bytes
    res = blend(lm, [a], query, recompute_ratio=0.0)
    with pytest.raises(KvcInputError, match="context window"):
        continue_from(lm, res, window)
