"""Issue 8: a `.kvc` loads into HF as a lazily decoded cache that continues exactly."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.models.capture import capture, prefill
from kvcodec.errors import KvcModelMismatchError
from kvcodec.format import encode_kvc_bytes
from kvcodec.plan.presets import get_plan
from kvcodec.integrations.hf import LazyKvcLayer, generate, greedy_from, load_cache

pytestmark = pytest.mark.model


def _kvc(cache, preset="lossless") -> bytes:
    plan = get_plan(preset, cache)
    return encode_kvc_bytes(cache, plan)


@pytest.mark.parametrize("prefetch", [True, False])
def test_lazy_cache_continues_like_full_prefill(lm, gpl3_ids, prefetch):
    n_ctx, n_cont = 80, 16
    data = _kvc(capture(lm, token_ids=gpl3_ids[:n_ctx]))
    loaded = load_cache(data, lm, prefetch=prefetch)
    assert all(isinstance(layer, LazyKvcLayer) for layer in loaded.cache.layers)
    assert loaded.cache.get_seq_length() == n_ctx and loaded.next_position == n_ctx
    assert np.array_equal(loaded.token_ids, gpl3_ids[:n_ctx])
    _, full = prefill(lm, gpl3_ids[: n_ctx + n_cont], logits_to_keep=0)
    with torch.inference_mode():
        out = lm.model(
            input_ids=torch.as_tensor(gpl3_ids[n_ctx : n_ctx + n_cont]).unsqueeze(0),
            past_key_values=loaded.cache,
            use_cache=True,
        ).logits[0]
    assert (out - full[n_ctx:]).abs().max().item() <= 1e-4


def test_generate_one_liner_matches_prefill_greedy(lm, gpl3_ids):
    n_ctx = 60
    question = gpl3_ids[n_ctx : n_ctx + 4]
    data = _kvc(capture(lm, token_ids=gpl3_ids[:n_ctx]))
    from_kvc = generate(lm, data, question, max_new_tokens=8)
    past, _ = prefill(lm, gpl3_ids[:n_ctx])
    assert from_kvc == greedy_from(lm, past, n_ctx, question, 8)[0]


def test_generate_refuses_bad_new_tokens_before_reading_the_cache(lm, gpl3_ids):
    """``generate(input_ids="x")`` escaped as ValueError, an id past the vocabulary as IndexError from the
    embedding, ``max_new_tokens=2.5`` / ``"8"`` as TypeError: each is one KvcInputError line, before the cache is
    read (the source here is not even a .kvc file)."""
    from kvcodec.errors import KvcInputError

    vocab = lm.model.get_input_embeddings().num_embeddings
    for ids, words in (("x", "must be integers, got str"), ([1.5, 2.0], "must be integers"), ([], "at least one token"),
                       ([3, vocab], f"token id {vocab} is outside the model's vocabulary"), ([-1], "token id -1"),
                       (np.full(2, 1 << 63, dtype=np.uint64), "must be integers")):
        with pytest.raises(KvcInputError, match=words):
            generate(lm, b"not a kvc file", ids)
    for n in (0, 2.5, "8", True):
        with pytest.raises(KvcInputError, match="max_new_tokens must be an integer >= 1"):
            generate(lm, b"not a kvc file", gpl3_ids[:4], max_new_tokens=n)


def test_refuses_what_is_not_a_loaded_model(tmp_path):
    """``kvcodec.load_into(path, None)`` (or a fingerprint, or a model name) escaped as AttributeError."""
    import kvcodec
    from kvcodec.errors import KvcInputError
    from kvcodec.testing.golden import _synthetic

    c = _synthetic(torch.float16, 8)
    for lm in (None, c.fingerprint, "smollm2", 3):
        with pytest.raises(KvcInputError, match="needs a loaded model"):
            kvcodec.load_into(_kvc(c), lm)


def test_refuses_a_device_or_backend_that_cannot_hold_the_cache(lm, small_cache):
    """device="tpu" / 3 escaped as RuntimeError, "cuda" without CUDA as AssertionError, "meta" was accepted (a
    cache without data); backend=3 escaped as AttributeError."""
    import kvcodec
    from kvcodec.errors import KvcError, KvcInputError

    data = _kvc(small_cache)
    for device in ("tpu", 3, "meta", "cuda", "cuda:99"):
        if device == "cuda" and torch.cuda.is_available():  # a usable device there
            continue
        with pytest.raises(KvcError):
            kvcodec.load_into(data, lm, device=device)
    with pytest.raises(KvcInputError, match="backend must be"):
        kvcodec.load_into(data, lm, backend=3)
    assert kvcodec.load_into(data, lm, device="cpu").cache.get_seq_length() == small_cache.num_tokens


def test_refuses_a_file_of_another_model(other_lm, small_cache):
    with pytest.raises(KvcModelMismatchError):
        load_cache(_kvc(small_cache), other_lm)


def test_a_layer_past_the_model_dtype_is_refused_not_loaded_as_inf():
    """A float32 (or bfloat16) file loading into a float16 model: each layer is cast to the model's dtype, and a
    finite value past 65504 became inf in the cache, silently (the attention then reads NaNs). Now one KvcInputError
    line; values in range, widening casts and equal dtypes land as before."""
    from kvcodec.errors import KvcInputError
    from kvcodec.integrations.hf import land

    cpu = torch.device("cpu")
    for x in (torch.tensor([1.0, 70000.0]), torch.tensor([1.0, 70000.0]).to(torch.bfloat16)):
        with pytest.raises(KvcInputError, match="past float16's range"):
            land(x, cpu, torch.float16)
    ok = torch.tensor([1.5, -65504.0])
    assert torch.equal(land(ok, cpu, torch.float16), ok.half())
    assert land(ok, cpu, torch.float32) is ok and land(ok.half(), cpu, torch.float32).dtype == torch.float32
    inf = torch.tensor([float("inf"), 2.0])  # an inf the file holds is its own, not the cast's
    assert torch.isinf(land(inf, cpu, torch.float16)).sum() == 1


def test_a_cache_a_continuation_already_ran_on_is_refused(lm, gpl3_ids):
    """greedy_from on a loaded cache it had already continued (a reused context) fed the new tokens at the
    context's end while the cache still held the last question and answer, attended again: silently not the
    answer a fresh load gives. Now one KvcInputError line; a fresh load answers as before."""
    from kvcodec.errors import KvcInputError

    n_ctx = 60
    question = gpl3_ids[n_ctx : n_ctx + 4]
    data = _kvc(capture(lm, token_ids=gpl3_ids[:n_ctx]))
    loaded = load_cache(data, lm)
    first = greedy_from(lm, loaded.cache, loaded.next_position, question, 6)[0]
    with pytest.raises(KvcInputError, match="already ran"):
        greedy_from(lm, loaded.cache, loaded.next_position, question, 6)
    assert greedy_from(lm, load_cache(data, lm).cache, n_ctx, question, 6)[0] == first
