"""Rate control (issue 33): the KL predictor mirrors the codec's noise, the step search, the rate model's
file, the targets' ranges, and how get_plan routes a lossy preset."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from kvcodec.errors import KvcFormatError, KvcInputError


def test_noise_power_is_the_codecs_own_error_in_the_metric(lm, real_cache):
    """The predictor's noise power per (layer, kind) equals the error of the real pipelines' round trip,
    measured in the calibration's whitened coefficients (tokens >= sink, no subsampling, uniform weights),
    with tokenscale's classes: if it mirrored the quantizer wrongly (step, widening, dropped
    coefficients, multipliers), the KL it predicts would be off by the same factor."""
    from kvcodec.calibration.build import coded_tensor, ensure_calibration
    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.codecs.quantnoise import noise_power
    from kvcodec.plan import ratecontrol as rate
    from kvcodec.models.importance import cache_importance
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT, kept_coefficients, layer_steps, token_classes, transform_plan
    from kvcodec.plan.presets import PRESETS

    cache = real_cache(192)
    cal = ensure_calibration(lm)
    settings = {k: v for k, v in PRESETS["balanced"].settings.items() if k != "step0"}
    imp = cache_importance(lm, cache, window=64)
    step0 = 0.3
    dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, importance=imp, **settings))
    sink = settings["sink"]
    opts = {**TOKENSCALE_DEFAULT, **settings["tokenscale"]}
    classes, table = token_classes(imp, sink, opts)
    co = rate.coefficients(cache, cal, sink, None, max_tokens=None)  # uniform weights: a plain mean
    steps = layer_steps(cal, step0)
    got = noise_power(co, steps, kept_coefficients(cal, steps, settings["group"]), 8, [table[c] for c in classes])
    want = np.zeros_like(got)
    for l in range(cache.num_layers):
        for ki, kind in enumerate("kv"):
            b = cal.basis[l, ki].astype(np.float64)
            proj = np.einsum("hdk,hkj->hdj", b, np.linalg.inv(np.einsum("hdk,hdj->hkj", b, b)))
            err = (coded_tensor(dec, l, kind) - coded_tensor(cache, l, kind)).astype(np.float64)[:, sink:]
            want[l, ki] = float(((err @ proj) ** 2).mean())
    ratio = got / want
    assert np.all(np.abs(ratio - 1) < 0.15), ratio  # fp16 storage of steps and the basis: a few percent
    assert abs(float(np.exp(np.log(ratio).mean())) - 1) < 0.05


def test_choose_step0_takes_the_largest_step_under_the_aim():
    from kvcodec.plan.ratecontrol import STEP_BRACKET, choose_step0

    calls: list[float] = []

    def quadratic(x: float) -> float:  # KL ∝ step²: the answer is 0.5
        calls.append(x)
        return 0.04 * x * x

    s = choose_step0(quadratic, 0.01)
    assert quadratic(s) <= 0.01 and s == pytest.approx(0.5, rel=2e-3)
    assert len(calls) <= 8  # a walk in log-log, not a bisection of the whole bracket
    for law in (lambda x: 0.01 * x ** 1.3, lambda x: 0.02 * x * x + 1e-4 * (x > 0.3), lambda x: 0.01 * math.sqrt(x)):
        s = choose_step0(law, 0.006, start=0.33)  # not a power law of 2, a jump, a flat law: still the largest step
        assert law(s) <= 0.006 and law(s * 1.01) > 0.006 * (1 - 2e-3)
    assert choose_step0(lambda x: 1.0, 0.01) == pytest.approx(STEP_BRACKET[0])  # unreachable: the finest step
    assert choose_step0(lambda x: 0.0, 0.01) == pytest.approx(STEP_BRACKET[1])  # anything meets it: the coarsest
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(KvcInputError):
            choose_step0(lambda x: x, bad)


def _model_file(tmp_path, cal, **change):
    from kvcodec.calibration.ratemodel import RateModel, save_rate_model

    rm = RateModel(str(cal.meta["fingerprint_id"]), str(cal.meta["content_sha256"]), {"balanced": 1.5, "small": 2.0},
                   {"balanced": 0.3, "small": 0.3}, 1024, 0.05)
    d = rm.to_json()
    d.update(change)
    path = tmp_path / "rm.json"
    if change:
        path.write_text(json.dumps(d))
    else:
        save_rate_model(rm, path)
    return path


def test_rate_model_file_round_trips_and_refuses_tampering(lm, tmp_path):
    from kvcodec.calibration import ratemodel
    from kvcodec.calibration.build import ensure_calibration

    cal = ensure_calibration(lm)
    rm = ratemodel._read(_model_file(tmp_path, cal), cal)
    assert rm.factor("balanced", 1024) == pytest.approx(1.5)
    assert rm.factor("balanced", 4096) == pytest.approx(1.5 * 4 ** 0.3)
    assert rm.factor("balanced", 256) == pytest.approx(1.5 * 4 ** ratemodel.SHORT_EXPONENT)  # outside the fit: conservative
    assert rm.factor("near-lossless", 1024) == pytest.approx(math.sqrt(1.5 * 2.0))  # unfitted preset: the mean
    # a length curve: log-linear in log tokens between its points, beta past the last
    curved = ratemodel._read(_model_file(tmp_path, cal, curve={"balanced": [[2048.0, 0.2], [4096.0, 0.9]]}), cal)
    assert curved.factor("balanced", 2048) == pytest.approx(1.5 * math.exp(0.2))
    assert curved.factor("balanced", 2896) == pytest.approx(1.5 * math.exp(0.2 + 0.7 * math.log(2896 / 2048) / math.log(2)))
    assert curved.factor("balanced", 4096) == pytest.approx(1.5 * math.exp(0.9))
    assert curved.factor("balanced", 8192) == pytest.approx(1.5 * math.exp(0.9) * 2 ** 0.3)
    for change in ({"alpha": {"balanced": float("nan")}}, {"alpha": {"balanced": 1e9}}, {"alpha": {}}, {"beta": -1},
                   {"beta": "0.3"}, {"t_ref": 0}, {"rival_per_step": -1.0}, {"version": 99}, {"format": "x"},
                   {"calibration_sha256": "0" * 64}, {"fingerprint_id": "0" * 32}, {"curve": {"balanced": [[512.0, 0.1]]}},
                   {"curve": {"balanced": [[4096.0, 0.1], [2048.0, 0.2]]}}, {"curve": {"balanced": [[2048.0, -0.5]]}},
                   {"curve": {"balanced": [[2048.0, 99.0]]}}, {"curve": [[2048.0, 0.1]]}, {"curve": {"balanced": [[2048.0]]}},
                   {"curve": {"unfitted": []}}, {"beta": 0.3}, {"beta": {"balanced": 9.0}}, {"layer_factor": [[1.0]]},
                   {"layer_factor": [[1.0, 1e3]]}, {"layer_factor": [[1.0, float("nan")]]}, {"layer_factor": "1"},
                   {"layer_factor": []}, {"version": 2}, {"chat_factor": {"balanced": {"factor": 0.5}}},
                   {"chat_factor": {"balanced": {"factor": 99.0}}}, {"chat_factor": {"unfitted": {"factor": 2.0}}},
                   {"chat_factor": {"balanced": 2.0}}):
        with pytest.raises(KvcFormatError) as e:
            ratemodel._read(_model_file(tmp_path, cal, **change), cal)
        assert "\n" not in str(e.value)
    (tmp_path / "rm.json").write_text("{not json")
    with pytest.raises(KvcFormatError):
        ratemodel._read(tmp_path / "rm.json", cal)


def test_layer_factors_scale_the_sensitivity_steps_and_prediction_follow(lm, tmp_path):
    """A rate model's measured per-(layer, kind) factors multiply the calibration's sensitivity and nothing else (same
    bases and means: files reference the same calibration), so the plans' steps follow the measured slopes
    (step ~ 1/sqrt(sens)) and each layer's predicted KL is its measured share; one object per calibration (its
    projections are computed once); a factor table for another layer count is one line."""
    import numpy as np

    from kvcodec.calibration import ratemodel
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.plan.pipelines import layer_steps

    cal = ensure_calibration(lm)
    L = cal.sensitivity.shape[0]
    f = np.ones((L, 2))
    f[0, 1], f[L - 1, 0] = 4.0, 0.25
    rm = ratemodel._read(_model_file(tmp_path, cal, layer_factor=f.tolist()), cal)
    alloc = rm.allocated(cal)
    assert alloc is rm.allocated(cal) and alloc.basis is cal.basis and alloc.mean is cal.mean
    assert np.allclose(alloc.sensitivity, cal.sensitivity * f, rtol=1e-6)
    r = layer_steps(alloc, 0.5) / layer_steps(cal, 0.5)
    assert r[0, 1] / r[1, 0] == pytest.approx(0.5, rel=1e-5) and r[L - 1, 0] / r[1, 0] == pytest.approx(2.0, rel=1e-5)
    assert ratemodel._read(_model_file(tmp_path, cal), cal).allocated(cal) is cal  # no factors: the calibration itself
    bad = ratemodel._read(_model_file(tmp_path, cal, layer_factor=[[1.0, 1.0]] * (L + 1)), cal)
    with pytest.raises(KvcFormatError) as e:
        bad.allocated(cal)
    assert "\n" not in str(e.value)


@pytest.mark.model
def test_layer_factor_is_each_tensors_measured_over_predicted_kl(lm, gpl3_ids, monkeypatch):
    """measure_layer_factor: per (layer, kind), shrunk geometric mean of measured / predicted KL with only that tensor
    decoded: scaling every calibrated sensitivity leaves every step, KL and noise as they were, so each unclipped
    factor divides the scale out exactly."""
    import numpy as np
    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.onboard import ratefit
    from kvcodec.plan.presets import lossy_settings

    monkeypatch.setattr(ratefit, "FIT_CONTINUATION", 32)
    cal = ensure_calibration(lm)
    table = dict(lossy_settings()["balanced"])
    jobs = [("gpl3", 128, gpl3_ids)]
    f = np.asarray(ratefit.measure_layer_factor(lm, cal, table, jobs, progress=False))
    L = cal.sensitivity.shape[0]
    lo, hi = ratefit.ALLOC_CLIP ** -ratefit.ALLOC_SHRINK, ratefit.ALLOC_CLIP ** ratefit.ALLOC_SHRINK
    assert f.shape == (L, 2) and np.isfinite(f).all() and (f >= lo * (1 - 1e-9)).all() and (f <= hi * (1 + 1e-9)).all()
    assert f.std() > 0  # it measured something per tensor
    # the predicted KL of a tensor is sens x noise: scale every sensitivity by 4 (the steps' geometric mean normalisation
    # keeps every step, so KL and noise are unchanged) and every factor shrinks by 4 ** -ALLOC_SHRINK, unless clipped
    scaled = replace(cal, sensitivity=(cal.sensitivity * 4).astype(np.float32))
    g = np.asarray(ratefit.measure_layer_factor(lm, scaled, table, jobs, progress=False))
    inside = (f > lo * 4 ** ratefit.ALLOC_SHRINK * 1.01) & (f < hi * 0.99)
    assert inside.sum() > L // 2
    assert np.allclose(g[inside], f[inside] * 4 ** -ratefit.ALLOC_SHRINK, rtol=1e-4)


def test_fit_factor_alpha_curve_and_slope():
    """alpha at t_ref, the length curve (never decreasing) and beta (its last segment's slope), per preset."""
    from kvcodec.onboard.ratefit import _fit_factor

    def rows(preset, T, *ratios):
        return [{"preset": preset, "tokens": T, "kl": r, "predicted": 1.0} for r in ratios]

    fit = (rows("balanced", 1024, 1.0, 4.0) + rows("small", 1024, 3.0, 3.0) + rows("balanced", 2048, 1.0, 1.0)
           + rows("small", 2048, 1.5, 1.5) + rows("balanced", 4096, 8.0, 8.0) + rows("small", 4096, 12.0, 12.0))
    alpha, curve, beta = _fit_factor(fit, ["balanced", "small"])
    assert alpha == pytest.approx({"balanced": 2.0, "small": 3.0})
    for preset in ("balanced", "small"):
        assert [t for t, _ in curve[preset]] == [2048.0, 4096.0]
        assert curve[preset][0][1] == 0.0  # measured below alpha at 2K: never predicted better than at 1K
        assert curve[preset][1][1] == pytest.approx(math.log(4.0))
        assert beta[preset] == pytest.approx(2.0)  # the last segment's slope (log 4 / log 2)


def test_targets_outside_a_presets_range_are_one_line():
    from kvcodec.plan.presets import PRESETS, target_for

    t = target_for(PRESETS["balanced"], target_kl=0.004)
    assert t.kl == 0.004 and t.top1 == PRESETS["balanced"].target.top1
    assert target_for(PRESETS["balanced"], target_dppl=1.0).kl == pytest.approx(math.log1p(0.01))
    for kw in ({"target_kl": 1e-6}, {"target_kl": 0.5}, {"target_dppl": 80.0}):
        with pytest.raises(KvcInputError) as e:
            target_for(PRESETS["balanced"], **kw)
        assert "outside preset balanced's range" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(KvcInputError):
        target_for(PRESETS["lossless"], target_kl=0.01)
    assert target_for(PRESETS["near-lossless"], target_kl=1e-4).greedy_tokens == 16


def test_get_plan_routes_lossy_presets_through_rate_control(monkeypatch, small_cache):
    """With a model and no step0: rate control (predict, or check on request); the table step otherwise."""
    from kvcodec.plan import presets
    from kvcodec.plan import ratecontrol as rate
    from kvcodec.plan.presets import get_plan

    calls = []
    monkeypatch.setattr(rate, "controlled_plan", lambda cache, lm, name, args, target, rm, check, importance:
                        calls.append((name, "step0" in args, target, check)) or "controlled")
    no_probe = SimpleNamespace(answer_factor=lambda preset: 1.0, fingerprint_id="test")
    assert get_plan("balanced", small_cache, lm=object(), rm=no_probe) == "controlled"
    assert get_plan("small", small_cache, lm=object(), rate="check", rm=no_probe) == "controlled"
    with pytest.raises(KvcInputError, match="rate model"):  # the planner only plans: it never fits one
        get_plan("balanced", small_cache, lm=object())
    assert calls == [("balanced", True, presets.PRESETS["balanced"].target, False),
                     ("small", True, presets.PRESETS["small"].target, True)]
    fixed = get_plan("balanced", small_cache, lm=None)  # no model: the golden-vector path, table step
    assert fixed.params["step0"] == presets.PRESETS["balanced"].settings["step0"] and "rate" not in fixed.params
    assert get_plan("balanced", small_cache, step0=0.5).params["step0"] == 0.5
    with pytest.raises(KvcInputError):
        get_plan("balanced", small_cache, rate="guess")
    assert len(calls) == 2


@pytest.mark.model
def test_rate_control_lands_inside_the_promise_on_a_held_out_text(lm):
    """The predicted step's file, measured on the real continuation of a held-out text, lies within
    [0.3, 1] x balanced's KL target, keeps top-1 agreement, and no model forward ran for the choice
    beyond token importance (the opt-in check is off)."""
    import torch

    from kvcodec.api import make_plan
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.quality import compare_logits, continue_logits
    from kvcodec.plan.presets import PRESETS
    from kvcodec.texts import load_text

    ids = tokenize(lm.tokenizer, load_text("c-stdlib"))
    cache = capture(lm, token_ids=ids[:768])
    cont = ids[768:1024]
    plan = make_plan(cache, "balanced", model=lm, calibration=ensure_calibration(lm))
    r = plan.params["rate"]
    assert r["mode"] == "predict" and "check" not in plan.params
    assert r["predicted_kl"] <= r["aim_kl"] * (1 + 1e-9)
    dec = KvcReader(encode_kvc_bytes(cache, plan)).read_cache()
    with torch.inference_mode():
        m = compare_logits(continue_logits(lm, cache, cont), continue_logits(lm, dec, cont), cont)
    target = PRESETS["balanced"].target
    assert 0.3 * target.kl <= m["kl_mean"] <= target.kl, (m, r)
    assert m["top1_agreement"] >= target.top1


def test_importance_floor_keeps_unseen_tokens_out_of_the_coarsest_class():
    """A token the last queries never read gets the coarsest class without the floor; with tokenscale's 2 % floor
    it is coded like a token of average importance / 50: the continuation may read it (pydoc-exec at 4K)."""
    from kvcodec.plan.importance import floored, token_multipliers

    w = np.r_[np.zeros(4), np.full(100, 1e-9), np.full(20, 1.0)]
    c0, table = token_multipliers(w, 4, power=0.25, max_log2=3.0)
    c1, _ = token_multipliers(w, 4, power=0.25, max_log2=3.0, floor=0.02)
    assert table[c0[:100]].min() == table.max() and table[c1[:100]].max() < table.max()
    f = floored(w[4:], 0.02)
    assert f.sum() == pytest.approx(1.0) and f.min() == pytest.approx(0.02 / 120)
    with pytest.raises(KvcInputError):
        floored(w, 1.0)


def test_a_rate_model_fitted_for_other_settings_is_refitted(lm, tmp_path, monkeypatch):
    """The rate model records the preset settings it was fitted for; other settings (a changed preset table or
    tokenscale default) make it stale: ensure_rate_model fits anew instead of predicting with wrong constants."""
    from kvcodec.calibration import ratemodel
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.onboard import ratefit
    from kvcodec.plan.presets import lossy_settings

    cal = ensure_calibration(lm)
    monkeypatch.setattr(ratemodel, "rate_model_path", lambda c: tmp_path / "rm.json")
    monkeypatch.setattr(ratefit, "rate_model_path", lambda c: tmp_path / "rm.json")
    monkeypatch.setattr(ratemodel, "shipped_rate_model_path", lambda c: tmp_path / "none.json")
    fits = []

    def fake_fit(lm_, cal_, presets, progress=True, answers=None, layer_factor=None, targets=None, recipe=None):
        fits.append(1)
        return ratemodel.RateModel(str(cal_.meta["fingerprint_id"]), str(cal_.meta["content_sha256"]),
                                   {n: 1.0 for n in presets}, {}, 1024, None, [], 0.0, ratefit.settings_digest(presets),
                                   {}, None, ratefit._digests(presets, answers or {}))

    monkeypatch.setattr(ratefit, "fit_rate_model", fake_fit)
    ratefit.ensure_rate_model(lm, cal, lossy_settings())
    ratefit.ensure_rate_model(lm, cal, lossy_settings())
    assert len(fits) == 1  # fitted once, then loaded
    changed = {**lossy_settings(), "balanced": {**lossy_settings()["balanced"], "tokenscale": {"max_log2": 1.0}}}
    ratefit.ensure_rate_model(lm, cal, changed)
    assert len(fits) == 2


def test_a_preset_added_later_is_fitted_alone_and_merged(lm, tmp_path, monkeypatch):
    """A rate model that covers some presets (a preset was added to the table since) is extended: only the missing
    preset is fitted, with the model's per-layer factors, and the others' constants stay. A legacy file (one digest
    for all its presets) covers them while their settings are unchanged; a changed preset is refitted alone."""
    from kvcodec.calibration import ratemodel
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.onboard import ratefit
    from kvcodec.plan.presets import lossy_settings

    cal = ensure_calibration(lm)
    path = tmp_path / "rm.json"
    monkeypatch.setattr(ratemodel, "rate_model_path", lambda c: path)
    monkeypatch.setattr(ratefit, "rate_model_path", lambda c: path)
    monkeypatch.setattr(ratemodel, "shipped_rate_model_path", lambda c: tmp_path / "none.json")
    old = {n: t for n, t in lossy_settings().items() if n != "faithful"}
    legacy = ratemodel.RateModel(str(cal.meta["fingerprint_id"]), str(cal.meta["content_sha256"]),
                                 {n: 1.5 for n in old}, {}, 1024, None, [], 10.0, ratefit.settings_digest(old),
                                 {}, [[1.0, 1.0]] * cal.sensitivity.shape[0])
    ratemodel.save_rate_model(legacy, path)
    fits: list[tuple[set[str], object]] = []

    def fake_fit(lm_, cal_, presets, progress=True, layer_factor=None, answers=None, targets=None, recipe=None):
        fits.append((set(presets), layer_factor))
        assert recipe is ratefit.THOROUGH  # the legacy model is a thorough one: extended with its own recipe
        return ratemodel.RateModel(legacy.fingerprint_id, legacy.calibration_sha256, {n: 2.0 for n in presets}, {}, 1024,
                                   None, [], 1.0, ratefit.settings_digest(presets), {}, layer_factor,
                                   {}, {n: {"factor": 0.5} for n in presets if n == "faithful"})

    monkeypatch.setattr(ratefit, "fit_rate_model", fake_fit)
    rm = ratefit.ensure_rate_model(lm, cal, lossy_settings())
    assert fits == [({"faithful"}, legacy.layer_factor)]  # only the new preset, with the stored layer factors
    assert rm.alpha == {**{n: 1.5 for n in old}, "faithful": 2.0} and rm.answer_factor("faithful") == 0.5
    assert ratefit.covered(rm, lossy_settings()) == set(lossy_settings())
    assert ratefit.ensure_rate_model(lm, cal, lossy_settings()).alpha == rm.alpha and len(fits) == 1  # saved, loaded
    changed = {**lossy_settings(), "small": {**lossy_settings()["small"], "step0": 0.9}}
    rm2 = ratefit.ensure_rate_model(lm, cal, changed)
    assert fits[-1][0] == {"small"} and rm2.alpha["small"] == 2.0 and rm2.alpha["balanced"] == 1.5


def test_a_first_use_fits_the_quick_recipe_and_says_so(lm, tmp_path, monkeypatch):
    """Onboarding (issue 54): a model without a rate model gets the quick recipe (two texts at 1K and 4K, no per-layer
    factors: never the 2L-continuation measurement); the record says so, and a later preset extends it quick too."""
    from kvcodec.calibration import ratemodel
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.onboard import ratefit
    from kvcodec.plan.presets import lossy_settings

    cal = ensure_calibration(lm)
    path = tmp_path / "rm.json"
    monkeypatch.setattr(ratemodel, "rate_model_path", lambda c: path)
    monkeypatch.setattr(ratefit, "rate_model_path", lambda c: path)
    monkeypatch.setattr(ratemodel, "shipped_rate_model_path", lambda c: tmp_path / "none.json")

    def no_layers(*a, **k):
        raise AssertionError("the quick recipe measured per-layer factors")

    jobs: list[tuple[str, int]] = []

    def measure(lm_, cal_, jobs_, presets, desc, progress, fast=None):
        jobs.extend((n, t) for n, t, _ in jobs_)
        return [{"text": n, "tokens": t, "preset": p, "step0": 0.1, "kl": 0.01, "predicted": 0.01, "rival_gain": 0.01,
                 "dnll": 0.01} for n, t, _ in jobs_ for p in presets]

    monkeypatch.setattr(ratefit, "measure_layer_factor", no_layers)
    monkeypatch.setattr(ratefit, "_measure", measure)
    monkeypatch.setattr(ratefit, "_answer_probe", lambda *a, **k: {"factor": 1.0})
    monkeypatch.setattr(ratefit, "_chat_factors", lambda *a, **k: {})
    old = {n: t for n, t in lossy_settings().items() if n != "small"}
    rm = ratefit.ensure_rate_model(lm, cal, old, progress=False)
    assert rm.recipe == "quick" and rm.layer_factor is None and rm.allocated(cal) is cal
    assert {n for n, _ in jobs} == set(ratefit.QUICK.texts) and {t for _, t in jobs} == set(ratefit.QUICK.lengths)
    assert ratemodel.RateModel.from_json(json.loads(path.read_text()), "f").recipe == "quick"
    jobs.clear()
    rm2 = ratefit.ensure_rate_model(lm, cal, lossy_settings(), progress=False)  # a preset added: fitted alone, quick
    assert rm2.recipe == "quick" and set(rm2.alpha) == set(lossy_settings()) and {n for n, _ in jobs} == set(ratefit.QUICK.texts)
    d = rm2.to_json()
    assert ratemodel.RateModel.from_json({k: v for k, v in d.items() if k != "recipe"}, "f").recipe == "thorough"  # before
    with pytest.raises(KvcFormatError, match="recipe"):
        ratemodel.RateModel.from_json({**d, "recipe": "lazy"}, "f")


def test_rate_control_applies_the_answer_probes_factor(lm, real_cache, monkeypatch):
    """A model whose answer probe lost answers at the KL-chosen step gets that step times the probe's factor, and
    the record says why (bound "answers"); get_plan warns once in one line."""
    import logging

    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.api import resolve_rate_model
    from kvcodec.plan import presets as presets_mod
    from kvcodec.plan.presets import PRESETS
    from kvcodec.plan.ratecontrol import controlled_plan

    cache = real_cache(192)
    cal = ensure_calibration(lm)
    rm = resolve_rate_model(lm, cal, progress=False)
    info = PRESETS["faithful"]
    args = {**dict(info.settings), "cal": cal}
    free = controlled_plan(cache, lm, "faithful", args, info.target, replace(rm, answer_step={}))
    half = controlled_plan(cache, lm, "faithful", args, info.target, replace(rm, answer_step={"faithful": {"factor": 0.5}}))
    assert half.params["rate"]["step0"] == pytest.approx(0.5 * free.params["rate"]["step0"])
    assert half.params["rate"]["bound"] == "answers" and free.params["rate"]["answer_factor"] == 1.0
    warned = replace(rm, answer_step={"faithful": {"factor": 0.5}}, fingerprint_id="test-warn")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("kvcodec.plan").addHandler(handler)
    try:
        presets_mod.get_plan("faithful", cache, lm=lm, cal=cal, rm=warned)
        presets_mod.get_plan("faithful", cache, lm=lm, cal=cal, rm=warned)
    finally:
        logging.getLogger("kvcodec.plan").removeHandler(handler)
    msgs = [r.getMessage() for r in records if "answer probe" in r.getMessage()]
    assert len(msgs) == 1 and "\n" not in msgs[0] and "x0.5" in msgs[0]


def _rows(pairs):
    return [{"preset": "balanced", "text": "t", "tokens": 1024, "kl": kl, "dnll": d} for kl, d in pairs]


def test_dppl_ratio_pools_the_rows_that_carry_signal():
    """The KL-to-ΔPPL ratio is pooled (sum of NLL changes over sum of KLs) over rows whose KL is above the floor:
    a row below it is the continuation's sampling noise. Too few rows, or rows from before (no ``dnll``): None. A
    tampered row cannot push the ratio outside its range."""
    from kvcodec.calibration.ratemodel import DPPL_KL_FLOOR, DPPL_RATIO_RANGE, RateModel

    def rm(fit):
        return RateModel("f", "s", {"balanced": 1.0}, {}, 1024, fit=fit)

    good = _rows([(0.01, 0.02), (0.02, 0.03), (0.01, 0.01), (0.04, 0.10)])
    assert rm(good).dppl_ratio() == pytest.approx(0.16 / 0.08)
    noisy = good + _rows([(DPPL_KL_FLOOR / 10, 5.0)])  # below the floor: ignored, however large its NLL change
    assert rm(noisy).dppl_ratio() == pytest.approx(2.0)
    assert rm(good[:3]).dppl_ratio() is None
    assert rm([{k: v for k, v in r.items() if k != "dnll"} for r in good]).dppl_ratio() is None
    assert rm(good + _rows([(0.01, 1e6)])).dppl_ratio() == DPPL_RATIO_RANGE[1]
    assert rm(good + _rows([(0.01, float("nan")), (0.01, "2")])).dppl_ratio() == pytest.approx(2.0)


def test_rate_control_aims_at_the_tighter_of_kl_and_dppl(lm, real_cache):
    """On a model whose ΔPPL runs 3x its KL, balanced's ΔPPL promise (1 % in expectation) binds before its KL
    promise: the aim is DPPL_AIM x log(1.01) / 3 and the step is smaller; at a ratio of 0.5 the KL promise binds
    as before, and the record names the bound and the ratio."""
    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import load_rate_model
    from kvcodec.plan.presets import PRESETS
    from kvcodec.plan.ratecontrol import AIM, DPPL_AIM, controlled_plan

    cache = real_cache(192)
    cal = ensure_calibration(lm)
    rm = load_rate_model(cal)
    assert rm is not None
    info = PRESETS["balanced"]
    args = {**dict(info.settings), "cal": cal}
    low = controlled_plan(cache, lm, "balanced", args, info.target, replace(rm, fit=_rows([(0.01, 0.005)] * 4)))
    high = controlled_plan(cache, lm, "balanced", args, info.target, replace(rm, fit=_rows([(0.01, 0.03)] * 4)))
    assert low.params["rate"]["bound"] == "kl" and low.params["rate"]["aim_kl"] == pytest.approx(AIM * info.target.kl)
    assert low.params["rate"]["dppl_ratio"] == pytest.approx(0.5)
    assert high.params["rate"]["bound"] == "dppl" and high.params["rate"]["dppl_ratio"] == pytest.approx(3.0)
    assert high.params["rate"]["aim_kl"] == pytest.approx(DPPL_AIM * math.log1p(info.target.dppl_percent / 100) / 3.0)
    assert high.params["rate"]["step0"] < low.params["rate"]["step0"]
    assert high.params["rate"]["predicted_kl"] <= high.params["rate"]["aim_kl"] * 1.01


def test_a_rate_model_from_before_gains_its_nll_changes(lm, monkeypatch):
    """with_dnll (kvc calibrate on a rate model from before the ratio) re-measures the rows of the presets whose KL
    carries signal (not near-lossless's), on the fit's own jobs, and keeps the fitted constants and the other rows."""
    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import load_rate_model
    from kvcodec.onboard import ratefit
    from kvcodec.plan.presets import lossy_settings

    cal = ensure_calibration(lm)
    shipped = load_rate_model(cal)
    old = replace(shipped, fit=[{k: v for k, v in r.items() if k != "dnll"} for r in shipped.fit])
    assert old.dppl_ratio() is None
    calls: list = []

    def fake_measure(lm_, cal_, jobs, presets, desc, progress):
        calls.append((sorted(presets), len(jobs)))
        return [{"text": n, "tokens": T, "preset": p, "step0": 1.0, "kl": 0.01, "predicted": 0.01, "rival_gain": 0.01,
                 "dnll": 0.015} for n, T, _ in jobs for p in presets]

    monkeypatch.setattr(ratefit, "_measure", fake_measure)
    monkeypatch.setattr(ratefit, "_jobs", lambda lm_, texts, lengths: [(r["text"], r["tokens"], None) for r in old.fit
                                                                         if r["preset"] == "near-lossless"])
    got = ratefit.with_dnll(lm, cal, old, lossy_settings(), progress=False)
    assert len(calls) == 1 and "near-lossless" not in calls[0][0] and "balanced" in calls[0][0]
    assert calls[0][1] == len([r for r in old.fit if r["preset"] == "balanced"])
    assert got.alpha == old.alpha and got.dppl_ratio() == pytest.approx(1.5)
    assert [r for r in got.fit if r["preset"] == "near-lossless"] == [r for r in old.fit if r["preset"] == "near-lossless"]


def test_rate_control_applies_the_chat_factor_to_chat_contexts_only(lm, real_cache):
    """A context that opens with the model's chat prefix (what kvc ask and KnowledgeBase store) is predicted with the
    preset's chat factor, so it gets a smaller step; plain text of the same length is planned as before."""
    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import load_rate_model
    from kvcodec.models.capture import capture
    from kvcodec.models.chat import ChatFormat, is_chat_context
    from kvcodec.plan.presets import PRESETS
    from kvcodec.plan.ratecontrol import controlled_plan

    plain = real_cache(192)
    prefix = ChatFormat.for_tokenizer(lm.tokenizer).prefix
    chat = capture(lm, token_ids=np.concatenate([prefix, plain.token_ids[:192 - len(prefix)]]))
    assert is_chat_context(lm, chat.token_ids) and not is_chat_context(lm, plain.token_ids)
    assert not is_chat_context(lm, prefix)  # the prefix alone holds no document
    cal = ensure_calibration(lm)
    rm = replace(load_rate_model(cal), chat_factor={"balanced": {"factor": 4.0}}, fit=[])
    info = PRESETS["balanced"]
    args = {**dict(info.settings), "cal": cal}

    def step(cache, model):
        return controlled_plan(cache, lm, "balanced", args, info.target, model).params["rate"]

    assert step(plain, rm)["step0"] == step(plain, replace(rm, chat_factor={}))["step0"]
    assert step(plain, rm)["chat_factor"] == 1.0
    with_f, without = step(chat, rm), step(chat, replace(rm, chat_factor={}))
    assert with_f["chat_factor"] == 4.0 and with_f["step0"] < without["step0"]
    assert with_f["predicted_kl"] <= with_f["aim_kl"] * 1.01  # the prediction it aims with includes the factor
