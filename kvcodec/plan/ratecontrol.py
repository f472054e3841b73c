"""Rate control: predict a lossy plan's KL from its own quantisation noise, and pick ``step0`` from the prediction.

Why predict instead of measure: the encode-time probe (:mod:`kvcodec.plan.check`) costs
several model forward passes per file and, stated against 256 tokens of ΔPPL, forced KL
10-20x inside the promise (issue 33). The calibration already measured what the model is
sensitive to; the codec knows exactly what noise it adds. Their product is the KL.

**The law.** For a small perturbation ``e`` of the cache, ``KL ~ 1/2 e^T F e``. The calibration
measured ``sens[l, k] = 1/2 tr(F) / n`` of each (layer, K/V) block: the mean KL per unit of
isotropic per-element noise power (:func:`kvcodec.calibration.build.measure_sensitivity`).
The codec's noise is not isotropic in two ways, and the prediction follows both:

* *Across directions.* The transform codes coefficients ``y`` of a basis ``B = M^-1/2 V`` whitened
  by the attention metric ``M`` (trace ``D``): a coefficient error ``c`` is the cache error ``B c``
  and its metric power ``c^T V^T M^-1/2 M M^-1/2 V c = |c|^2``. So the *coefficient-domain* error
  power is the metric-weighted error, which equals the isotropic power for isotropic noise and
  counts noise on insensitive directions as cheap, as it is.
* *Across tokens.* Noise on token ``t`` reaches the attention output through ``a_t``; its effect
  is weighted by ``w_t = E_q[a_t^2]``, the very importance tokenscale uses
  (:mod:`kvcodec.plan.importance`). The error power is averaged with those weights. Without an
  importance (no model, pruned cache) the weights are uniform.

``KL_pred = alpha * sum_{l,k} sens[l,k] * N[l,k]`` where ``sens`` is the calibration's times the rate model's
measured per-layer factor (:meth:`RateModel.allocated`: the plan's steps follow it too), ``N`` that weighted coefficient error
power per element over the coded tokens (sink tokens are stored exactly; dropped coefficients
count their whole value). ``alpha`` absorbs what the law leaves out (the Fisher trace was
measured on another text and length; the second-order approximation): it is fitted per model
and preset once, on tuning texts (:mod:`kvcodec.onboard.ratefit`), and stored beside the model's
calibration.

**Choosing the step.** The preset's promise is a mean KL ``target``; the encoder aims at
``AIM x target`` (measured KL then lands in [0.3, 1] x target even when a text's true ``alpha`` is
1.5x off its fitted value) by bisection on ``log step0`` of the prediction, on a token subsample.
No model forward pass is needed beyond the token importance the plan computes anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcodec.calibration.ratemodel import RateModel
from kvcodec.codecs.quantnoise import Coefficients, NoiseModel
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcInputError
from kvcodec.plan.importance import floored

AIM = 0.6  # predicted KL = AIM x the preset's KL target (the measured spread of alpha is ~ +-1.6x)
# the ΔPPL promise is in expectation (pooled over texts), so its aim is the mean predicted KL it allows, with a
# margin for the prediction's mean error (measured / predicted KL: arithmetic means 1.1-1.3 on the shipped models)
DPPL_AIM = 0.8
RIVAL_AIM = 1.0  # near-lossless: rival gain at the step = this x its bound (the law's slope is already a max over fit texts)
SEARCH_TOKENS = 512  # tokens per (layer, kind) the step search evaluates (a strided subsample)
SEARCH_RTOL = 2e-3  # the search stops within this of the aim (or of the step)
SEARCH_EVALS = 12  # predictions the search may make (4-6 in practice)
STEP_BRACKET = (1e-4, 16.0)


def _projections(cal: Calibration) -> Any:
    """float32 torch [L, 2, H, D, D]: the least-squares projection onto each full basis (the transform stage's
    encode matrix with all D columns), computed once per calibration object."""
    import torch

    memo = cal.__dict__.get("_rate_projections")
    if memo is None or memo[0] is not cal.basis:
        b = torch.from_numpy(cal.basis.astype(np.float64))
        proj = b @ torch.linalg.inv(b.transpose(-1, -2) @ b)
        memo = (cal.basis, proj.float())
        cal.__dict__["_rate_projections"] = memo
    return memo[1]


def coefficients(cache: Any, cal: Calibration, sink: int, importance: np.ndarray | None = None,
                 max_tokens: int | None = SEARCH_TOKENS, floor: float = 0.0) -> Coefficients:
    """The cache's coefficients in the calibration's full basis (all D columns), per (layer, kind).

    Token weights: ``importance`` over the coded tokens, floored like tokenscale's classes
    (:func:`kvcodec.plan.importance.floored`: the same prior that the continuation may read any token).

    torch, not numpy, for the products: numpy's BLAS spins its own threads, which cost 3x the
    work itself on a shared 2-core machine; torch follows the process's thread setting.
    """
    import torch

    from kvcodec.calibration.build import coded_tensor

    proj = _projections(cal)
    mean = torch.tensor(cal.mean, dtype=torch.float32)
    L = cache.num_layers
    ys: list[list[np.ndarray]] = []
    ws: list[np.ndarray] = []
    idx: list[np.ndarray] = []
    for l in range(L):
        T = int((cache.keys[l]).shape[1])
        first = cache.layer_offset(l)  # absolute index of the layer's first stored token (ragged layers)
        keep = np.arange(max(0, sink - first), T)
        if max_tokens is not None and keep.size > max_tokens:
            keep = keep[:: -(-keep.size // max_tokens)]
        row = []
        for ki, kind in enumerate("kv"):
            x = torch.from_numpy(np.ascontiguousarray(coded_tensor(cache, l, kind, keep), np.float32))  # [H, T', D]
            row.append(((x - mean[l, ki][:, None, :]) @ proj[l, ki]).numpy())
        ys.append(row)
        if importance is not None and importance.shape[-1] == cache.num_tokens:
            coded = np.asarray(importance[l], np.float64)[first + max(0, sink - first):]
            wl = floored(coded, floor)[keep - keep[0]] if keep.size else np.zeros(0)
        else:
            wl = np.ones(keep.size)
        s = wl.sum()
        ws.append(wl / s if s > 0 else np.full(keep.size, 1.0 / max(keep.size, 1)))
        idx.append(first + keep)
    return Coefficients(ys, ws, idx)


def noise_predictor(cache: Any, cal: Calibration, settings: dict[str, Any], importance: np.ndarray | None) -> Any:
    """``step0 -> N`` [L, 2] (:func:`kvcodec.codecs.quantnoise.noise_power`) of the transform plan with ``settings`` (a lossy preset's, without
    ``step0``) on ``cache``: the same per-layer steps, kept coefficients and tokenscale classes as
    :func:`kvcodec.plan.pipelines.transform_plan` builds."""
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT, kept_coefficients, layer_steps, token_classes

    sink, group = int(settings.get("sink", 4)), int(settings.get("group", 8))
    max_bits, deadzone = int(settings.get("max_bits", 8)), float(settings.get("deadzone", 0.0))
    ts = settings.get("tokenscale")
    mults, kinds = None, "kv"
    if ts is not None and importance is not None and np.shape(importance) == (cache.num_layers, cache.num_tokens):
        opts = {**TOKENSCALE_DEFAULT, **ts}
        classes, table = token_classes(importance, sink, opts)
        mults, kinds = [table[c] for c in classes], opts["kinds"]
    co = coefficients(cache, cal, sink, importance, floor=float({**TOKENSCALE_DEFAULT, **(ts or {})}["floor"]))
    nm = NoiseModel.prepare(co, mults, kinds)

    def noise(step0: float) -> np.ndarray:
        steps = layer_steps(cal, step0)
        return nm.power(steps, kept_coefficients(cal, steps, group), max_bits, deadzone)

    return noise


def raw_predictor(cache: Any, cal: Calibration, settings: dict[str, Any], importance: np.ndarray | None) -> Any:
    """``step0 -> sum sens * noise`` (alpha = 1) of :func:`noise_predictor`'s plan."""
    noise = noise_predictor(cache, cal, settings, importance)
    return lambda step0: predicted_kl(cal, noise(step0))


def predicted_kl(cal: Calibration, noise: np.ndarray, alpha: float = 1.0) -> float:
    """``alpha * sum sens * noise`` (module docstring)."""
    return float(alpha * (cal.sensitivity.astype(np.float64) * noise).sum())


def choose_step0(predict: Any, aim_kl: float, bracket: tuple[float, float] = STEP_BRACKET,
                 start: float | None = None, rtol: float = SEARCH_RTOL, max_evals: int = SEARCH_EVALS) -> float:
    """Largest ``step0`` in ``bracket`` whose ``predict(step0)`` is <= ``aim_kl``, to ``rtol`` of the aim.

    Why not bisection: every prediction is a pass over the coefficients, and bisecting a 1e5 bracket to
    0.1 % took 14 of them. The prediction is close to a power law in the step (KL ~ step^2 where the
    quantizer's noise dominates), so this walks in (log step, log KL): Newton steps with slope 2 from
    ``start`` until the aim is bracketed, then false position (Illinois) inside the bracket: 4-6
    predictions. It keeps the largest tried step that met the aim, so a non-monotone wiggle (coefficients
    dropped or ranges widened at some step) can only cost bits, never the aim.
    """
    if not (math.isfinite(aim_kl) and aim_kl > 0):
        raise KvcInputError(f"rate control: the KL aim must be a positive number, got {aim_kl!r}")
    lo, hi = math.log(bracket[0]), math.log(bracket[1])
    log_aim = math.log(aim_kl)

    def f(x: float) -> float:  # <= 0 exactly when the prediction meets the aim (compared unlogged: no rounding)
        p = predict(math.exp(x))
        g = math.log(max(p, 1e-300)) - log_aim
        return min(g, 0.0) if p <= aim_kl else max(g, 1e-300)

    x = 0.5 * (lo + hi) if start is None else min(hi, max(lo, math.log(start)))
    fx = f(x)
    a, fa, b, fb = (x, fx, None, None) if fx <= 0 else (None, None, x, fx)
    evals = 1
    while (a is None or b is None) and evals < max_evals:  # Newton with slope 2, a little past the aim
        if a is None and x <= lo or b is None and x >= hi:
            break
        x = min(hi, max(lo, x - fx / 2.0 + (0.01 if fx <= 0 else -0.01)))
        fx = f(x)
        evals += 1
        if fx <= 0:
            a, fa = x, fx
        else:
            b, fb = x, fx
    if a is None:
        return math.exp(lo)  # not even the finest step meets it (or the walk never got there): the finest
    if b is None:
        return math.exp(a)  # the coarsest step tried meets it (the bracket's end, or the walk ran out)
    assert fa is not None and fb is not None
    ga, gb, side = fa, fb, 0  # the false position's values: Illinois halves the stale end's
    while evals < max_evals and b - a > math.log1p(rtol) and fa < math.log1p(-rtol):
        x = b - gb * (b - a) / (gb - ga)
        x = min(b - 0.01 * (b - a), max(a + 0.01 * (b - a), x))
        fx = f(x)
        evals += 1
        if fx <= 0:
            a, fa, ga = x, fx, fx
            gb = gb * 0.5 if side == 1 else gb
            side = 1
        else:
            b, fb, gb = x, fx, fx
            ga = ga * 0.5 if side == -1 else ga
            side = -1
    return math.exp(a)


@dataclass(frozen=True)
class RateInputs:
    """What rate control plans a context with besides the cache, its calibration and its token importance, resolved
    before planning (:func:`kvcodec.api.make_plan`; :func:`controlled_plan` with the model at hand): the model's rate
    model, the factor on this context's raw prediction (the rate model's length factor, times the chat factor on a
    context a question will follow) and that chat factor (1.0: none applied), and the model's name for warnings."""

    rm: RateModel
    factor: float
    chat: float = 1.0
    model: str | None = None


def context_inputs(lm: Any, cache: Any, preset: str, rm: RateModel, tokenscale: Any = None,
                   importance: np.ndarray | None = None) -> tuple[RateInputs, np.ndarray | None]:
    """Rate control's inputs for ``cache`` measured with the model ``lm`` at hand: the context's factor (the chat
    factor where ``lm``'s chat prefix opens it, issue 57) and, where the preset weighs tokens (``tokenscale``) and
    none is given, its token importance (one forward pass). For callers that hold the model and plan with rate
    control directly (:func:`controlled_plan`: the rate model's fits); :func:`kvcodec.api.make_plan` resolves the same."""
    from kvcodec.models.chat import is_chat_context
    from kvcodec.models.importance import cache_importance
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

    factor = rm.factor(preset, int(cache.num_tokens))
    chat = 1.0
    if rm.chat_factor.get(preset) is not None and is_chat_context(lm, cache.token_ids):
        chat = rm.chat(preset)  # a question will read this context more than prose does (issue 57)
        factor *= chat
    if importance is None and tokenscale is not None:
        importance = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **tokenscale}["window"])
    return RateInputs(rm, factor, chat, getattr(lm, "name", None)), importance


def controlled_step(cache: Any, preset: str, args: dict[str, Any], target: Any, rate: RateInputs,
                    importance: np.ndarray | None = None, check: bool = False) -> tuple[float, dict[str, Any], dict[str, Any]]:
    """The ``step0`` whose predicted KL is ``AIM`` x ``target.kl`` (or the tighter ΔPPL aim, the rival-gain cap, the
    answer probe's factor), with no model: ``(step0, record, args)``, where ``args`` are ``args`` (the preset's settings
    with ``cal``) with the calibration the rate model allocated (what the plan's steps follow) and without ``step0``,
    and ``record`` is rate control's choice (``params["rate"]``; ``check``: its mode is ``"check"``)."""
    import time

    t0 = time.perf_counter()
    rm = rate.rm
    args = dict(args)
    start = args.pop("step0", None)  # the table step: where the search starts
    cal = args["cal"] = rm.allocated(args["cal"])  # the measured per-layer sensitivity: predictions and steps
    factor = rate.factor
    raw = raw_predictor(cache, cal, {k: v for k, v in args.items() if k != "cal"}, importance)
    aim, bound = AIM * target.kl, "kl"
    ratio = rm.dppl_ratio()  # this model's ΔPPL per unit KL on real text (None: its fit did not measure it)
    if ratio is not None and getattr(target, "dppl_percent", None):
        aim_d = DPPL_AIM * math.log1p(target.dppl_percent / 100.0) / ratio
        if aim_d < aim:  # the tighter of the two promises (issue 57: ΔPPL ran 2x the KL on an unseen model)
            aim, bound = aim_d, "dppl"
    memo: dict[float, float] = {}

    def predict(s: float) -> float:
        if s not in memo:
            memo[s] = factor * raw(s)
        return memo[s]

    step0 = choose_step0(predict, aim, start=start)
    if target.rival_gain and rm.rival_per_step:
        s_rg = RIVAL_AIM * target.rival_gain / rm.rival_per_step
        if s_rg < step0:
            step0, bound = s_rg, "rival_gain"
    answer_factor = rm.answer_factor(preset)  # < 1: this model lost probe answers at the KL-chosen step (answercheck)
    if answer_factor < 1.0:
        step0, bound = step0 * answer_factor, "answers"
    pred = predict(step0)
    record: dict[str, Any] = {"mode": "check" if check else "predict", "step0": step0, "predicted_kl": pred, "aim_kl": aim,
              "bound": bound, "factor": factor, "answer_factor": answer_factor, "dppl_ratio": ratio, "chat_factor": rate.chat,
              "rate_model_fit_s": rm.fit_s, "choose_s": round(time.perf_counter() - t0, 3)}
    return step0, record, args


def rate_controlled_plan(cache: Any, preset: str, args: dict[str, Any], target: Any, rate: RateInputs,
                         importance: np.ndarray | None = None, check_model: Any = None) -> Any:
    """The plan of lossy ``preset`` for ``cache`` at the step rate control chooses (:func:`controlled_step`), built
    once. ``check_model``: the model the opt-in check confirms that step with on the document's tail
    (:func:`kvcodec.plan.check.guarded_step`, which may lower it) before the plan is built. The choice is recorded in
    ``params["rate"]``: ``step0`` is the step written; with the check, ``predicted_step0`` is the rate control's own
    and ``check_tries`` how many steps the check probed (its record: ``params["check"]``)."""
    from kvcodec.plan.pipelines import transform_plan

    step0, record, args = controlled_step(cache, preset, args, target, rate, importance, check=check_model is not None)
    predicted, checked = step0, None
    if check_model is not None:
        from kvcodec.plan.check import guarded_step

        step0, checked = guarded_step(cache, check_model, preset, {**args, "step0": step0}, target,
                                      predicted_kl=record["predicted_kl"])
    plan = transform_plan(cache, step0, preset=preset, importance=importance, **args)
    if checked is not None:
        plan.params["check"] = checked
    # the step written, which the check may have lowered; the rate control's own choice stays beside it
    record["step0"] = float(plan.params.get("step0", step0))
    if checked is not None:
        record["predicted_step0"] = predicted
        record["check_tries"] = len(checked.get("tries", []))
    plan.params["rate"] = record
    return plan


def controlled_plan(cache: Any, lm: Any, preset: str, args: dict[str, Any], target: Any, rm: RateModel,
                    check: bool = False, importance: np.ndarray | None = None) -> Any:
    """:func:`rate_controlled_plan` with the model ``lm`` at hand: its inputs measured here (:func:`context_inputs`:
    the chat factor, the token importance when not given), for the rate model's own fits
    (:mod:`kvcodec.onboard`), which plan many contexts of one model; an encode plans through
    :func:`kvcodec.api.make_plan`, which resolves them before planning. ``check`` confirms the step with ``lm``."""
    rate, importance = context_inputs(lm, cache, preset, rm, args.get("tokenscale"), importance)
    return rate_controlled_plan(cache, preset, args, target, rate, importance, check_model=lm if check else None)
