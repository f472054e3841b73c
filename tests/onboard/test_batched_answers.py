"""The onboarding's batched greedy answers and blocked KL rows (issue 54, item 6): the same tokens as one question at a
time, in fewer forward passes, and the same numbers as the whole-matrix formulas, bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from tiny_models import make_tiny_model


@pytest.fixture(scope="module", params=["dense", "sliding"])
def tiny_lm(request, tmp_path_factory):
    from kvcodec.models.load import load_model

    return load_model(str(make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)))


def _caches(lm):
    from kvcodec.models.capture import capture

    rng = np.random.default_rng(0)
    vocab = int(lm.model.config.get_text_config().vocab_size)
    return [capture(lm, token_ids=rng.integers(3, vocab, size=n)) for n in (96, 81)], rng, vocab


def test_batched_answers_are_the_one_by_one_answers(tiny_lm, monkeypatch):
    from kvcodec.models.quality import greedy_answer, greedy_answers

    lm = tiny_lm
    (c1, c2), rng, vocab = _caches(lm)
    qs = [rng.integers(3, vocab, size=n) for n in (7, 9, 7, 5)]  # unequal lengths: padded (dense) or grouped (sliding)
    for stop in (True, False):
        one = [greedy_answer(lm, c1, q, 6, stop_at_eos=stop) for q in qs]
        assert greedy_answers(lm, c1, qs, 6, stop_at_eos=stop) == one
        mixed = [c1, c2, c2, c1]  # one cache per row, of different lengths
        assert greedy_answers(lm, mixed, qs, 6, stop_at_eos=stop) == \
            [greedy_answer(lm, c, q, 6, stop_at_eos=stop) for c, q in zip(mixed, qs)]
    # batched: fewer forward passes than one question at a time (4 questions x 6 tokens = 24 one by one)
    calls = []
    real = lm.model.forward
    monkeypatch.setattr(lm.model, "forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    greedy_answers(lm, c1, qs, 6, stop_at_eos=False)
    sliding = any(w is not None for w in (lm.layout.windows or ()))
    assert len(calls) == (3 if sliding else 1) * 6  # sliding: the equal lengths (7, 7) share a batch, 9 and 5 alone


def test_masked_gqa_attention_is_transformers_sdpa():
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from kvcodec.models.quality import _gqa_masked_attention

    class Attn(torch.nn.Module):
        num_key_value_groups = 3
        is_causal = True

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, n, 16, generator=g) for h, n in ((6, 1), (2, 40), (2, 40)))
    mask = torch.ones(2, 1, 1, 40, dtype=torch.bool)
    mask[0, ..., 30:33] = False
    got, _ = _gqa_masked_attention(Attn(), q, k, v, mask, scaling=0.25)
    want, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_exact_side_is_the_whole_matrix_form_bit_for_bit():
    import torch

    from kvcodec.models.quality import ExactSide, max_rival_gain

    g = torch.Generator().manual_seed(1)
    N, V = 11, 3000  # N not a multiple of the block's rows
    exact = 3 * torch.randn(N, V, generator=g)
    dec = exact + 0.1 * torch.randn(N, V, generator=g)
    cont = np.random.default_rng(0).integers(0, V, size=N)
    lp_e, lp_d = torch.log_softmax(exact.double(), -1), torch.log_softmax(dec.double(), -1)
    tgt = torch.as_tensor(cont[1:], dtype=torch.int64)[:, None]
    want = {"kl": float((lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).mean()),
            "rival_gain": max_rival_gain(exact, dec),
            "dnll": float((-lp_d[:-1].gather(1, tgt)[:, 0] - -lp_e[:-1].gather(1, tgt)[:, 0]).mean())}
    assert ExactSide(exact, cont).compare(dec) == want
    assert ExactSide(exact).compare(dec) == {k: v for k, v in want.items() if k != "dnll"}
