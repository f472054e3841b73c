"""SDPA scheduled so masked-out scores are not computed (kvcodec.models.sdpa_schedule).

The claim is that it is the same attention, only scheduled differently: the
split (new tokens over a cached prefix) and the band (sliding windows) each
equal one masked SDPA call to float rounding, on grouped-query shapes and on
real models' queries and keys (answers over a cache are the same tokens), and
every mask they were not built for goes to transformers' own function unchanged.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from kvcodec.models import sdpa_schedule as pa


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
    got, _ = pa.attention(Module(), q, k, v, mask, scaling=0.3)
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
        with torch.inference_mode(), (pa.fast_sdpa(lm) if use_split else contextlib.nullcontext()):
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


class _Gqa:
    is_causal = True

    def __init__(self, groups: int) -> None:
        self.num_key_value_groups = groups


def band(n_q: int, n_k: int, window: int) -> torch.Tensor:
    """The sliding-window mask of ``n_q`` new tokens ending at key ``n_k - 1``: each sees itself and ``window - 1`` before."""
    q = torch.arange(n_k - n_q, n_k)[:, None]
    k = torch.arange(n_k)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


@pytest.mark.parametrize("n_q,n_k,window,rows", [(300, 300, 40, 64), (200, 239, 40, 32), (97, 97, 16, 10), (64, 64, 8, 16)])
def test_band_equals_one_masked_call(monkeypatch, n_q, n_k, window, rows):
    """A prefill (n_q == n_k) and new tokens over a window's cache, rows per block dividing n_q or not."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    monkeypatch.setattr(pa, "BAND_ROWS", rows)
    g = torch.Generator().manual_seed(n_q + window)
    q = torch.randn(1, 4, n_q, 16, generator=g) * 3
    k, v = (torch.randn(1, 2, n_k, 16, generator=g) * 3 for _ in range(2))
    mask = band(n_q, n_k, window)
    pa._STATE.band = None
    blocks = pa._band_blocks(mask, n_q, n_k)
    assert blocks is not None and blocks[0][0] == 0 and blocks[-1][1] == n_q
    assert all(c1 - c0 <= (r1 - r0) + window - 1 for r0, r1, c0, c1 in blocks)  # only the window's keys per block
    got, _ = pa.attention(_Gqa(2), q, k, v, mask, scaling=0.25, sliding_window=window)
    want, _ = sdpa_attention_forward(_Gqa(2), q, k, v, mask, scaling=0.25)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-4)


def test_only_a_boolean_band_with_a_key_for_every_row_is_run_in_blocks(monkeypatch):
    monkeypatch.setattr(pa, "BAND_ROWS", 16)
    mask = band(128, 128, 8)
    additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    blind = mask.clone()
    blind[..., 5, :] = False  # a row that sees no key (padding)
    dense = torch.ones(1, 1, 128, 128, dtype=torch.bool).tril()  # causal from 0: blocks would compute over half
    for bad in (additive, blind, dense, mask[..., :-1], mask[0]):
        pa._STATE.band = None
        assert pa._band_blocks(bad, 128, 128) is None
    pa._STATE.band = None
    assert pa._band_blocks(mask, 128, 128) is not None
    assert pa._band_blocks(mask, 128, 128) is pa._STATE.band[1]  # once per mask object
    del mask
    assert pa._STATE.band[0]() is None  # and the state does not keep a (possibly gigabyte) mask alive


def test_a_sliding_window_model_prefills_and_answers_the_same(tmp_path, monkeypatch):
    """A small Gemma 3 (sliding and global layers, random weights): the band and split paths on a real forward."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcodec.integrations.hf import greedy_from
    from kvcodec.models.capture import model_cache, prefill, tokenize
    from kvcodec.models.load import load_model, shipped_model_dir
    from kvcodec.texts import load_text

    cfg = AutoConfig.for_model("gemma3_text", hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=1, head_dim=32, vocab_size=49152,
                               sliding_window=24, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                               max_position_embeddings=2048)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_dir("smollm2") / f, tmp_path / f)
    lm = load_model(str(tmp_path))
    assert lm.model.config._attn_implementation == "sdpa"
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:400]
    monkeypatch.setattr(pa, "BAND_ROWS", 32)
    banded = []
    run = pa.banded_attention
    monkeypatch.setattr(pa, "banded_attention", lambda *a, **k: banded.append(a[1].shape[2]) or run(*a, **k))

    def plain_prefill():
        with torch.inference_mode():
            return lm.model(input_ids=torch.as_tensor(ids[:300])[None], past_key_values=model_cache(lm), use_cache=True,
                            logits_to_keep=0)

    ref = plain_prefill()
    assert banded == []
    past, got = prefill(lm, ids[:300], logits_to_keep=0)  # the prefill runs on the schedule
    assert banded == [300, 300]  # both sliding layers ran in blocks
    assert float((got - ref.logits[0]).abs().max()) < 1e-4 * float(ref.logits.abs().max())
    for a, b in zip(past.layers, ref.past_key_values.layers):
        torch.testing.assert_close(a.keys, b.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(a.values, b.values, atol=1e-4, rtol=1e-4)
    banded.clear()
    with torch.inference_mode():
        want = lm.model(input_ids=torch.as_tensor(ids[300:])[None], past_key_values=plain_prefill().past_key_values,
                        position_ids=torch.arange(300, 400)[None]).logits[0, -1]
    toks, _ = greedy_from(lm, past, 300, ids[300:], 3)  # 100 new tokens over the windows' caches: blocks again
    assert banded == [100, 100]
    assert toks[0] == int(want.argmax())


def test_split_keeps_a_bfloat16_query_s_dtype():
    """The flash kernel's log-sum-exps are float32 whatever the inputs; the merged output is the query's dtype, or a
    bfloat16 layer's output projection gets float32 (an onboarding twin's importance pass failed on that)."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, t, 32, generator=g).to(torch.bfloat16) for h, t in ((4, 5), (2, 12), (2, 12)))
    got = pa.split_prefix_attention(q, k, v, 7, 0.2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), masked(q.float(), k.float(), v.float(), 7, 0.2), atol=3e-2, rtol=3e-2)
