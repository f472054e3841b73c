"""``steer`` (PASTA as an offline edit) on the real embedded model, and who may load the result."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvcodec.edit.log import parse_log
from kvcodec.edit.steer import parse_heads, pasta_bias, steer
from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelMismatchError
from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.format.bias import AttentionBias
from kvcodec.integrations.attn_bias import model_attention_heads
from kvcodec.integrations.hf import load_cache
from kvcodec.models.capture import prefill

pytestmark = pytest.mark.model

N = 48


@pytest.fixture(scope="module")
def steered(lm, entry):
    """Every head of every layer sees only tokens [0, 3) of the context (alpha 1e-300: a bias of -690.8)."""
    cache, data = entry(N)
    heads = [(layer, h) for layer in range(lm.fingerprint.num_layers) for h in range(model_attention_heads(lm))]
    return cache, data, steer(lm, data, heads, token_spans=[(0, 3)], alpha=1e-300)


def test_the_child_carries_the_bias_the_log_and_the_same_tokens(lm, steered):
    cache, _, res = steered
    with KvcReader(res.data) as r:
        assert r.header.required_features & 2
        b = r.header.attention_bias
        assert b.attention_heads == model_attention_heads(lm) and len(b.entries) == 30 * 9
        assert b.entries[0].keys == ((3, N),) and b.entries[0].value == pytest.approx(math.log(1e-300))
        assert np.array_equal(r.token_ids, cache.token_ids)
        assert parse_log(r.header.meta)[-1].op == "steer"
        with pytest.raises(KvcFormatError, match="attention bias"):
            r.read_cache()


def test_the_hf_loader_applies_the_bias_to_later_queries(lm, steered, changelog_ids):
    """With everything outside [0, 3) masked on every head, the context's later tokens are invisible to the
    question: its logits equal those of the question after the 3-token prefix alone, at the same positions."""
    _, _, res = steered
    q = changelog_ids[N:N + 6]
    loaded = load_cache(res.data, lm)
    with torch.inference_mode(), loaded.steering(lm):
        got = lm.model(input_ids=torch.as_tensor(q)[None], past_key_values=loaded.cache,
                       position_ids=torch.arange(N, N + 6)[None], use_cache=True).logits[0]
    past, _ = prefill(lm, changelog_ids[:3])
    with torch.inference_mode():
        want = lm.model(input_ids=torch.as_tensor(q)[None], past_key_values=past, position_ids=torch.arange(N, N + 6)[None],
                        use_cache=True).logits[0]
    assert float((got - want).abs().max()) < 1e-3
    # and without the bias the same K/V would give something else: the bias is doing the work
    plain = load_cache(res.data, lm)
    with torch.inference_mode():
        other = lm.model(input_ids=torch.as_tensor(q)[None], past_key_values=plain.cache,
                         position_ids=torch.arange(N, N + 6)[None], use_cache=True).logits[0]
    assert float((other - want).abs().max()) > 1.0


def test_engines_that_cannot_apply_it_refuse_in_one_line(steered):
    from kvcodec.integrations.llamacpp import LlamaShape, state_bytes
    from kvcodec.integrations.vllm.entries import decode_chunk_layers

    _, _, res = steered
    with KvcReader(res.data) as r:
        with pytest.raises(KvcFormatError, match="attention bias"):
            state_bytes(r, LlamaShape(30, 3, 64, 49152, 2048, 0, False, 1, 1))
        with pytest.raises(KvcFormatError, match="attention bias"):
            next(decode_chunk_layers(r, 0, N))


def test_a_bias_for_another_head_count_is_refused_before_any_forward(lm, entry):
    cache, _ = entry(N)
    data = encode_kvc_bytes(cache, __import__("kvcodec.format", fromlist=["lossless_pipeline"]).lossless_pipeline("float32"),
                            attention_bias=AttentionBias.outside(4, [(0, 0)], -1.0, [(0, 3)], N))
    with pytest.raises(KvcModelMismatchError, match="attention heads"):
        load_cache(data, lm)


@pytest.mark.parametrize("kw, msg", [
    ({"heads": [(30, 0)]}, "out of range"),
    ({"heads": [(0, 9)]}, "out of range"),
    ({"heads": [(0, -1)]}, "out of range"),
    ({"heads": []}, "at least one"),
    ({"heads": [(0, 0), (0, 0)]}, "distinct"),
    ({"alpha": float("nan")}, "finite"),
    ({"alpha": float("inf")}, "finite"),
    ({"alpha": 0.0}, r"\(0, 1\]"),
    ({"alpha": 2.0}, r"\(0, 1\]"),
    ({"spans": [(0, N)]}, "whole context"),
])
def test_hostile_steering_is_one_line(lm, kw, msg):
    args = {"heads": [(0, 0)], "alpha": 0.01, "spans": [(2, 5)], **kw}
    with pytest.raises(KvcInputError, match=msg):
        pasta_bias(lm, args["heads"], args["spans"], N, args["alpha"])


def test_parse_heads():
    assert parse_heads("3:1,4:*", 3) == [(3, 1), (4, 0), (4, 1), (4, 2)]
    with pytest.raises(KvcInputError, match="LAYER:HEAD"):
        parse_heads("3", 3)
    with pytest.raises(KvcInputError, match="LAYER:HEAD"):
        parse_heads("3:x", 3)


def test_a_steered_entry_is_not_steered_again_nor_edited_blindly(lm, steered):
    from kvcodec.edit.append import append

    _, _, res = steered
    with pytest.raises(KvcInputError, match="already steered"):
        steer(lm, res.data, [(0, 0)], token_spans=[(0, 3)])
    with pytest.raises(KvcInputError, match="steered .*append to its unsteered parent"):
        append(lm, res.data, text="more")
    with pytest.raises(KvcInputError, match="steered"):
        append(lm, res.data, text="more", repair="prefill")
    assert res.promise is not None and res.promise["none"].startswith("steered")


def test_the_profiled_heads_help_on_the_key_fact_task(lm):
    """A held-out example of the benchmark's task: steering the heads profiled for SmolLM2 (layers 20, 23, 24,
    BENCHMARKS.md) toward the asked fact raises the right answer's margin over the best wrong one."""
    from kvcodec.edit.steer import steer_cache
    from kvcodec.edit.steer_profile import answer_margin, fact_examples
    from kvcodec.models.capture import capture

    heads = [(layer, h) for layer in (20, 23, 24) for h in range(model_attention_heads(lm))]
    for ex in fact_examples(lm.tokenizer, ["c-stdio"], 1, seed=5):
        plain = answer_margin(lm, capture(lm, token_ids=ex.context), ex)
        bias = pasta_bias(lm, heads, [ex.span], len(ex.context))
        steered = answer_margin(lm, steer_cache(lm, ex.context, bias), ex, bias)
        assert steered > plain + 1.0 and steered > 0


def test_parameters_the_log_cannot_hold_are_refused_before_the_prefill(lm, entry, monkeypatch):
    """Every head (270 on SmolLM2) and many spans make a record longer than the log's 4,096 characters: the
    biased prefill ran in full and the write then failed as a malformed log (KvcFormatError naming record 0)."""
    import kvcodec.edit.steer as steer_mod

    _, data = entry(600)
    heads = [(layer, h) for layer in range(lm.fingerprint.num_layers) for h in range(model_attention_heads(lm))]
    prefilled = []
    monkeypatch.setattr(steer_mod, "steer_cache", lambda *a: prefilled.append(1))
    with pytest.raises(KvcInputError, match="more than the 4,096"):
        steer(lm, data, heads, token_spans=[(2 * i, 2 * i + 1) for i in range(40, 296)])
    assert not prefilled
