"""The answer probe (kvcodec.onboard.answercheck): planted facts in tuning texts, answers compared token for token."""

from __future__ import annotations

import numpy as np
import pytest


@pytest.fixture(scope="module")
def lm():
    from kvcodec.models.load import load_model

    return load_model("smollm2")


def test_probe_contexts_plant_every_fact_in_the_chat_format(lm):
    """Each probe context starts with the model's chat prefix, holds every planted fact once, fits its budget, and is
    the same on every call (the probe's verdict must not move between fits)."""
    from kvcodec.models.chat import ChatFormat
    from kvcodec.onboard.answercheck import FACTS, PROBE_TEXTS, probe_contexts

    a, b = probe_contexts(lm, tokens=768), probe_contexts(lm, tokens=768)
    assert [c.text for c in a] == list(PROBE_TEXTS)
    prefix = ChatFormat.for_tokenizer(lm.tokenizer).prefix
    for c, d in zip(a, b):
        assert np.array_equal(c.ids, d.ids) and len(c.ids) <= 768 and np.array_equal(c.ids[:len(prefix)], prefix)
        text = lm.tokenizer.decode(c.ids)
        assert text.count("The access code of the") == FACTS and len(c.questions) == FACTS


def test_the_probe_keeps_the_step_that_keeps_answers_and_lowers_one_that_loses_them(lm):
    """Exact K/V keep every answer at factor 1; K/V destroyed at factor 1 and exact below it are kept only at the
    next factor; destroyed at every factor: the last factor, with what each try saw."""
    from kvcodec.onboard.answercheck import STEP_FACTORS, answer_step_factor, probe_contexts
    from kvcodec.plan.presets import get_plan

    ctx = probe_contexts(lm, tokens=640)[:1]
    lossless = lambda cache, f: get_plan("lossless", cache)  # noqa: E731
    wrecked = lambda cache, f: get_plan("balanced", cache, lm=None, step0=50.0)  # noqa: E731
    assert answer_step_factor(lm, ctx, lossless)["factor"] == 1.0
    r = answer_step_factor(lm, ctx, lambda cache, f: (wrecked if f == 1.0 else lossless)(cache, f))
    assert r["factor"] == STEP_FACTORS[1] and r["tried"][0]["identical"] < r["tried"][0]["questions"]
    r = answer_step_factor(lm, ctx, wrecked)
    assert r["factor"] == STEP_FACTORS[-1] and len(r["tried"]) == len(STEP_FACTORS)


def test_probe_contexts_and_chat_answers_stay_inside_a_small_window(tmp_path):
    """A model whose window is shorter than the probe's budget (OPT: learned positions, which fail in their embedding
    lookup past it) gets probe contexts that leave room for the chat factor's question and answer, and a chat
    continuation never runs past the window: it is cut to fit, or refused in one line when nothing fits."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcodec.errors import KvcInputError
    from kvcodec.models.capture import capture
    from kvcodec.models.load import load_model, shipped_model_dir
    from kvcodec.onboard.answercheck import CONTINUATION_ROOM, probe_contexts
    from kvcodec.onboard.chatfactor import chat_continuations

    window = 640
    cfg = AutoConfig.for_model("opt", hidden_size=64, ffn_dim=128, word_embed_proj_dim=64, num_hidden_layers=1,
                               num_attention_heads=2, vocab_size=49152, max_position_embeddings=window)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "opt")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_dir("smollm2") / f, tmp_path / "opt" / f)
    small = load_model(str(tmp_path / "opt"))
    ctx = probe_contexts(small)
    assert ctx and all(len(c.ids) <= window - CONTINUATION_ROOM for c in ctx)
    near = capture(small, token_ids=np.resize(ctx[0].ids, window - 40))
    assert chat_continuations(small, []) == []  # no probe context fits: nothing to continue
    (cont,) = chat_continuations(small, [near])
    assert 0 < len(cont) <= 40  # the question turn and as many answer tokens as fit (128 asked)
    full = capture(small, token_ids=np.resize(ctx[0].ids, window - 2))
    with pytest.raises(KvcInputError, match="no room for an answer"):
        chat_continuations(small, [full])
