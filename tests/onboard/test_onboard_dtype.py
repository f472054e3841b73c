"""Onboarding's prefills on the bfloat16 twin, its measurements on the model itself (kvcodec.models.compute).

The split is the point: a continuation scored in bfloat16 has a KL floor of ~1e-3 that a rate model would read as the
codec's, while a bfloat16 prefill continued in float32 measures float32's KL. So on a fit with the twin every
continuation a KL or an answer is read from runs on the float32 model, every capture on the twin, the files say so,
and they are filed under the float32 model's fingerprint.
"""

from __future__ import annotations

import torch

from tiny_models import make_tiny_model


def _dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def test_a_bfloat16_onboarding_prefills_on_the_twin_and_measures_on_the_model(tmp_path, monkeypatch):
    import kvcodec.models.capture as capture_mod
    import kvcodec.models.quality as quality
    import kvcodec.onboard.ratefit as ratefit
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import RateModel
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import answer_targets, lossy_settings, preset_targets

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCODEC_ONBOARD_DTYPE", "bfloat16")
    lm = load_model(str(make_tiny_model(tmp_path / "dense", "dense", window=1280)))
    assert _dtype(lm.model) == torch.float32
    captured, continued, answered = [], [], []
    real_capture, real_continue, real_greedy = capture_mod.capture, quality.continue_logits, quality.greedy_answers

    def capture(m, *a, **k):
        captured.append(_dtype(m.model))
        return real_capture(m, *a, **k)

    def continue_logits(m, *a, **k):
        continued.append(_dtype(m.model))
        return real_continue(m, *a, **k)

    def greedy_answers(m, caches, questions, *a, **k):
        answered.append((_dtype(m.model), k.get("stop_at_eos", True)))
        return real_greedy(m, caches, questions, *a, **k)

    monkeypatch.setattr(capture_mod, "capture", capture)
    monkeypatch.setattr(quality, "continue_logits", continue_logits)
    monkeypatch.setattr(quality, "greedy_answers", greedy_answers)
    cal = ensure_calibration(lm, progress=False)
    assert cal.meta["compute_dtype"] == "bfloat16" and cal.meta["fingerprint_id"] == lm.fingerprint.id
    captured.clear()
    rm = ratefit.fit_rate_model(lm, cal, lossy_settings(), answers=answer_targets(), targets=preset_targets(),
                                progress=False, recipe=ratefit.QUICK)
    assert captured and set(captured) == {torch.bfloat16}  # the fit's and the probe's prefills
    assert continued and set(continued) == {torch.float32}  # every KL is read in float32
    # the answer probe's answers (stopped at EOS) in float32; the chat factors' continuations made on the twin
    assert {d for d, stop in answered if stop} == {torch.float32}
    assert {d for d, stop in answered if not stop} == {torch.bfloat16}
    assert rm.prefill_dtype == "bfloat16" and rm.fingerprint_id == lm.fingerprint.id
    assert RateModel.from_json(rm.to_json(), "test").prefill_dtype == "bfloat16"
    assert _dtype(lm.model) == torch.float32  # the model itself untouched


def test_a_rate_model_s_prefill_dtype_is_checked(tmp_path):
    import pytest

    from kvcodec.calibration.ratemodel import RateModel
    from kvcodec.errors import KvcFormatError

    d = RateModel("f" * 16, "0" * 64, {"balanced": 1.0}, {}, 1024).to_json()
    assert RateModel.from_json(d, "x").prefill_dtype is None
    d["prefill_dtype"] = "int4"
    with pytest.raises(KvcFormatError, match="prefill_dtype"):
        RateModel.from_json(d, "x")


def test_a_merged_rate_model_says_a_part_was_prefilled_in_bfloat16():
    from dataclasses import replace

    from kvcodec.calibration.ratemodel import RateModel
    from kvcodec.onboard.ratefit import merge_rate_models
    from kvcodec.plan.presets import lossy_settings

    presets = {n: t for n, t in lossy_settings().items() if n in ("balanced", "small")}
    base = RateModel("f" * 16, "0" * 64, {"balanced": 1.0}, {}, 1024)
    part = replace(base, alpha={"small": 2.0}, prefill_dtype="bfloat16")
    assert merge_rate_models(base, part, presets).prefill_dtype == "bfloat16"
    assert merge_rate_models(part, base, presets).prefill_dtype == "bfloat16"
    assert merge_rate_models(base, base, presets).prefill_dtype is None
