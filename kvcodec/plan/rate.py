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

``KL_pred = alpha * sum_{l,k} sens[l,k] * N[l,k]`` where ``N`` is that weighted coefficient error
power per element over the coded tokens (sink tokens are stored exactly; dropped coefficients
count their whole value). ``alpha`` absorbs what the law leaves out (the Fisher trace was
measured on another text and length; the second-order approximation): it is fitted per model
and preset once, on tuning texts (:mod:`kvcodec.plan.ratefit`), and stored beside the model's
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
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcInputError
from kvcodec.plan.importance import floored

AIM = 0.6  # predicted KL = AIM x the preset's KL target (the measured spread of alpha is ~ +-1.6x)
RIVAL_AIM = 1.0  # near-lossless: rival gain at the step = this x its bound (the law's slope is already a max over fit texts)
SEARCH_TOKENS = 512  # tokens per (layer, kind) the step search evaluates (a strided subsample)
SEARCH_ITERS = 12  # bisection steps on log(step0): 2**-12 of the bracket ~ 0.1 % in step
STEP_BRACKET = (1e-4, 16.0)


@dataclass
class Coefficients:
    """One cache's full-basis transform coefficients per (layer, kind), and what weights their tokens.

    ``y[l][k]``: float32 [H, T', D] coefficients of the coded tokens (sink excluded; a strided
    subsample when ``stride`` > 1); ``w[l]``: float64 [T'] token weights summing to 1.
    Computed once per encode: every candidate step reuses them.
    """

    y: list[list[np.ndarray]]
    w: list[np.ndarray]
    token_index: list[np.ndarray]  # absolute token index of each column of y[l][*] (for tokenscale classes)


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
            x = torch.from_numpy(np.ascontiguousarray(coded_tensor(cache, l, kind)[:, keep], np.float32))  # [H, T', D]
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


def noise_power(co: Coefficients, steps: np.ndarray, kept: np.ndarray, max_bits: int,
                multipliers: list[np.ndarray] | None = None, deadzone: float = 0.0, kinds: str = "kv") -> np.ndarray:
    """Weighted coefficient-domain error power per element [L, 2] of quantising ``co`` at ``steps`` [L, 2].

    ``kept`` [L, 2]: coefficients coded (the rest are dropped: their error is their value);
    ``multipliers[l]``: tokenscale's step multiplier per token of layer ``l`` (None: 1), indexed
    by absolute token. Mirrors the quantize stage: the step of a (head, coefficient) widens to
    ``amax / (2**(max_bits-1) - 0.51)`` where its range would not fit ``max_bits``.
    """
    L = len(co.y)
    out = np.zeros((L, 2))
    lim = (1 << (max_bits - 1)) - 1
    for l in range(L):
        ml = None if multipliers is None else multipliers[l][co.token_index[l]].astype(np.float32)
        for ki in range(2):
            m = ml if "kv"[ki] in kinds else None
            y = co.y[l][ki]
            H, T, D = y.shape
            if T == 0:
                continue
            k = int(kept[l, ki])
            yk = y[:, :, :k] if m is None else y[:, :, :k] / m[None, :, None]
            amax = np.abs(yk).max(axis=1)  # [H, k]
            st = np.maximum(np.float32(steps[l, ki]), amax / (lim + 0.49)).astype(np.float32)[:, None, :]
            r = yk / st
            q = np.sign(r) * np.floor(np.abs(r) + (0.5 - deadzone)) if deadzone else np.rint(r)
            e = (r - q) * st
            if m is not None:
                e = e * m[None, :, None]
            per_tok = (e.astype(np.float64) ** 2).sum(axis=(0, 2))  # [T]
            if k < D:
                per_tok += (y[:, :, k:].astype(np.float64) ** 2).sum(axis=(0, 2))
            out[l, ki] = float(per_tok @ co.w[l]) / (H * D)
    return out


def raw_predictor(cache: Any, cal: Calibration, settings: dict[str, Any], importance: np.ndarray | None) -> Any:
    """``step0 -> sum sens * noise`` (alpha = 1) of the transform plan with ``settings`` (a lossy preset's, without
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

    def predict(step0: float) -> float:
        steps = layer_steps(cal, step0)
        return predicted_kl(cal, noise_power(co, steps, kept_coefficients(cal, steps, group), max_bits, mults, deadzone, kinds))

    return predict


def predicted_kl(cal: Calibration, noise: np.ndarray, alpha: float = 1.0) -> float:
    """``alpha * sum sens * noise`` (module docstring)."""
    return float(alpha * (cal.sensitivity.astype(np.float64) * noise).sum())


def choose_step0(predict: Any, aim_kl: float, bracket: tuple[float, float] = STEP_BRACKET,
                 iters: int = SEARCH_ITERS) -> float:
    """Largest ``step0`` in ``bracket`` whose ``predict(step0)`` is <= ``aim_kl`` (bisection on log step0).

    ``predict`` is monotone in practice (noise grows with the step); the bisection keeps the
    largest tried step that met the aim, so a non-monotone wiggle can only cost bits, never the aim.
    """
    if not (math.isfinite(aim_kl) and aim_kl > 0):
        raise KvcInputError(f"rate control: the KL aim must be a positive number, got {aim_kl!r}")
    lo, hi = math.log(bracket[0]), math.log(bracket[1])
    if predict(math.exp(lo)) > aim_kl:
        return math.exp(lo)
    if predict(math.exp(hi)) <= aim_kl:
        return math.exp(hi)
    best = lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if predict(math.exp(mid)) <= aim_kl:
            lo = best = mid
        else:
            hi = mid
    return math.exp(best)


def controlled_plan(cache: Any, lm: Any, preset: str, args: dict[str, Any], target: Any, rm: RateModel,
                    check: bool = False, importance: np.ndarray | None = None) -> Any:
    """The plan of lossy ``preset`` for ``cache`` at the ``step0`` whose predicted KL is ``AIM`` x ``target.kl``.

    ``args`` are the preset's settings (with ``cal``); ``rm`` the model's rate model; ``importance`` the context's token
    importance when the caller has it (computed here once when tokenscale needs it, and shared by
    the prediction and the plan). Near-lossless's greedy promise also caps the step by the rate
    model's rival-gain law. ``check`` then confirms on the document's tail
    (:func:`kvcodec.plan.check.guarded_plan`). The choice is recorded in ``params["rate"]``.
    """
    import time

    from kvcodec.plan.importance import cache_importance
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT, transform_plan
    t0 = time.perf_counter()
    args = dict(args)
    args.pop("step0", None)
    cal = args["cal"]
    if importance is None and args.get("tokenscale") is not None:
        importance = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"])
    raw = raw_predictor(cache, cal, {k: v for k, v in args.items() if k != "cal"}, importance)
    factor = rm.factor(preset, int(cache.num_tokens))
    aim = AIM * target.kl
    step0 = choose_step0(lambda s: factor * raw(s), aim)
    bound = "kl"
    if target.rival_gain and rm.rival_per_step:
        s_rg = RIVAL_AIM * target.rival_gain / rm.rival_per_step
        if s_rg < step0:
            step0, bound = s_rg, "rival_gain"
    pred = factor * raw(step0)
    record = {"mode": "check" if check else "predict", "step0": step0, "predicted_kl": pred, "aim_kl": aim,
              "bound": bound, "factor": factor, "rate_model_fit_s": rm.fit_s,
              "choose_s": round(time.perf_counter() - t0, 3)}
    if check:
        from kvcodec.plan.check import guarded_plan

        plan = guarded_plan(cache, lm, preset, {**args, "step0": step0, "importance": importance}, target, predicted_kl=pred)
    else:
        plan = transform_plan(cache, step0, lm=lm, preset=preset, importance=importance, **args)
    plan.params["rate"] = record
    return plan
