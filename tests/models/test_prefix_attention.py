"""New tokens over a cached prefix, attention split in two (kvcodec.models.prefix_attention).

The claim is that it is the same attention, only scheduled differently: the
split result equals one masked SDPA call to float rounding, on grouped-query
shapes and on the embedded model's real queries and keys (answers over a
cache are the same tokens), and every mask it was not built for goes to
transformers' own function unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvcodec.models import prefix_attention as pa


def masked(q, k, v, n_prefix, scale):
    rep = q.shape[1] // k.shape[1]
    n = q.shape[2]
    m = torch.ones(n, n_prefix + n, dtype=torch.bool).tril(diagonal=n_prefix)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=m, scale=scale)


@pytest.mark.parametrize("b,hq,hkv,p,n,d", [(1, 9, 3, 37, 11, 64), (2, 4, 4, 5, 3, 16), (1, 8, 1, 100, 50, 32),
                                             (1, 2, 1, 1, 2, 8)])
def test_split_equals_one_masked_call(b, hq, hkv, p, n, d):
    g = torch.Generator().manual_seed(p * 7 + n)
    q, k, v = (torch.randn(b, h, t, d, generator=g) * 3 for h, t in ((hq, n), (hkv, p + n), (hkv, p + n)))
    got = pa.split_prefix_attention(q, k, v, p, 0.2)
    assert got.shape == (b, hq, n, d)
    torch.testing.assert_close(got, masked(q, k, v, p, 0.2), atol=5e-5, rtol=1e-4)  # float32 rounding of scores up to ~|30|


def test_only_a_plain_causal_mask_after_a_prefix_is_split():
    p, n = 6, 4
    causal = torch.ones(n, p + n, dtype=torch.bool).tril(diagonal=p)[None, None]
    assert pa._causal_after_prefix(causal.clone(), p, n)
    additive = torch.zeros(1, 1, n, p + n).masked_fill(~causal, float("-inf"))
    assert pa._causal_after_prefix(additive, p, n)
    sliding = causal.clone()
    sliding[..., :2] = False  # a sliding window hides the oldest keys
    padded = causal.repeat(2, 1, 1, 1)
    padded[1, ..., :1] = False  # the second row of the batch is left-padded
    peeking = causal.clone()
    peeking[..., 0, -1] = True  # a new token sees a later one
    for bad in (None, sliding, padded, peeking, causal[..., :-1], causal.expand(1, 3, n, p + n)):
        pa._STATE.checked = None
        assert not pa._causal_after_prefix(bad, p, n)


def test_other_masks_go_to_transformers_unchanged():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Module:
        is_causal = True
        num_key_value_groups = 2

    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 5, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g), torch.randn(1, 2, 12, 8, generator=g)
    mask = torch.ones(5, 12, dtype=torch.bool).tril(diagonal=7)[None, None].clone()
    mask[..., :3] = False  # a sliding window
    pa._STATE.checked = None
    got, _ = pa._attention(Module(), q, k, v, mask, scaling=0.3)
    want, _ = sdpa_attention_forward(Module(), q, k, v, mask, scaling=0.3)
    assert torch.equal(got, want)


def test_the_embedded_model_answers_the_same_over_a_cache(monkeypatch):
    """Real queries and keys: new tokens over a captured context, split vs transformers' one masked call."""
    from kvcodec.integrations.hf import greedy_from
    from kvcodec.models.capture import model_cache, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    calls = []
    split = pa.split_prefix_attention
    monkeypatch.setattr(pa, "split_prefix_attention", lambda *a: calls.append(a[3]) or split(*a))
    lm = load_model()
    ids = tokenize(lm.tokenizer, load_text("apache2"))[:300]
    ctx, new = ids[:220], ids[220:]

    def cached() -> object:
        past = model_cache(lm)
        with torch.inference_mode():
            lm.model(input_ids=torch.as_tensor(ctx).unsqueeze(0), past_key_values=past, use_cache=True)
        return past

    def logits(use_split: bool) -> torch.Tensor:
        past = cached()
        pos = torch.arange(len(ctx), len(ids)).unsqueeze(0)
        with torch.inference_mode(), (pa.prefix_attention(lm) if use_split else contextlib.nullcontext()):
            return lm.model(input_ids=torch.as_tensor(new).unsqueeze(0), past_key_values=past, position_ids=pos).logits[0]

    ref = logits(False)
    assert calls == []
    got = logits(True)
    assert calls == [len(ctx)] * lm.layout.num_layers  # every layer took the split path
    assert lm.model.config._attn_implementation == "sdpa"  # and the model is back on its own attention
    assert float((got - ref).abs().max()) < 1e-4 * float(ref.abs().max())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    calls.clear()
    toks, _ = greedy_from(lm, cached(), len(ctx), new, 4)  # the answer path uses it
    assert len(calls) == lm.layout.num_layers and toks[0] == int(ref[-1].argmax())
