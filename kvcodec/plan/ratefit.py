"""Fitting a model's rate model (:class:`kvcodec.calibration.ratemodel.RateModel`): once per model, on tuning texts.

The predictor of :mod:`kvcodec.plan.rate` gets the shape of KL(step) from first principles;
what it cannot know is how far the calibration's Fisher trace, measured on other text at
another length, is from this model's KL on a continuation. So this measures exactly that, on
texts nothing is evaluated on (:data:`kvcodec.texts.TUNING`, never the held-out set): for each
fit text at two lengths, each lossy preset at its table step, the real model's KL on a
continuation of the text against the exact cache, divided by the raw prediction. Then

* ``alpha[preset]`` = geometric mean of that ratio at the reference length (per preset: tokenscale's
  classes move noise onto tokens whose importance is estimated, and that estimate's bias grows with
  how hard the preset leans on it);
* ``beta`` = the mean log-slope of the ratio in the context length (the last window's queries
  stand for the continuation's less well as the context grows);
* ``rival_per_step`` (near-lossless, whose greedy promise binds before its KL): the largest
  rival-logit gain per unit ``step0`` (gains scale linearly with the step).

Cost: one capture per (text, length) and a few continuations, about a minute for SmolLM2 on two
cores; shipped models ship theirs (``kvcodec/data/calibration``).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvcodec.calibration.ratemodel import RateModel, load_rate_model, presets_sha256, rate_model_path, save_rate_model
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcInputError

FIT_TEXTS = ("gpl3", "lgpl21")  # from kvcodec.texts.TUNING: never the held-out set
FIT_TOKENS = (1024, 2048)
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
            cache = capture(lm, token_ids=ids[:T])
            cont = np.asarray(ids[T:T + FIT_CONTINUATION], np.int64)
            exact = continue_logits(lm, cache, cont)
            lp_e = torch.log_softmax(exact.double(), -1)
            imp = cache_importance(lm, cache, window=TOKENSCALE_DEFAULT["window"])
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
    alpha: dict[str, float] = {}
    slopes = []
    for preset in presets:
        rows = [r for r in fit if r["preset"] == preset and r["kl"] > 0 and r["predicted"] > 0]
        if not rows:
            raise KvcInputError(f"rate model: no usable measurement for preset {preset}")
        by_text: dict[str, dict[int, float]] = {}
        for r in rows:
            by_text.setdefault(r["text"], {})[r["tokens"]] = math.log(r["kl"] / r["predicted"])
        for lr in by_text.values():
            if len(lr) >= 2:
                (t_a, a), (t_b, b) = sorted(lr.items())[0], sorted(lr.items())[-1]
                slopes.append((b - a) / math.log(t_b / t_a))
    beta = float(np.clip(np.mean(slopes), 0.0, 1.0)) if slopes else 0.0
    for preset in presets:
        rows = [r for r in fit if r["preset"] == preset and r["kl"] > 0 and r["predicted"] > 0]
        logs = [math.log(r["kl"] / r["predicted"]) - beta * math.log(r["tokens"] / T_REF) for r in rows]
        alpha[preset] = float(math.exp(np.mean(logs)))
    nl = [r["rival_gain"] / r["step0"] for r in fit if r["preset"] == "near-lossless"]
    return RateModel(str(cal.meta["fingerprint_id"]), str(cal.meta["content_sha256"]), alpha, beta, T_REF,
                     max(nl) if nl else None, fit, round(time.time() - t0, 1), settings_digest(presets))


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
