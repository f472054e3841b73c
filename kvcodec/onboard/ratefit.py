"""Fitting a model's rate model (:class:`kvcodec.calibration.ratemodel.RateModel`): once per model, on tuning texts.

The predictor of :mod:`kvcodec.plan.ratecontrol` gets the shape of KL(step) from first principles;
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

Before all of that, the per-(layer, kind) ``layer_factor`` (:meth:`RateModel.allocated`): on each fit text at
:data:`ALLOC_TOKENS`, :data:`ALLOC_PRESET` at its table step, every K or V tensor decoded alone into an
otherwise exact cache, its KL over its predicted KL (``sens[l,k] * N[l,k]``); the geometric mean over texts,
clipped to [1/16, 16], shrunk halfway to 1 in log (:data:`ALLOC_SHRINK`). The alphas are then fitted with the
sensitivities it corrects, since the steps follow them.

Two recipes (:class:`FitRecipe`), because a new model must be usable minutes after its first use (issue 54):

* :data:`QUICK`, what a first use and a plain ``kvc calibrate`` fit: two tuning texts at 1K and 4K tokens, no
  per-layer factors (the calibration's own Fisher sensitivities allocate the bits). The per-layer measurement is 2L
  continuations per text: measured on Gemma 3 270M, 462 of a thorough fit's 885 CPU-s (the quick fit: 229 s). Its alphas are fitted on
  the allocation it plans with, so it keeps the same promises; what it gives up is bits (BENCHMARKS.md, "Onboarding").
* :data:`THOROUGH` (``kvc calibrate --thorough``; what the shipped models ship): four texts at 1K, 2K and 4K
  and the per-layer factors.

The record says which one fitted it (``RateModel.recipe``); a thorough fit replaces a quick one, never the reverse.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from kvcodec.calibration.ratemodel import (BETA_RANGE, CURVE_RANGE, RateModel, allocate, load_rate_model, presets_sha256,
                                           rate_model_path, save_rate_model)
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcInputError

# from kvcodec.texts.TUNING, never the held-out set: one of each kind the KDN stores (a license, reference
# prose, Python source, a C header), because how far the prediction drifts with the context length depends
# on the kind (two licenses alone under-stated it at 4K tokens by up to 4x on source and reference text)
FIT_TEXTS = ("gpl3", "pydoc", "py-textwrap", "c-linux-bpf")
FIT_TOKENS = (1024, 2048, 4096)
FIT_CONTINUATION = 256
MIN_FIT_TOKENS = 256  # a fit context shorter than this says little about the presets' operating contexts
T_REF = 1024
ALLOC_PRESET = "balanced"  # the operating point the per-layer sensitivities are measured at (its table step)
ALLOC_TOKENS = 2048
ALLOC_CLIP = 16.0  # a layer factor outside [1/16, 16] is clipped: a tensor whose KL is lost in rounding says little
# the measured log factor is shrunk toward the calibration's estimate: one text's factors, applied to another tuning
# text (pydoc, 2K, balanced at step0 0.5 and 0.7), cut KL at equal bits by 16-25 % at half strength on SmolLM2,
# where full strength moved it by -21 % and +7 %; on Gemma 3 full strength was 7-22 % better and half 8-12 %
# (BENCHMARKS.md, "Per-layer sensitivity measured at the operating point")
ALLOC_SHRINK = 0.5


@dataclass(frozen=True)
class FitRecipe:
    """What one rate-model fit measures: ``texts`` (tuning texts) at ``lengths`` tokens, and whether it measures the
    per-layer factors (module docstring)."""

    name: str
    texts: tuple[str, ...]
    lengths: tuple[int, ...]
    layer_factor: bool


THOROUGH = FitRecipe("thorough", FIT_TEXTS, FIT_TOKENS, True)
# a license and Python source: on both shipped models' thorough fits these two ran at or above the other two tuning
# texts' measured/predicted ratio at 1K and 4K in most rows, so alphas fitted on them lean conservative; 4K because
# the length curve of the importance-weighted presets is not predictable from 1K and 2K (SmolLM2 balanced: +0.02 in
# log at 2K, +0.35 at 4K)
QUICK = FitRecipe("quick", ("gpl3", "py-textwrap"), (1024, 4096), False)
RECIPES = {r.name: r for r in (QUICK, THOROUGH)}


def fit_rate_model(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]],
                   texts: tuple[str, ...] | None = None, lengths: tuple[int, ...] | None = None,
                   progress: bool = True, layer_factor: list[list[float]] | None = None,
                   answers: Mapping[str, Any] | None = None, targets: Mapping[str, Any] | None = None,
                   recipe: FitRecipe = THOROUGH) -> RateModel:
    """Measure the predictor against the real model on ``texts`` x ``lengths`` (None: the ``recipe``'s) for each lossy
    preset of ``presets`` (name -> its table settings, ``step0`` included) (module docstring). ``layer_factor``:
    per-layer factors already measured for this calibration (a rate model being extended by a preset): used as they
    are; otherwise the ``recipe`` says whether they are measured.
    ``answers`` (name -> its :class:`~kvcodec.plan.targets.QualityTarget`: the presets that promise answers,
    :func:`kvcodec.plan.presets.answer_targets`): each of those in ``presets`` then gets the answer probe
    (:mod:`kvcodec.onboard.answercheck`) at the step its fitted constants choose. ``targets`` (name -> its target, every
    lossy preset: :func:`kvcodec.plan.presets.preset_targets`): the presets of ``presets`` among them then get their
    chat factor (:mod:`kvcodec.onboard.chatfactor`), last, at the steps the rest of the fit chooses."""
    from kvcodec.models.compute import compute_dtype_name, onboard_model

    # the prefills in bfloat16 where this CPU computes it natively; every continuation a KL or an answer is read
    # from runs in the model's own dtype, whose noise floor is 1e-7 where bfloat16's is 1e-3 (kvcodec.models.compute)
    fast = onboard_model(lm)
    answers = _answers(answers)
    cal0 = cal  # the calibration as stored (rate control allocates it with the layer factors itself)
    jobs = _jobs(lm, recipe.texts if texts is None else texts, recipe.lengths if lengths is None else lengths)
    if not jobs:
        raise KvcInputError(f"rate model: no fit text is long enough for this model (its window); lossy presets need the "
                            f"model's rate model, fitted on first use or by kvc calibrate --model {lm.name}")
    t0 = time.time()
    if layer_factor is not None:
        cal = allocate(cal, layer_factor)
    elif recipe.layer_factor and ALLOC_PRESET in presets:
        alloc = [(name, T, ids) for name, T, ids in jobs if T == max(t for n, t, _ in jobs if n == name and t <= ALLOC_TOKENS)]
        layer_factor = measure_layer_factor(lm, cal, presets[ALLOC_PRESET], alloc, progress, fast)
        cal = allocate(cal, layer_factor)
    fit = _measure(lm, cal, jobs, presets, f"kvc: fitting the rate model of {lm.name}", progress, fast)
    alpha, curve, beta = _fit_factor(fit, list(presets))
    nl = [r["rival_gain"] / r["step0"] for r in fit if r["preset"] == "near-lossless"]
    rm = RateModel(str(cal.meta["fingerprint_id"]), str(cal.meta["content_sha256"]), alpha, beta, T_REF,
                   max(nl) if nl else None, fit, 0.0, settings_digest(presets), curve, layer_factor,
                   _digests(presets, answers), recipe=recipe.name, prefill_dtype=compute_dtype_name(fast))
    probe = _probe(lm, fast) if any(n in answers or (targets and n in targets) for n in presets) else None
    for name in [n for n in presets if n in answers]:
        rm.answer_step[name] = _answer_probe(lm, cal0, name, presets[name], answers[name], rm, progress, probe)
    rm.chat_factor = _chat_factors(lm, cal0, presets, targets, rm, progress, probe)
    rm.fit_s = round(time.time() - t0, 1)
    return rm


def _probe(lm: Any, fast: Any = None) -> Any:
    """The answer probe's contexts, whose prefills (by ``fast``, the onboarding twin, when given) the answer probe
    and the chat factors share (:class:`kvcodec.onboard.answercheck.Probe`)."""
    from kvcodec.onboard.answercheck import Probe

    return Probe(lm, fast)


def _chat_factors(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]], targets: Mapping[str, Any] | None,
                  rm: RateModel, progress: bool, probe: Any = None) -> dict[str, dict[str, Any]]:
    from kvcodec.onboard.chatfactor import measure_chat_factor

    want = {n: (presets[n], targets[n]) for n in presets if targets and n in targets}
    return measure_chat_factor(lm, cal, want, rm, progress, probe) if want else {}


def with_chat_factor(lm: Any, cal: Calibration, rm: RateModel, presets: Mapping[str, Mapping[str, Any]],
                     targets: Mapping[str, Any], progress: bool = True) -> RateModel:
    """For ``kvc calibrate`` of a model whose rate model predates the chat factor (an encode never runs it: such a
    model plans chat contexts as plain text, as before): ``rm`` with the chat factors of ``presets`` measured."""
    from kvcodec.models.compute import compute_dtype_name, onboard_model

    t0 = time.time()
    fast = onboard_model(lm)
    got = _chat_factors(lm, cal, {n: t for n, t in presets.items() if n in rm.alpha}, targets, rm, progress,
                        _probe(lm, fast))
    return replace(rm, chat_factor={**rm.chat_factor, **got}, fit_s=round((rm.fit_s or 0.0) + time.time() - t0, 1),
                   prefill_dtype=rm.prefill_dtype or compute_dtype_name(fast))


def _answer_probe(lm: Any, cal: Calibration, name: str, table: Mapping[str, Any], target: Any, rm: RateModel,
                  progress: bool, probe: Any = None) -> dict[str, Any]:
    """The answer probe of preset ``name`` at the steps ``rm`` chooses (:mod:`kvcodec.onboard.answercheck`); ``probe``:
    the fit's shared :class:`~kvcodec.onboard.answercheck.Probe` (None: one of its own)."""
    from tqdm import tqdm

    from kvcodec.onboard.answercheck import STEP_FACTORS, Probe, answer_step_factor
    from kvcodec.plan.ratecontrol import controlled_plan

    probe = Probe(lm) if probe is None else probe
    contexts = probe.contexts
    if not contexts:
        return {"factor": 1.0, "tried": [], "texts": [], "note": "no probe text fits the model's window"}
    args = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in table.items()}

    def plan_at(cache: Any, factor: float) -> Any:
        return controlled_plan(cache, lm, name, {**args, "cal": cal}, target,
                               replace(rm, answer_step={name: {"factor": factor}}),
                               importance=probe.importance(cache, args.get("tokenscale")))

    with tqdm(total=len(contexts) * len(STEP_FACTORS), desc=f"kvc: checking {name}'s answers on {lm.name}",
              file=sys.stderr, disable=not progress, leave=False, dynamic_ncols=True) as bar:
        return answer_step_factor(lm, contexts, plan_at, progress=lambda: bar.update(1), caches=probe.caches)


def measure_layer_factor(lm: Any, cal: Calibration, table: Mapping[str, Any], jobs: list[tuple[str, int, np.ndarray]],
                         progress: bool = True, fast: Any = None) -> list[list[float]]:
    """Per (layer, kind): measured / predicted KL of that tensor alone, geometric mean over ``jobs`` (text, tokens,
    ids) at the preset ``table``'s step (module docstring). [L][2], clipped to [1/ALLOC_CLIP, ALLOC_CLIP].
    ``fast``: the model the prefills run on (:func:`_fit_job`).

    Why one tensor at a time: the KL of small independent perturbations adds up (measured on Gemma 3, gpl3: the
    36 tensors' KLs sum to 0.0100 against 0.0107 with all of them decoded), so each tensor's share is its own
    and its ratio to its prediction is that layer's real sensitivity relative to the calibration's estimate.
    Cost: 2 x layers continuations per job.
    """
    import copy

    import torch
    from tqdm import tqdm

    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.models.quality import ExactSide, continue_logits
    from kvcodec.plan.pipelines import transform_plan
    from kvcodec.plan.ratecontrol import noise_predictor

    settings, step0 = _table(table)
    sens = cal.sensitivity.astype(np.float64)
    logs = np.zeros(sens.shape)
    L = sens.shape[0]
    with tqdm(total=len(jobs) * (1 + 2 * L), desc=f"kvc: measuring {lm.name}'s per-layer sensitivity", file=sys.stderr,
              disable=not progress, leave=False, dynamic_ncols=True) as bar, torch.inference_mode():
        for _name, T, ids in jobs:
            cache, cont, exact, imp = _fit_job(lm, ids, T, fast)
            side = ExactSide(exact)
            predicted = sens * noise_predictor(cache, cal, settings, imp)(step0)
            dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, lm=lm, preset=ALLOC_PRESET, importance=imp, **settings))
            bar.update(1)
            for l in range(L):
                for ki, kind in enumerate("kv"):
                    one = copy.copy(cache)  # every tensor exact but this one
                    one.keys, one.values = list(cache.keys), list(cache.values)
                    (one.keys if kind == "k" else one.values)[l] = (dec.keys if kind == "k" else dec.values)[l]
                    kl = side.compare(continue_logits(lm, one, cont))["kl"]
                    logs[l, ki] += math.log(np.clip(max(kl, 1e-30) / max(predicted[l, ki], 1e-30), 1 / ALLOC_CLIP, ALLOC_CLIP))
                    bar.update(1)
    f = np.exp(ALLOC_SHRINK * logs / len(jobs))
    return [[float(f[l, 0]), float(f[l, 1])] for l in range(L)]


def min_fit_window() -> int:
    """The shortest context window that holds a fit job (:data:`MIN_FIT_TOKENS` of context and its continuation):
    below it the rate model cannot be fitted, and no lossy preset can be planned for the model."""
    return MIN_FIT_TOKENS + FIT_CONTINUATION


def _jobs(lm: Any, texts: tuple[str, ...], lengths: tuple[int, ...]) -> list[tuple[str, int, np.ndarray]]:
    """The fit's (text, tokens, the text's ids) at each length that fits the text and the model's window."""
    from kvcodec.models.capture import max_context, tokenize
    from kvcodec.texts import load_text

    window = max_context(lm)
    jobs: list[tuple[str, int, np.ndarray]] = []
    for name in texts:
        ids = tokenize(lm.tokenizer, load_text(name))
        for T in lengths:
            T = min(T, len(ids) - FIT_CONTINUATION, (window - FIT_CONTINUATION) if isinstance(window, int) else T)
            if T >= MIN_FIT_TOKENS and (name, T) not in [(j[0], j[1]) for j in jobs]:
                jobs.append((name, T, ids))
    return jobs


def _measure(lm: Any, cal: Calibration, jobs: list[tuple[str, int, np.ndarray]], presets: Mapping[str, Mapping[str, Any]],
             desc: str, progress: bool, fast: Any = None) -> list[dict[str, Any]]:
    """One fit row per (job, preset) at the preset's table step: the real model's KL on the continuation against
    the exact cache, the raw prediction, the largest rival-logit gain, and ``dnll``: the mean change of the real
    continuation's NLL (positions 1.., as :func:`kvcodec.models.quality.compare_logits` scores ΔPPL), from which
    :meth:`RateModel.dppl_ratio` comes at no extra forward pass."""
    import torch
    from tqdm import tqdm

    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.models.quality import ExactSide, continue_logits
    from kvcodec.plan.pipelines import transform_plan
    from kvcodec.plan.ratecontrol import raw_predictor

    fit: list[dict[str, Any]] = []
    with tqdm(total=len(jobs) * (1 + len(presets)), desc=desc, file=sys.stderr, disable=not progress, leave=False,
              dynamic_ncols=True) as bar, torch.inference_mode():
        for name, T, ids in jobs:
            cache, cont, exact, imp = _fit_job(lm, ids, T, fast)
            side = ExactSide(exact, cont)
            bar.update(1)
            for preset, table in presets.items():
                settings, step0 = _table(table)
                pred = raw_predictor(cache, cal, settings, imp)(step0)
                dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, lm=lm, preset=preset, importance=imp, **settings))
                got = side.compare(continue_logits(lm, dec, cont))
                fit.append({"text": name, "tokens": T, "preset": preset, "step0": step0, "kl": got["kl"], "predicted": pred,
                            "rival_gain": got["rival_gain"], "dnll": got["dnll"]})
                bar.update(1)
    return fit


def _fit_job(lm: Any, ids: np.ndarray, T: int, fast: Any = None) -> tuple[Any, np.ndarray, Any, np.ndarray | None]:
    """(cache of the first ``T`` tokens, the continuation's ids, its exact logits, the cache's token importance).

    ``fast`` (the onboarding twin, :func:`kvcodec.models.compute.onboard_model`; None: ``lm``) runs the prefill; the
    exact logits are ``lm``'s own over that cache. Why that split: a continuation scored in bfloat16 carries a KL
    floor of ~1e-3 of its own (SmolLM2, 1K tokens, balanced's step: 0.0042 measured where float32 says 0.0020,
    faithful 0.0020 for 8.3e-5), while a bfloat16 prefill's cache, continued in float32, gives float32's KL to 12 %
    at balanced, small and faithful on both shipped models (BENCHMARKS.md, "Onboarding a new model")."""
    from kvcodec.models.capture import capture
    from kvcodec.models.quality import continue_logits
    from kvcodec.models.importance import cache_importance
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

    window_q = TOKENSCALE_DEFAULT["window"]
    fast = lm if fast is None else fast
    cache = capture(fast, token_ids=ids[:T], score_window=window_q)  # importance observed by the prefill
    cont = np.asarray(ids[T:T + FIT_CONTINUATION], np.int64)
    return cache, cont, continue_logits(lm, cache, cont), cache_importance(fast, cache, window=window_q)


def _table(table: Mapping[str, Any]) -> tuple[dict[str, Any], float]:
    """(a preset table's settings without ``step0``, copied; its ``step0``)."""
    settings: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in table.items()}
    return settings, float(settings.pop("step0"))


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
            raise KvcInputError(f"rate model: no usable measurement for preset {preset}; lossy presets need the model's "
                                "rate model, fitted on first use or by kvc calibrate --model MODEL")
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


def _answers(answers: Mapping[str, Any] | None) -> Mapping[str, Any]:
    return answers if answers is not None else {}


def _digests(presets: Mapping[str, Mapping[str, Any]], answers: Mapping[str, Any]) -> dict[str, str]:
    """Per preset, what its constants are fitted for: its settings with the tokenscale defaults merged in, and, for a
    preset that promises answers, the answer probe's version and its target (either changing refits that preset)."""
    from kvcodec.onboard.answercheck import PROBE_VERSION

    return {n: settings_digest({"": {**dict(t), **({"answer_probe": [PROBE_VERSION, repr(answers[n])]} if n in answers else {})}})
            for n, t in presets.items()}


def covered(rm: RateModel, presets: Mapping[str, Mapping[str, Any]], answers: Mapping[str, Any] | None = None) -> set[str]:
    """The presets of ``presets`` whose constants ``rm`` holds for their current settings (and answer probe).

    A file from before per-preset digests is judged as a whole: it covers the presets it fitted when the digest of
    their current settings is the one it recorded (none of them promised answers then)."""
    if rm.preset_sha256:
        want = _digests(presets, _answers(answers))
        return {n for n in presets if n in rm.alpha and rm.preset_sha256.get(n) == want[n]}
    names = set(rm.alpha)
    if names <= set(presets) and not names & set(_answers(answers)) and \
            rm.presets_sha256 == settings_digest({n: presets[n] for n in names}):
        return names
    return set()


def merge_rate_models(base: RateModel, part: RateModel, presets: Mapping[str, Mapping[str, Any]],
                      answers: Mapping[str, Any] | None = None) -> RateModel:
    """``base``'s constants for the presets it covers, ``part``'s for the rest (fitted with ``base``'s layer factors)."""
    keep = covered(base, presets, answers) - set(part.alpha)
    digests = _digests(presets, _answers(answers))
    return replace(base, alpha={**{n: base.alpha[n] for n in keep}, **part.alpha},
                   beta={**{n: v for n, v in base.beta.items() if n in keep}, **part.beta},
                   curve={**{n: v for n, v in base.curve.items() if n in keep}, **part.curve},
                   rival_per_step=part.rival_per_step if "near-lossless" in part.alpha else base.rival_per_step,
                   fit=[r for r in base.fit if r.get("preset") in keep] + part.fit,
                   fit_s=round((base.fit_s or 0.0) + (part.fit_s or 0.0), 1), presets_sha256=settings_digest(presets),
                   preset_sha256={n: digests[n] for n in keep | set(part.alpha)},
                   answer_step={**{n: v for n, v in base.answer_step.items() if n in keep}, **part.answer_step},
                   chat_factor={**{n: v for n, v in base.chat_factor.items() if n in keep}, **part.chat_factor},
                   prefill_dtype=base.prefill_dtype or part.prefill_dtype)


def find_rate_model(cal: Calibration, presets: Mapping[str, Mapping[str, Any]],
                    answers: Mapping[str, Any] | None = None) -> RateModel | None:
    """``cal``'s rate model (the user's, else the shipped one) covering every preset of ``presets``, or None."""
    return load_rate_model(cal, accept=lambda r: covered(r, presets, answers) == set(presets))


def with_dnll(lm: Any, cal: Calibration, rm: RateModel, presets: Mapping[str, Mapping[str, Any]],
              progress: bool = True) -> RateModel:
    """For ``kvc calibrate`` of a model whose rate model predates the ΔPPL ratio (an encode never runs it: a model
    without the ratio is planned on its KL promise, as before): ``rm`` with its rows of the presets whose KL says something of the ΔPPL ratio (mean row KL >=
    :data:`~kvcodec.calibration.ratemodel.DPPL_KL_FLOOR`) measured again with their NLL change: for a rate model
    fitted before rows recorded it. The same jobs and steps as the fit (the calibration allocated with ``rm``'s
    layer factors): the KL column comes out the same up to float sums, and the fitted constants are kept."""
    from kvcodec.calibration.ratemodel import DPPL_KL_FLOOR

    names = {r.get("preset") for r in rm.fit}
    redo = {n: t for n, t in presets.items() if n in names and n in rm.alpha
            and np.mean([r["kl"] for r in rm.fit if r.get("preset") == n]) >= DPPL_KL_FLOOR}
    if not redo:
        return rm
    t0 = time.time()
    want = {(str(r["text"]), int(r["tokens"])) for r in rm.fit if r.get("preset") in redo}
    jobs = [j for j in _jobs(lm, FIT_TEXTS, FIT_TOKENS) if (j[0], j[1]) in want]
    rows = _measure(lm, rm.allocated(cal), jobs, redo, f"kvc: measuring {lm.name}'s KL-to-ΔPPL ratio", progress)
    return replace(rm, fit=[r for r in rm.fit if r.get("preset") not in redo] + rows,
                   fit_s=round((rm.fit_s or 0.0) + time.time() - t0, 1))


def ensure_rate_model(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]], progress: bool = True,
                      answers: Mapping[str, Any] | None = None, targets: Mapping[str, Any] | None = None,
                      recipe: FitRecipe = QUICK) -> RateModel:
    """``cal``'s rate model for ``presets`` (and the answer probes of ``answers``, :func:`fit_rate_model`): the user's
    or the shipped one, else fitted once with ``recipe`` (a first use: :data:`QUICK`, with progress) and saved.
    Callers pass the preset table's own (:func:`kvcodec.api.resolve_rate_model`): other settings make the stored one
    stale.

    One that covers some of the presets (a preset added since, or one whose settings changed) is extended with its
    own recipe: only the missing presets are fitted, with its per-layer factors (a thorough model's per-layer
    measurement is most of its cost). Otherwise the whole model is fitted anew."""
    rm = find_rate_model(cal, presets, answers)
    if rm is not None:
        return rm
    base = load_rate_model(cal, accept=lambda r: (r.recipe == QUICK.name and bool(covered(r, presets, answers)))
                           or (r.layer_factor is not None and ALLOC_PRESET in covered(r, presets, answers)))
    if base is not None:
        missing = {n: t for n, t in presets.items() if n not in covered(base, presets, answers)}
        rm = merge_rate_models(base, fit_rate_model(lm, cal, missing, progress=progress, layer_factor=base.layer_factor,
                                                    answers=answers, targets=targets,
                                                    recipe=RECIPES.get(base.recipe, THOROUGH)), presets, answers)
    else:
        rm = fit_rate_model(lm, cal, presets, progress=progress, answers=answers, targets=targets, recipe=recipe)
    save_rate_model(rm, rate_model_path(cal))
    return rm


def calibrate_rate_model(lm: Any, cal: Calibration, presets: Mapping[str, Mapping[str, Any]], answers: Mapping[str, Any],
                         targets: Mapping[str, Any], *, fresh: bool, thorough: bool,
                         progress: bool = True) -> tuple[RateModel, bool]:
    """What ``kvc calibrate`` does to ``cal``'s rate model: (the rate model, whether anything was fitted or measured).

    ``fresh`` (a calibration just built: an older rate model is bound to another sha256) or ``thorough`` over a model
    whose rate model is not a thorough one: fitted anew, :data:`THOROUGH` or :data:`QUICK`, and saved. Otherwise the one
    it has (a preset added or changed since: fitted alone and merged, :func:`ensure_rate_model`), with what a file
    from before lacks measured and saved: the fit rows' NLL changes (:func:`with_dnll`), the chat factors
    (:func:`with_chat_factor`)."""
    had = None if fresh else find_rate_model(cal, presets, answers)
    if fresh or (thorough and (had is None or had.recipe != THOROUGH.name)):
        rm = fit_rate_model(lm, cal, presets, progress=progress, answers=answers, targets=targets,
                            recipe=THOROUGH if thorough else QUICK)
        save_rate_model(rm, rate_model_path(cal))
        return rm, True
    fitted = had is None
    rm = ensure_rate_model(lm, cal, presets, progress, answers, targets) if had is None else had
    if rm.dppl_ratio() is None and not any("dnll" in r for r in rm.fit):  # fitted before rows recorded it
        rm, fitted = with_dnll(lm, cal, rm, presets, progress), True
        save_rate_model(rm, rate_model_path(cal))
    if not rm.chat_factor:  # fitted before chat contexts were measured
        rm, fitted = with_chat_factor(lm, cal, rm, presets, targets, progress), True
        save_rate_model(rm, rate_model_path(cal))
    return rm, fitted
