"""Any local HF model directory works (issue 19): one tiny model per attention/cache family.

Real checkpoints of these families are not on PyPI at CI size, so each family is a small
randomly initialised model saved as a local HF directory (safetensors + the embedded model's
tokenizer). Random weights say nothing about quality; they do exercise every code path that
depends on the architecture, and the checks are exact: the lossless `.kvc` decodes bit-exactly,
generation from the stored entry equals generation from the prefill (also past a sliding
window), a lossy preset calibrates, encodes and verifies with no model-specific code, and CacheBlend
runs through each family's own forward.
Quality per real model is in benchmarks/BENCHMARKS.md ("Model matrix").
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.model

FAMILIES = {
    # k/v biases, GQA
    "qwen2": dict(model_type="qwen2", num_attention_heads=4, num_key_value_heads=2),
    # sliding window on every layer (no layer_types), MQA, head_dim != hidden/heads
    "mistral": dict(model_type="mistral", num_attention_heads=4, num_key_value_heads=1, sliding_window=48, head_dim=32),
    # hybrid sliding/global layers
    "gemma2": dict(model_type="gemma2", num_attention_heads=4, num_key_value_heads=2, head_dim=32, sliding_window=48),
    # fused qkv projection, partial rotary
    "phi3": dict(model_type="phi3", num_attention_heads=4, num_key_value_heads=2, partial_rotary_factor=0.5),
    # per-head q/k norms
    "qwen3": dict(model_type="qwen3", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # layers without RoPE (NoPE: no_rope_layers[i] == 0), here layer 0, whose keys the re-rotation check compares
    "smollm3": dict(model_type="smollm3", num_attention_heads=4, num_key_value_heads=2, no_rope_layers=[0, 1],
                    pad_token_id=None, bos_token_id=None, eos_token_id=None),
    # one q/k norm over all heads' projections (not per head)
    "olmo2": dict(model_type="olmo2", num_attention_heads=4, num_key_value_heads=2),
    # multi-query attention named Falcon's way (multi_query, no num_key_value_heads), fused qkv, parallel attention
    "falcon": dict(model_type="falcon", num_attention_heads=4, new_decoder_architecture=False, multi_query=True),
    # learned absolute positions, no RoPE, config.json names n_layer/n_head/n_embd: capture, codec and store work;
    # blend cannot re-position such chunks and must say so in one line
    "gpt2": dict(model_type="gpt2", n_head=4),
    # MHA at head_dim 128, stored in bfloat16
    "llama-bf16": dict(model_type="llama", num_attention_heads=2, num_key_value_heads=2, head_dim=128,
                       torch_dtype="bfloat16"),
    # config.json says n_layers/n_heads/d_model (its entry in kvcodec/models/layout.py's FAMILIES), ALiBi (no RoPE),
    # blocks at `.transformer.blocks`
    "mpt": dict(model_type="mpt", num_attention_heads=4),
}
# decoder layers outside `.model.layers` (GPT-2 and Falcon: `.transformer.h`, MPT: `.transformer.blocks`):
# lossless works, and the calibration weighs their keys and values evenly
OTHER_LAYOUTS = ("falcon", "gpt2", "mpt")
# families whose attention does not run through transformers' attention functions (Falcon), or whose forward fails on
# one it did not name (MPT): token importance reads the weights their eager attention returns instead of the tap
UNTAPPED = ("falcon", "mpt")
N_TOKENS = 120  # > the sliding windows above


@pytest.fixture(autouse=True)
def _small_builds(monkeypatch):
    """What an entry point builds for a model on first use (its calibration, its rate model), built from one text
    at a short context here: these models are random, so the build's path is what the tests check, not its
    quality, and the default corpus cost ~65 s per family on the 2-core box where ~13 s does (issue 56)."""
    import functools

    from kvcodec.calibration import build
    from kvcodec.onboard import ratefit

    monkeypatch.setattr(build, "build_calibration", functools.partial(build.build_calibration, texts=("mpl2",),
                                                                      context=build.MIN_CONTEXT))
    monkeypatch.setattr(ratefit, "fit_rate_model", functools.partial(ratefit.fit_rate_model, texts=("gpl3",),
                                                                     lengths=(256,)))


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from tests._support.tiny_models import save_family_model

    root = tmp_path_factory.mktemp("families")
    return {name: save_family_model(root / name, kw, bfloat16=name.endswith("bf16")) for name, kw in FAMILIES.items()}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_flow(family, family_dirs, tmp_path):
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.format import KvcReader, write_kvc
    from kvcodec.api import make_plan
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    lm = load_model(str(family_dirs[family]))
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:N_TOKENS]
    cache = capture(lm, token_ids=ids)
    # the ragged layout: a sliding-window layer keeps exactly what transformers' own cache keeps (its last window - 1)
    want = tuple(N_TOKENS if w is None else w - 1 for w in lm.attention_windows)
    assert cache.layer_tokens == want
    if family in ("mistral", "gemma2"):
        assert cache.ragged
        _continues_like_a_fresh_prefill(lm, cache, ids)
        # a ragged cache cannot rerun its last queries (their keys were dropped): the capture observes them
        from kvcodec.models.importance import attention_importance

        scored = capture(lm, token_ids=ids, score_window=64)
        assert all(torch.equal(a, b) for a, b in zip(cache.keys + cache.values, scored.keys + scored.values))
        np.testing.assert_array_equal(scored.attention.scores, attention_importance(lm, ids, 64))
        # the eager weights a model the tap cannot observe is read by: the same scores, sliding masks included
        from kvcodec.models.importance import _eager_scores

        eager = _eager_scores(lm, torch.as_tensor(np.asarray(ids, np.int64))[None], 64, len(ids), True)
        np.testing.assert_allclose(eager, scored.attention.scores, rtol=1e-4, atol=1e-9)
    from kvcodec.models.attention_tap import tap_sees

    assert tap_sees(lm) == (family not in UNTAPPED)
    for preset in ("lossless", "balanced"):
        if preset != "lossless":  # the entry points build a model's calibration once (get_plan only loads it)
            from kvcodec.calibration.build import ensure_calibration

            cal = ensure_calibration(lm)
            if family in OTHER_LAYOUTS:  # attention modules kvcodec cannot find: every layer fitted by squared error
                every = list(range(lm.fingerprint.num_layers))
                assert cal.meta["even_weights"] == {"k": every, "v": every}
            else:
                assert "even_weights" not in cal.meta
        plan = make_plan(cache, preset, model=lm)
        p = tmp_path / f"{preset}.kvc"
        write_kvc(cache, p, plan)
        with KvcReader(p) as r:
            assert r.verify() == []
            dec = r.read_cache()
        lm.fingerprint.check_compatible(dec.fingerprint)
        if preset == "lossless":
            for a, b in zip(dec.keys + dec.values, cache.keys + cache.values):
                assert torch.equal(a, b)
        else:
            assert all(torch.isfinite(a).all() for a in dec.keys + dec.values)
            with KvcReader(p) as r1, KvcReader(tmp_path / "lossless.kvc") as r0:  # K/V payload bytes: a tiny file
                assert r1.sizes()["chunks"] < r0.sizes()["chunks"] / 3          # is mostly header
    kb = KnowledgeBase(lm, str(tmp_path / "store"), preset="lossless")
    doc = lm.tokenizer.decode(ids)
    first = kb.ask([doc], "What is this?", max_new_tokens=8)
    again = kb.ask([doc], "What is this?", max_new_tokens=8)
    assert first.source == "prefill" and again.source == "store"
    assert again.answer_ids == first.answer_ids
    assert np.array_equal(np.asarray(again.answer_ids), np.asarray(first.answer_ids))
    if family in OTHER_LAYOUTS:  # blend refuses in one line: GPT-2/MPT have no RoPE to re-position by, Falcon's layers
        from kvcodec.runtime.blend import blend  # are not where blend drives them
        from kvcodec.errors import KvcInputError

        chunks = [capture(lm, token_ids=ids[:70]), capture(lm, token_ids=ids[70:112])]
        with pytest.raises(KvcInputError, match="names no RoPE parameters|cannot find the .* decoder layers"):
            blend(lm, chunks, ids[112:], recompute_ratio=0.3)
        return
    _blends_through_its_own_forward(lm, ids)
    blended = kb.ask_blended([doc, lm.tokenizer.decode(ids[:40])], "What is this?", max_new_tokens=4)
    assert blended.source == "blend" and 1 <= len(blended.answer_ids) <= 4


def _blends_through_its_own_forward(lm, ids):
    """CacheBlend drives any family through its own forward: two chunk caches (the first longer than the
    sliding windows, so its sliding layers are ragged) re-rotated with the fingerprint's RoPE and recomputed
    at ratio 1 give the prefill's query logits and cache (measured bit-equal on these 2-layer models; fp32
    tolerance asserted), and a partial blend continues from a cache of the prefill's layout."""
    from kvcodec.runtime.blend import blend
    from kvcodec.models.cachelayout import prefill_kv
    from kvcodec.models.capture import capture

    chunks = [capture(lm, token_ids=ids[:70]), capture(lm, token_ids=ids[70:112])]
    q = ids[112:]
    _rerotation_matches_layer0(lm, chunks, ids[:112])
    with torch.inference_mode():
        ref = lm.model(input_ids=torch.as_tensor(ids)[None]).logits[0, 112:].float()
    one = blend(lm, chunks, q, recompute_ratio=1.0, return_query_logits=True)
    assert (one.query_logits - ref).abs().max().item() <= 1e-4
    want = prefill_kv(lm.model, ids)
    assert one.cache.layer_tokens == tuple(k.shape[1] for k, _ in want)
    for (k, v), bk, bv in zip(want, one.cache.keys, one.cache.values):
        assert (bk.float() - k.float()).abs().max().item() <= 1e-4 and (bv.float() - v.float()).abs().max().item() <= 1e-4
    part = blend(lm, chunks, q, recompute_ratio=0.3)
    with torch.inference_mode():
        nxt = lm.model(input_ids=torch.tensor([[int(part.logits_last.argmax())]]), past_key_values=part.dynamic_cache(lm),
                       position_ids=torch.tensor([[len(ids)]]), use_cache=True).logits
    assert torch.isfinite(nxt).all()


def _continues_like_a_fresh_prefill(lm, cache, ids):
    """The lossless `.kvc` of a ragged capture, loaded into transformers (its sliding layers as
    ``DynamicSlidingWindowLayer``s), gives bit-identical logits to the live prefill cache at every step of a
    continuation that runs far past the window, and the same greedy tokens."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    from kvcodec.format import encode_kvc_bytes
    from kvcodec.integrations.hf import load_cache
    from kvcodec.plan.presets import get_plan

    plan = get_plan("lossless", cache)
    data = encode_kvc_bytes(cache, plan)
    loaded = load_cache(data, lm)
    sliding = [isinstance(layer, DynamicSlidingWindowLayer) for layer in loaded.cache.layers]
    assert sliding == [w is not None for w in lm.attention_windows]
    with torch.inference_mode():
        live = lm.model(input_ids=torch.as_tensor(ids)[None], use_cache=True, logits_to_keep=1).past_key_values
        tok = 7
        for step in range(60):  # 60 > the window: every stored token of a sliding layer is pushed out
            pos = torch.tensor([[len(ids) + step]])
            a = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=live, position_ids=pos, use_cache=True).logits
            b = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=loaded.cache, position_ids=pos, use_cache=True).logits
            assert torch.equal(a, b), f"step {step}: logits differ"
            tok = int(a[0, -1].argmax())


def _rerotation_matches_layer0(lm, chunks, ids):
    """The naive concatenation's layer-0 keys (re-rotated chunk keys) equal the prefill's: layer 0's K depend on
    the token and its position only, so this checks the per-layer RoPE frequencies blend re-positions with."""
    from kvcodec.runtime.blend import concat_chunks
    from kvcodec.models.cachelayout import prefill_kv
    from kvcodec.core.fingerprint import layer_applies_rope

    naive, want = concat_chunks(lm, chunks), prefill_kv(lm.model, ids)
    assert naive.keys[0].shape == want[0][0].shape
    err = (naive.keys[0] - want[0][0].float()).abs().max().item()
    assert err <= 1e-4 * max(1.0, want[0][0].abs().max().item()), err
    moved = (chunks[1].keys[0][:, -8:].float() - want[0][0][:, -8:].float()).abs().max().item()
    if layer_applies_rope(lm.fingerprint.rope, 0):
        assert moved > 100 * err  # has teeth: the chunk's own keys sit at other positions
    else:  # a NoPE layer: keys carry no position, so re-positioning must leave them exactly as they are
        assert moved == 0 and err == 0


SCALED_ROPE = {
    "linear": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "rope_theta": 10000.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
}


def test_blend_rerotates_statically_scaled_rope(tmp_path):
    """CacheBlend re-positions keys of linear / llama3 / YaRN scaled RoPE (transformers' own frequencies) exactly;
    dynamic NTK (frequencies depend on the sequence length) is refused with one line naming it."""
    from kvcodec.runtime.blend import blend
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.errors import KvcInputError
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text
    from tests._support.tiny_models import save_family_model

    for name, rp in SCALED_ROPE.items():
        lm = load_model(str(save_family_model(tmp_path / name, dict(model_type="llama", num_attention_heads=4,
                                                                      num_key_value_heads=2, rope_parameters=rp))))
        ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:120]
        chunks = [capture(lm, token_ids=ids[:70]), capture(lm, token_ids=ids[70:112])]
        if name == "dynamic":
            with pytest.raises(KvcInputError, match="'dynamic'"):
                blend(lm, chunks, ids[112:])
            continue
        _rerotation_matches_layer0(lm, chunks, ids[:112])
        assert torch.isfinite(blend(lm, chunks, ids[112:], recompute_ratio=0.3).logits_last).all()


def test_capture_cache_refreshes_a_capture_of_another_layout(family_dirs, tmp_path):
    """A stored capture whose layers all hold every token (the layout before ragged sliding
    layers) is captured again, not measured as if it were today's capture."""
    from kvcodec.models.capture import capture
    from kvcodec.eval.curve import cached_capture
    from kvcodec.core.kvcache import KVCache, save_h5
    from kvcodec.models.load import load_model

    lm = load_model(str(family_dirs["gemma2"]))
    ids = np.arange(5, 5 + N_TOKENS, dtype=np.int64)
    fresh = cached_capture(lm, ids, tmp_path)
    assert fresh.ragged and min(fresh.layer_tokens) < N_TOKENS
    [stored] = list(tmp_path.glob("*.h5"))
    full = capture(lm, token_ids=ids, full_layers=True)
    assert not full.ragged
    save_h5(KVCache(full.keys, full.values, full.token_ids, full.fingerprint, None, dict(full.meta)), stored)
    again = cached_capture(lm, ids, tmp_path)
    assert tuple(again.layer_tokens) == tuple(fresh.layer_tokens)


def test_kvc_calibrate_chooses_the_basis(family_dirs, tmp_path, monkeypatch, capsys):
    """head_dim 128 (two 64-channel blocks): ``kvc calibrate`` builds the block-diagonal basis by default,
    ``--basis full`` one PCA over the whole head; the report says which, and a request for the other
    basis without ``--force`` says what the existing calibration has instead of silently ignoring it."""
    import json

    from cliutil import run_kvc
    from kvcodec.calibration.store import load_calibration

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    d = str(family_dirs["llama-bf16"])
    code, out, err = run_kvc(["calibrate", "-m", d, "--basis", "full", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["built"] and rep["channel_blocks"] is None, err
    full = load_calibration(rep["fingerprint"]).basis
    assert np.count_nonzero(full) > 0.9 * full.size
    code, out, _ = run_kvc(["calibrate", "-m", d], capsys)
    assert code == 0 and "it has the full basis" in out
    code, out, err = run_kvc(["calibrate", "-m", d, "--force", "--json"], capsys)
    rep = json.loads(out)
    assert code == 0 and rep["built"] and rep["channel_blocks"] == [[0, 64], [64, 128]], err
    b = load_calibration(rep["fingerprint"]).basis.astype(np.float32)  # [L, 2, H, D, D]
    on_lo, on_hi = (b[..., :64, :] != 0).any(-2), (b[..., 64:, :] != 0).any(-2)
    assert not (on_lo & on_hi).any() and (on_lo | on_hi).all(), "every column lives on exactly one block"


# What each family's layout says (kvcodec/models/layout.py): per family, (query projection, q-norm scope,
# RoPE kind per layer); None: the decoder layers are not where kvcodec drives them
LAYOUTS = {
    "qwen2": ("q_proj", None, ("plain", "plain")),
    "mistral": ("q_proj", None, ("plain", "plain")),
    "gemma2": ("q_proj", None, ("plain", "plain")),
    "phi3": ("qkv_proj", None, ("plain", "plain")),  # the queries are the fused projection's first outputs
    "qwen3": ("q_proj", "per_head", ("plain", "plain")),
    "smollm3": ("q_proj", None, ("none", "plain")),
    "olmo2": ("q_proj", "all_heads", ("plain", "plain")),
    "falcon": None,
    "gpt2": None,
    "llama-bf16": ("q_proj", None, ("plain", "plain")),
    "mpt": None,
}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_layout(family, family_dirs):
    """Each family's layout: GQA as transformers reads the config, the windows its cache keeps, where the queries
    are and how they are normalised, and each layer's RoPE; all from kvcodec/models/layout.py."""
    from kvcodec.models.layout import LEADING
    from kvcodec.models.load import load_model

    lm = load_model(str(family_dirs[family]))
    lay = lm.layout
    tc = lm.model.config.get_text_config()
    assert lay.num_layers == tc.num_hidden_layers == lm.fingerprint.num_layers
    assert lay.num_heads == tc.num_attention_heads and lay.num_kv_heads == lm.fingerprint.num_kv_heads
    assert (lay.num_kv_heads, lay.head_dim) == tuple(lm.model(input_ids=torch.tensor([[1, 2]]), use_cache=True)
                                                     .past_key_values.layers[0].keys.shape[1::2])
    assert list(lay.windows) == lm.attention_windows
    assert lay.rope == lm.fingerprint.rope
    want = LAYOUTS[family]
    assert (lay.decoder_layers(lm.model) is not None) == (want is not None) == (family not in OTHER_LAYOUTS)
    if want is None:
        return
    proj, scope, kinds = want
    assert tuple(a.q_proj for a in lay.attention) == (proj,) * lay.num_layers
    assert tuple(a.q_norm_scope for a in lay.attention) == (scope,) * lay.num_layers
    assert tuple(lay.layer_rope(i).kind for i in range(lay.num_layers)) == kinds
    q, norm, _, order = lay.query(lm.model, 0)
    assert order == LEADING
    assert q.out_features >= lay.num_heads * lay.head_dim and (norm is None) == (scope is None)
    assert lay.output_projection(lm.model, 0).in_features == lay.num_heads * lay.head_dim



@torch.inference_mode()
def test_adjacent_pairs_and_unrotated_layers_are_re_positioned_as_the_model_rotates(tmp_path):
    """Cohere 2 rotates adjacent channel pairs (2j, 2j + 1) on its sliding layers, where transformers' default pairs
    j with j + dim/2, and applies no RoPE on its global layers; its config says neither and reads as plain RoPE on
    every layer. Blend, the naive concatenation and redact re-positioned its keys silently wrong (layer 0 off by
    about 1.5x their size). The model's own forward now tells each layer's rotation (kvcodec/models/rope_probe.py):
    every layer's re-rotated keys equal a prefill at the shifted positions, and blend runs as on any family."""
    from kvcodec.codecs.rope_tables import inv_freq
    from kvcodec.models.capture import tokenize
    from kvcodec.models.layout import PLAIN
    from kvcodec.models.load import load_model
    from kvcodec.models.rope_probe import AdjacentPairs
    from kvcodec.runtime.blend import layer_inv_freqs, rerotate_keys
    from kvcodec.texts import load_text
    from tests._support.tiny_models import save_family_model

    lm = load_model(str(save_family_model(tmp_path / "cohere2", dict(
        model_type="cohere2", num_attention_heads=4, num_key_value_heads=2, sliding_window=48,
        layer_types=["sliding_attention", "full_attention"]))))
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:N_TOKENS]
    r = lm.layout.layer_rope(0)
    assert r.kind == lm.layout.layer_rope(1).kind == PLAIN  # what the config says
    freqs = layer_inv_freqs(lm)
    x = torch.as_tensor(ids[:40])[None]
    at0, at37 = (lm.model(input_ids=x, position_ids=torch.arange(o, o + 40)[None], use_cache=True).past_key_values
                 for o in (0, 37))
    for f, a, b in zip(freqs, at0.layers, at37.layers):
        assert (rerotate_keys(a.keys[0], 37, f) - b.keys[0]).abs().max() <= 1e-5 * b.keys[0].abs().max()
    assert isinstance(freqs[0], AdjacentPairs) and len(freqs[1]) == 0
    wrong = rerotate_keys(at0.layers[0].keys[0], 37, inv_freq(r.theta, r.dim))  # the config's reading
    assert (wrong - at37.layers[0].keys[0]).abs().max() > 0.5 * at37.layers[0].keys[0].abs().max()
    _blends_through_its_own_forward(lm, ids)


def test_a_rotation_kvcodec_cannot_reproduce_is_refused(tmp_path, monkeypatch):
    """A RoPE reading the model's forward does not confirm in any pairing (here: frequencies of another theta) is
    refused by blend, the naive concatenation and redact in one line naming the layer, not applied."""
    from kvcodec.edit.redact import redact_cache
    from kvcodec.errors import KvcInputError
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.runtime import blend as blend_mod
    from kvcodec.texts import load_text
    from tests._support.tiny_models import save_family_model

    lm = load_model(str(save_family_model(tmp_path / "llama", dict(model_type="llama", num_attention_heads=4,
                                                                    num_key_value_heads=2))))
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:60]
    chunks = [capture(lm, token_ids=ids[:30]), capture(lm, token_ids=ids[30:50])]
    read = blend_mod.inv_freq
    monkeypatch.setattr(blend_mod, "inv_freq", lambda theta, dim: read(theta * 4, dim))
    for run in (lambda: blend_mod.blend(lm, chunks, ids[50:], recompute_ratio=0.3),
                lambda: blend_mod.concat_chunks(lm, chunks), lambda: redact_cache(lm, capture(lm, token_ids=ids), [(10, 20)])):
        with pytest.raises(KvcInputError, match="cannot re-position this model's keys: its layer 0 "):
            run()


def test_blend_refuses_a_family_whose_layers_take_other_hidden_states(tmp_path):
    """Gemma 3n's decoder layers carry their AltUp predictions as hidden states [4, 1, T, D], not [1, T, D]: blend's
    token selection indexed them as the latter and escaped as IndexError. It refuses in one line; storing works."""
    from kvcodec.errors import KvcInputError
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.runtime.blend import blend
    from kvcodec.texts import load_text
    from tests._support.tiny_models import save_family_model

    lm = load_model(str(save_family_model(tmp_path / "gemma3n", dict(
        model_type="gemma3n_text", num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=48,
        layer_types=["sliding_attention", "full_attention"], num_kv_shared_layers=0,
        hidden_size_per_layer_input=16, laurel_rank=8, activation_sparsity_pattern=[0.0, 0.0]))))
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:60]
    chunks = [capture(lm, token_ids=ids[:30]), capture(lm, token_ids=ids[30:50])]
    with pytest.raises(KvcInputError, match="blend could not tap layer 1 of Gemma3nForCausalLM"):
        blend(lm, chunks, ids[50:], recompute_ratio=0.3)
