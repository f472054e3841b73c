"""Fitting a model's rate model (:class:`kvcodec.calibration.ratemodel.RateModel`): once per model, on tuning texts.

The predictor of :mod:`kvcodec.plan.rate` gets the shape of KL(step) from first principles;
what it cannot know is how far the calibration's Fisher trace, measured on other text at
another length, is from this model's KL on a continuation. So this measures exactly that, on
texts nothing is evaluated on (:data:`kvcodec.texts.TUNING`, never the held-out set): for each
fit text at 1K, 2K and 4K tokens, each lossy preset at its table step, the real model's KL on a
continuation of the text against the exact cache, divided by the raw prediction. Then

* ``alpha[preset]`` = geometric mean of that ratio at the reference length (per preset: tokenscale's
  classes move noise onto tokens whose importance is estimated, and that estimate's bias grows with
  how hard the preset leans on it);
* the length curve (per preset) = at each longer fit length, the mean log ratio less log alpha
  (non-decreasing), and ``beta`` its last segment's slope (the last window's queries stand for the continuation's less
  well as the context grows; :meth:`RateModel.factor`);
* ``rival_per_step`` (near-lossless, whose greedy promise binds before its KL): the largest
  rival-logit gain per unit ``step0`` (gains scale linearly with the step).

Cost: one capture per (text, length) (the prefill observes the token importance itself) and a few
continuations: minutes on two cores; shipped models ship theirs (``kvcodec/data/calibration``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcodec.calibration.ratemodel import (BETA_RANGE, CURVE_RANGE, RateModel, load_rate_model, presets_sha256,
                                           rate_model_path, save_rate_model)
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcInputError

# from kvcodec.texts.TUNING, never the held-out set: one of each kind the KDN stores (a license, reference
# prose, Python source, a C header), because how far the prediction drifts with the context length depends
# on the kind (two licenses alone under-stated it at 4K tokens by up to 4x on source and reference text)
FIT_TEXTS = ("gpl3", "pydoc", "py-textwrap", "c-linux-bpf")
FIT_TOKENS = (1024, 2048, 4096)
FIT_CONTINUATION = 256
T_REF = 1024


def fit_rate_model(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]],
                   texts: tuple[str, ...] = FIT_TEXTS, lengths: tuple[int, ...] = FIT_TOKENS,
                   progress: bool = True) -> RateModel:
    """Measure the predictor against the real model on ``texts`` x ``lengths`` for each lossy preset of
    ``presets`` (name -> its table settings, ``step0`` included) (module docstring)."""
    import torch
    from tqdm import tqdm

    from kvcodec.format.writer import roundtrip
    from kvcodec.models.capture import capture, max_context, tokenize
    from kvcodec.models.quality import continue_logits
    from kvcodec.plan.check import max_rival_gain
    from kvcodec.plan.importance import cache_importance
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT, transform_plan
    from kvcodec.plan.rate import raw_predictor
    from kvcodec.texts import load_text

    window = max_context(lm)
    jobs: list[tuple[str, int, np.ndarray]] = []
    for name in texts:
        ids = tokenize(lm.tokenizer, load_text(name))
        for T in lengths:
            T = min(T, len(ids) - FIT_CONTINUATION, (window - FIT_CONTINUATION) if isinstance(window, int) else T)
            if T >= 256 and (name, T) not in [(j[0], j[1]) for j in jobs]:
                jobs.append((name, T, ids))
    if not jobs:
        raise KvcInputError("rate model: no fit text is long enough for this model")
    fit: list[dict[str, Any]] = []
    t0 = time.time()
    with tqdm(total=len(jobs) * (1 + len(presets)), desc=f"kvc: fitting the rate model of {lm.name}", file=sys.stderr,
              disable=not progress, leave=False, dynamic_ncols=True) as bar, torch.inference_mode():
        for name, T, ids in jobs:
            window_q = TOKENSCALE_DEFAULT["window"]
            cache = capture(lm, token_ids=ids[:T], score_window=window_q)  # importance observed by the prefill
            cont = np.asarray(ids[T:T + FIT_CONTINUATION], np.int64)
            exact = continue_logits(lm, cache, cont)
            lp_e = torch.log_softmax(exact.double(), -1)
            imp = cache_importance(lm, cache, window=window_q)
            bar.update(1)
            for preset, table in presets.items():
                settings: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in table.items()}
                step0 = float(settings.pop("step0"))
                pred = raw_predictor(cache, cal, settings, imp)(step0)
                dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, lm=lm, preset=preset, importance=imp, **settings))
                got = continue_logits(lm, dec, cont)
                lp_d = torch.log_softmax(got.double(), -1)
                kl = float((lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).mean())
                fit.append({"text": name, "tokens": T, "preset": preset, "step0": step0, "kl": kl, "predicted": pred,
                            "rival_gain": max_rival_gain(exact, got)})
                bar.update(1)
    alpha, curve, beta = _fit_factor(fit, list(presets))
    nl = [r["rival_gain"] / r["step0"] for r in fit if r["preset"] == "near-lossless"]
    return RateModel(str(cal.meta["fingerprint_id"]), str(cal.meta["content_sha256"]), alpha, beta, T_REF,
                     max(nl) if nl else None, fit, round(time.time() - t0, 1), settings_digest(presets), curve)


def _fit_factor(fit: list[dict[str, Any]], presets: list[str]
                ) -> tuple[dict[str, float], dict[str, list[list[float]]], dict[str, float]]:
    """(alpha, length curve, beta past it), each per preset, from the fit's rows (module docstring).

    ``alpha[preset]``: geometric mean over texts of measured / predicted at ``T_REF``. The preset's curve:
    at each longer fit length, the mean over texts of log(measured / predicted) less log alpha, made
    non-decreasing (a longer context is never predicted better than a shorter one: noise in a few-text fit
    must not buy fewer bits at a longer length). Per preset because the growth is tokenscale's (its coarse
    classes hold more tokens as the context grows; near-lossless has none and does not grow). ``beta``: the
    last segment's log-slope, so a context past the fit's lengths keeps growing as the fit last did.
    """
    logs: dict[tuple[str, int], list[float]] = {}
    for r in fit:
        if r["kl"] > 0 and r["predicted"] > 0:
            logs.setdefault((r["preset"], int(r["tokens"])), []).append(math.log(r["kl"] / r["predicted"]))
    alpha: dict[str, float] = {}
    curve: dict[str, list[list[float]]] = {}
    beta: dict[str, float] = {}
    for preset in presets:
        mine = {T: v for (p, T), v in logs.items() if p == preset}
        if not mine:
            raise KvcInputError(f"rate model: no usable measurement for preset {preset}")
        t0 = T_REF if T_REF in mine else min(mine)
        la = float(np.mean(mine[t0]))
        alpha[preset] = math.exp(la)
        pts, g = [], 0.0
        for T in sorted(t for t in mine if t > T_REF):
            g = max(g, float(np.mean(mine[T])) - la)
            pts.append([float(T), min(g, CURVE_RANGE[1])])
        curve[preset] = pts
        line = [(float(T_REF), 0.0)] + [(t, v) for t, v in pts]
        (ta, ga), (tb, gb) = line[-2] if len(line) >= 2 else line[-1], line[-1]
        beta[preset] = float(np.clip((gb - ga) / math.log(tb / ta), *BETA_RANGE)) if tb > ta else 0.0
    return alpha, curve, beta


def settings_digest(presets: Mapping[str, Mapping[str, Any]]) -> str:
    """What a rate model is fitted for: the presets' settings with the tokenscale defaults merged in."""
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

    return presets_sha256({n: {**dict(p), "tokenscale": None if p.get("tokenscale") is None else {**TOKENSCALE_DEFAULT, **p["tokenscale"]}}
                           for n, p in sorted(presets.items())})


def ensure_rate_model(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]], progress: bool = True) -> RateModel:
    """``cal``'s rate model for ``presets``: the user's or the shipped one, else fitted once (with progress) and saved
    (also when the one on disk was fitted for other settings)."""
    rm = load_rate_model(cal, settings_digest(presets))
    if rm is None:
        rm = fit_rate_model(lm, cal, presets, progress=progress)
        save_rate_model(rm, rate_model_path(cal))
    return rm
