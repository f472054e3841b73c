"""A rate-model fit prefills and scores the answer probe's contexts once, for the answer probe and the chat factors
(issue 54, item 6), and its rate model is the one each of them prefilling its own contexts (and rate control scoring
each context per preset) gives, number for number."""

from __future__ import annotations

import pytest

from tiny_models import make_tiny_model


@pytest.mark.parametrize("family", ["dense", "sliding"])
def test_shared_probe_prefills_give_the_same_rate_model(family, tmp_path, monkeypatch):
    import kvcodec.onboard.answercheck as answercheck
    import kvcodec.onboard.ratefit as ratefit
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import answer_targets, lossy_settings, preset_targets

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    # the claim is about sharing: both fits prefill in the model's own dtype (the bfloat16 twin: test_onboard_dtype.py)
    monkeypatch.setenv("KVCODEC_ONBOARD_DTYPE", "float32")
    lm = load_model(str(make_tiny_model(tmp_path / family, family, window=1280)))  # the probe contexts need ~1,000 tokens
    cal = ensure_calibration(lm, progress=False)
    prefills: list[int] = []
    real = answercheck.probe_caches

    def counted(lm, contexts):
        prefills.append(len(contexts))
        return real(lm, contexts)

    monkeypatch.setattr(answercheck, "probe_caches", counted)

    def fit():
        return ratefit.fit_rate_model(lm, cal, lossy_settings(), answers=answer_targets(), targets=preset_targets(),
                                      progress=False, recipe=ratefit.QUICK)

    shared = fit()
    assert prefills and prefills[0] > 0 and len(prefills) == 1  # one prefill per context, for the whole fit
    prefills.clear()
    with monkeypatch.context() as mp:
        mp.setattr(ratefit, "_probe", lambda lm, fast=None: None)  # as before: each measurement prefills its own
        mp.setattr(answercheck.Probe, "importance", lambda self, cache, tokenscale: None)  # and controlled_plan scores
        alone = fit()
    assert len(prefills) == len([n for n in lossy_settings() if n in answer_targets()]) + 1
    a, b = shared.to_json(), alone.to_json()
    a.pop("fit_s"), b.pop("fit_s")
    assert a == b
    assert shared.chat_factor and shared.answer_step
