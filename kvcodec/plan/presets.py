"""Preset name (+ overrides) -> encoding :class:`~kvcodec.core.stage.Plan`: the ONE place presets are defined
(their settings, their promises and the overrides they take).

Why one module: the CLI (``--config``), the library (:func:`get_plan`) and the vLLM
connector's ``kv_connector_extra_config`` all name a preset and optionally change its
settings. When each validated overrides with its own rules they disagreed (the CLI
accepted zstd level 22, which the zstd stage refuses), so :func:`check_overrides`
here is the only validator and every entry point calls it.

Presets:

* built in, lossless or casting: ``lossless`` (raw -> shuffle -> zstd), ``fp16`` (cast ->
  raw -> shuffle -> zstd), ``zstd`` (raw -> zstd), ``raw``;
* lossy transform codec (:func:`kvcodec.plan.pipelines.transform_plan`): ``near-lossless``, ``balanced``,
  ``small``. They *use* the model when given one (``uses_model``): the file is checked
  against the preset's quality target and ``step0`` lowered until it holds
  (:mod:`kvcodec.plan.check`), and ``balanced``/``small`` weight tokens by attention
  importance. Without a model (golden vectors, engines that only hold the cache, the vLLM
  connector) they encode at the preset's fixed ``step0`` with uniform steps (the guard's
  record, ``params["guard"]``, is then absent);
* baselines (:mod:`kvcodec.plan.baselines`), named ``baseline:NAME``.

This module imports the codec modules lazily: choosing or validating a preset does not
import torch-heavy encoders.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvcodec.errors import KvcInputError
from kvcodec.core.stage import Plan
from kvcodec.plan.targets import NEAR_TIE, QualityTarget

__all__ = ["PRESETS", "BASELINE_PREFIX", "DEFAULT_LOSSY", "Plan", "PresetInfo", "answer_targets", "available_presets", "check_overrides", "rate_controlled", "score_window",
           "get_plan", "plan_preset", "preset_args", "parse_config", "preset_info"]

BASELINE_PREFIX = "baseline:"
# the lossy preset a caller gets when it names none (kvcodec.encode, kvc ask, the KDN): what a capture made
# before its preset is known (kvc capture) observes the token importance for
DEFAULT_LOSSY = "faithful"
_LOSSY_KEYS = frozenset({"step0", "sink", "group", "basis", "deadzone", "calibration", "tokenscale", "max_bits",
                         "rans_blocks"})
_ZSTD_KEYS = frozenset({"level"})


@dataclass(frozen=True)
class PresetInfo:
    """What a preset is: whether it is lossy, whether it uses the model, which overrides it takes, its
    settings (the lossy codec's ``step0`` and friends) and what it promises (:class:`QualityTarget`)."""

    name: str
    lossy: bool
    uses_model: bool
    overrides: frozenset[str]
    settings: Mapping[str, Any] = field(default_factory=dict)
    target: QualityTarget | None = None
    kl_range: tuple[float, float] | None = None  # the mean KL targets this preset's settings can reach (target_kl)
    # it promises answers too (issue 53): greedy answers to questions about the context identical to in-context ones.
    # Rate control then also applies the model's answer probe (kvcodec.onboard.answercheck), measured at fit time
    answers: bool = False


# step0 of each lossy preset is in units of the cache's values (SmolLM2-135M-tuned by bench_codec.py
# measurements, valid for any model because the per-layer steps are scaled by that model's measured
# sensitivities). With the model at hand, get_plan checks every file against its preset's target and
# lowers step0 until it holds (kvcodec/plan/check.py).
PRESETS: dict[str, PresetInfo] = {
    "lossless": PresetInfo("lossless", False, False, _ZSTD_KEYS),
    "fp16": PresetInfo("fp16", False, False, _ZSTD_KEYS),
    "zstd": PresetInfo("zstd", False, False, _ZSTD_KEYS),
    "raw": PresetInfo("raw", False, False, frozenset()),
    # 16-bit codes (quantize v2): 8-bit codes widen wide channels' steps, which floors near-lossless (issue 15)
    "near-lossless": PresetInfo("near-lossless", True, True, _LOSSY_KEYS,
                                {"step0": 0.004, "sink": 4, "group": 8, "max_bits": 16},
                                QualityTarget(kl=2e-4, top1=0.99, dppl_percent=0.5, greedy_tokens=16, rival_gain=NEAR_TIE),
                                (1e-7, 1e-3)),
    # tokenscale (importance-weighted steps, needs the model at encode time; uniform steps without it)
    "balanced": PresetInfo("balanced", True, True, _LOSSY_KEYS,
                           {"step0": 0.33, "sink": 4, "group": 8, "tokenscale": {"max_log2": 2.0}},
                           QualityTarget(kl=0.01, top1=0.93, dppl_percent=1.0), (3e-4, 0.05)),
    # the KDN's default (issue 53): its promise is on answers. Why no tokenscale: an importance learned from the
    # context's own attention coarsens exactly the facts that only a later question reads (balanced: 25 % of answers
    # identical to in-context at 1.07 bits/element). Why this KL: a greedy answer is identical only if every one of
    # its tokens is; on SmolLM2 at 4K tokens identical answers rose from 54 % (uniform step 0.33, 2.8 bits) to 83-88 %
    # (step 0.12 to 0.03, 4.1-5.9 bits), and near-lossless's 9.2 bits reached 96 % (BENCHMARKS.md "Answers")
    "faithful": PresetInfo("faithful", True, True, _LOSSY_KEYS,
                           {"step0": 0.065, "sink": 4, "group": 8},
                           QualityTarget(kl=2e-4, top1=0.98, dppl_percent=0.5), (1e-5, 0.01), answers=True),
    "small": PresetInfo("small", True, True, _LOSSY_KEYS,
                        {"step0": 0.8, "sink": 4, "group": 8, "tokenscale": {"max_log2": 3.0}},
                        QualityTarget(kl=0.05, top1=0.85, dppl_percent=5.0), (3e-3, 0.2)),
}
CONFIG_KEYS = frozenset({"preset"}) | _LOSSY_KEYS | _ZSTD_KEYS


def lossy_settings() -> dict[str, Mapping[str, Any]]:
    """The settings of every preset with a promise (what a model's rate model is fitted on)."""
    return {n: p.settings for n, p in PRESETS.items() if p.lossy and p.target is not None}


def preset_targets() -> dict[str, QualityTarget]:
    """Every preset with a promise, with its target: what the rate model's chat factors are measured for."""
    return {n: p.target for n, p in PRESETS.items() if p.lossy and p.target is not None}


def answer_targets() -> dict[str, QualityTarget]:
    """The presets that promise answers, with their targets: what the rate model's answer probe runs for."""
    return {n: p.target for n, p in PRESETS.items() if p.answers and p.target is not None}


def available_presets() -> list[str]:
    """The preset names a user may give (baselines are named ``baseline:NAME`` and listed by kvcodec.plan.baselines)."""
    return list(PRESETS)


def preset_info(name: Any, where: str = "preset") -> PresetInfo:
    """The preset's :class:`PresetInfo`; an unknown name is one :class:`KvcInputError` line."""
    info = PRESETS.get(name) if isinstance(name, str) else None
    if info is None:
        raise KvcInputError(f"{where}: unknown preset {name!r} (available: {', '.join(PRESETS)})")
    return info


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _tokenscale_ok(v: Any) -> bool:
    if v is None:
        return True
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

    return isinstance(v, dict) and set(v) <= set(TOKENSCALE_DEFAULT)


def _level_ok(v: Any) -> bool:
    from kvcodec.codecs.lossless import ZSTD_LEVELS

    return _int(v) and v in ZSTD_LEVELS


#: the quantizer's base steps a caller may set (outside it the steps under- or overflow)
STEP0_RANGE = (1e-12, 1e3)

# The rules are the stages' own limits (QuantizeStage: deadzone in [0, 0.5); Zstd: ZSTD_LEVELS), checked here
# before any work so a bad value is refused in one line instead of minutes into an encode.
_CHECKS: dict[str, tuple[Any, str]] = {
    # measured on SmolLM2: 1e-12 and 1e3 encode; 1e-300 underflows the weighted steps to 0 and 1e6 passes float16's
    # range, each refused only after the calibration loaded and the plan was built
    "step0": (lambda v: _number(v) and STEP0_RANGE[0] <= v <= STEP0_RANGE[1],
              f"a positive number in [{STEP0_RANGE[0]:g}, {STEP0_RANGE[1]:g}]"),
    "sink": (lambda v: _int(v) and v >= 0, "an integer >= 0"),
    "group": (lambda v: _int(v) and v > 0, "an integer > 0"),
    "basis": (lambda v: v in ("pca", "hadamard"), "'pca' or 'hadamard'"),
    "deadzone": (lambda v: _number(v) and 0 <= v < 0.5, "a number in [0, 0.5)"),
    "max_bits": (lambda v: _int(v) and 1 <= v <= 16, "an integer in [1, 16] (over 8: quantize v2's 16-bit codes)"),
    "rans_blocks": (lambda v: _int(v) and (v == 0 or (32 <= v <= 1 << 20 and v % 32 == 0)),
                    "0 (rans v1) or a multiple of 32 in [32, 2**20] (rans v2's block of tokens)"),
    "calibration": (lambda v: v in ("external", "embedded"), "'external' or 'embedded'"),
    "tokenscale": (_tokenscale_ok, "null or an object with keys from window, bits, log2_step, min_log2, power, max_log2, kinds, floor"),
    "level": (_level_ok, "an integer zstd level in [-7, 19]"),
}


def check_overrides(preset: str, overrides: dict[str, Any], where: str = "config") -> dict[str, Any]:
    """Validate ``overrides`` of ``preset`` (the ONE validator: CLI, library and vLLM config); return a copy."""
    info = preset_info(preset, where)
    if not isinstance(overrides, dict):
        raise KvcInputError(f"{where}: overrides must be an object, got {type(overrides).__name__}")
    bad = sorted(set(overrides) - info.overrides)
    if bad:
        takes = ", ".join(sorted(info.overrides)) or "no overrides"
        raise KvcInputError(f"{where}: preset {preset} does not take {bad} (it takes {takes})")
    for k, v in overrides.items():
        ok, what = _CHECKS[k]
        if not ok(v):
            raise KvcInputError(f"{where}: {k} must be {what}, got {v!r}")
    return dict(overrides)


def parse_config(cfg: Any, where: str = "config") -> tuple[str, dict[str, Any]]:
    """(preset, checked overrides) of a ``{"preset": NAME, **overrides}`` object."""
    if not isinstance(cfg, dict) or not isinstance(cfg.get("preset"), str):
        raise KvcInputError(f'{where} must be a JSON object with a "preset" name, e.g. {{"preset": "balanced", "step0": 0.25}}')
    unknown = sorted(set(cfg) - CONFIG_KEYS)
    if unknown:
        raise KvcInputError(f"{where}: unknown keys {unknown} (known: {', '.join(sorted(CONFIG_KEYS))})")
    over = {k: v for k, v in cfg.items() if k != "preset"}
    return cfg["preset"], check_overrides(cfg["preset"], over, where)


def _dtype(cache: Any) -> str:
    return str(cache.dtype).removeprefix("torch.")


RATE_MODES = ("predict", "check", "fixed")


def score_window(name: str | None, overrides: Mapping[str, Any] | None = None) -> int | None:
    """The window of token importance the plan of preset ``name`` (with ``overrides``) reads, or None if it
    reads none: what a capture made for this encode should observe (``capture(..., score_window=)``), so the
    encoder runs no forward pass of its own."""
    if not isinstance(name, str) or name not in PRESETS or not PRESETS[name].lossy:
        return None
    ts = {**dict(PRESETS[name].settings), **dict(overrides or {})}.get("tokenscale")
    if ts is None:
        return None
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

    w = {**TOKENSCALE_DEFAULT, **ts}["window"]
    return w if isinstance(w, int) and not isinstance(w, bool) and w > 0 else None


def capture_window() -> int | None:
    """The widest token-importance window any preset reads: what a capture made before its preset is known
    (``kvc capture``) observes, so a later encode with any preset runs no forward pass over the context."""
    windows = [w for w in (score_window(n) for n in PRESETS) if w is not None]
    return max(windows) if windows else None


def target_for(info: PresetInfo, target_kl: float | None = None, target_dppl: float | None = None) -> QualityTarget:
    """``info``'s promise with its mean KL replaced by ``target_kl``, or by the KL a mean ΔPPL of ``target_dppl`` %
    corresponds to (``log(1 + dppl/100)``: a continuation drawn from the model has mean NLL change = KL).

    Why one line for a target outside the preset's range: below it the preset's code widths floor the
    quality (e.g. balanced's 8-bit codes, ~5e-5), above it the promise's first-order law breaks down.
    """
    from dataclasses import replace

    if info.target is None or info.kl_range is None:
        raise KvcInputError(f"preset {info.name} takes no quality target (the lossy presets do: "
                            f"{', '.join(n for n, p in PRESETS.items() if p.kl_range)})")
    if (target_kl is None) == (target_dppl is None):
        raise KvcInputError("give exactly one of target_kl and target_dppl")
    kl = target_kl if target_kl is not None else math.log1p(float(target_dppl) / 100.0)  # type: ignore[arg-type]
    lo, hi = info.kl_range
    if not (_number(kl) and lo <= kl <= hi):
        what = f"target_kl {target_kl!r}" if target_kl is not None else f"target_dppl {target_dppl!r} % (KL {kl:.3g})"
        raise KvcInputError(f"{what} is outside preset {info.name}'s range [{lo:g}, {hi:g}] nats; "
                            f"choose another preset ({', '.join(f'{n} [{p.kl_range[0]:g}, {p.kl_range[1]:g}]' for n, p in PRESETS.items() if p.kl_range)})")
    scale = kl / info.target.kl
    return replace(info.target, kl=kl, dppl_percent=info.target.dppl_percent * scale,
                   rival_gain=info.target.rival_gain if scale <= 1 else 0.0,
                   greedy_tokens=info.target.greedy_tokens if scale <= 1 else 0)


_WARNED: set[tuple[str, str]] = set()


def _warn_answer_factor(model: str | None, name: str, rm: Any) -> None:
    """One warning line per (model, preset) whose answer probe lowered the step: never a silent change of rate."""
    f = rm.answer_factor(name)
    key = (str(rm.fingerprint_id), name)
    if f < 1.0 and key not in _WARNED:
        import logging

        _WARNED.add(key)
        logging.getLogger("kvcodec.plan").warning(
            "%s: preset %s lost answers on this model's answer probe at its KL-chosen step; depositing at x%g that "
            "step (more bits) to keep them", model if model is not None else rm.fingerprint_id, name, f)


def rate_controlled(name: str, rate: str = "predict", target: QualityTarget | None = None, **overrides: Any) -> bool:
    """Whether preset ``name``'s step is chosen by rate control when the model is at hand (and so needs the model's
    rate model, resolved before planning by :func:`kvcodec.api.resolve_rate_model`): a lossy preset with a promise
    (or ``target``), a PCA basis, no ``step0`` override, ``rate`` not ``"fixed"``."""
    if rate == "fixed" or "step0" in overrides or (isinstance(name, str) and name.startswith(BASELINE_PREFIX)):
        return False
    info = preset_info(name)
    basis = overrides.get("basis", info.settings.get("basis", "pca"))
    return info.lossy and (target or info.target) is not None and basis == "pca"


def preset_args(name: str, overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Lossy preset ``name``'s settings with (checked) ``overrides`` over them: what its transform plan is built from."""
    args: dict[str, Any] = {k: (dict(v) if isinstance(v, dict) else v) for k, v in preset_info(name).settings.items()}
    args.update(overrides)
    return args


def plan_preset(name: str, cache: Any, *, cal: Any = None, importance: Any = None, target: QualityTarget | None = None,
                rate: Any = None, check_model: Any = None, **overrides: Any) -> Plan:
    """The plan of preset ``name`` (or ``baseline:NAME``) + ``overrides`` for ``cache``, from inputs resolved before
    planning (:func:`kvcodec.api.make_plan`): the planner only plans, it looks nothing up, fits nothing and runs no
    model (but the opt-in check's).

    ``cal``: the model's calibration, which a PCA plan requires (never looked up here); ``importance``: the context's
    token importance [L, T] where the preset weighs tokens (None: uniform steps); ``rate``: rate control's inputs
    (:class:`~kvcodec.plan.ratecontrol.RateInputs`: the model's rate model and this context's factor; None: the
    preset's table step); ``check_model``: the model that confirms rate control's step on the document's tail
    (:mod:`kvcodec.plan.check`, ``rate="check"``); ``target`` replaces the preset's promise (:func:`target_for`).
    """
    if isinstance(name, str) and name.startswith(BASELINE_PREFIX):
        from kvcodec.plan.baseline_plans import get_baseline_plan

        return get_baseline_plan(name.removeprefix(BASELINE_PREFIX), cache, **overrides)
    info = preset_info(name)
    overrides = check_overrides(name, overrides)
    if info.lossy:
        args = preset_args(name, overrides)
        if cal is not None:
            args["cal"] = cal
        target = target or info.target
        if rate is not None and rate_controlled(name, "predict", target, **overrides):
            from kvcodec.plan.ratecontrol import rate_controlled_plan

            plan = rate_controlled_plan(cache, name, args, target, rate, importance, check_model=check_model)
            _warn_answer_factor(rate.model, name, rate.rm)
            return plan
        if importance is not None:
            args["importance"] = importance
        from kvcodec.plan.pipelines import transform_plan

        return transform_plan(cache, preset=name, **args)
    from kvcodec.codecs.lossless import fp16_pipeline, lossless_pipeline, raw_pipeline

    level = overrides.get("level", 3)
    if name == "lossless":
        return Plan(lossless_pipeline(_dtype(cache), level=level), {}, name)
    if name == "fp16":
        if _dtype(cache) == "bfloat16":
            raise KvcInputError("preset 'fp16' would change a bfloat16 cache's range; use 'lossless'")
        return Plan(fp16_pipeline(level=level), {}, name)
    if name == "zstd":
        return Plan(lossless_pipeline(_dtype(cache), level=level, shuffle=False), {}, name)
    return Plan(raw_pipeline(_dtype(cache)), {}, name)


def get_plan(name: str, cache: Any, lm: Any = None, *, rate: str = "predict", cal: Any = None,
             importance: Any = None, target: QualityTarget | None = None, rm: Any = None, **overrides: Any) -> Plan:
    """The plan of preset ``name`` (or ``baseline:NAME``) for ``cache``, its missing inputs resolved here: for scripts,
    tests and golden vectors that name a preset and hold a cache. An encode plans through
    :func:`kvcodec.api.make_plan`, which resolves the inputs once and calls :func:`plan_preset`.

    ``overrides`` are the preset's settings to change (checked by :func:`check_overrides`). ``cal``: the model's
    calibration (looked up here when not given: a model without one is a one-line error naming ``kvc calibrate``;
    building one is the caller's choice, :func:`kvcodec.calibration.build.ensure_calibration`); ``importance``:
    precomputed per-(layer, token) importance [L, T] (measured with ``lm`` when not given and the preset weighs
    tokens); ``rm``: the model's rate model (:class:`~kvcodec.calibration.ratemodel.RateModel`), which rate control
    needs (:func:`rate_controlled`): never fitted here (:func:`kvcodec.api.resolve_rate_model`).

    ``rate`` (lossy presets with a model ``lm`` and no ``step0`` override) chooses ``step0``:
    ``"predict"`` (default) from the rate model's predicted KL (:mod:`kvcodec.plan.ratecontrol`, no model
    forward pass beyond the token importance); ``"check"`` predicts, then confirms on the
    document's tail with the real model (:mod:`kvcodec.plan.check`); ``"fixed"`` is the preset's
    table step. Without a model every lossy preset encodes at its table step. ``target`` replaces
    the preset's promise (:func:`target_for`: ``kvc encode --target-kl``).
    """
    if rate not in RATE_MODES:
        raise KvcInputError(f"rate must be one of {', '.join(RATE_MODES)}, got {rate!r}")
    if isinstance(name, str) and name.startswith(BASELINE_PREFIX):
        return plan_preset(name, cache, **overrides)
    info = preset_info(name)
    overrides = check_overrides(name, overrides)
    if not info.lossy:
        return plan_preset(name, cache, **overrides)
    args = preset_args(name, overrides)
    if cal is None and args.get("basis", "pca") == "pca":
        from kvcodec.calibration.store import require_calibration

        cal = require_calibration(cache.fingerprint)  # resolved once here, passed down; never built here
    if lm is not None and rate_controlled(name, rate, target or info.target, **overrides):
        from kvcodec.plan.ratecontrol import controlled_plan

        if rm is None:  # the planner only plans: the rate model is an input, fitted or loaded before (kvcodec.api)
            raise KvcInputError(f"preset {name}: rate control needs the model's rate model (rm=); plan through "
                                "kvcodec.api.make_plan, which resolves it, or pass rate='fixed'")
        if cal is not None:
            args["cal"] = cal
        plan = controlled_plan(cache, lm, name, args, target or info.target, rm, check=rate == "check", importance=importance)
        _warn_answer_factor(getattr(lm, "name", None), name, rm)
        return plan
    if lm is not None and importance is None and args.get("tokenscale") is not None:
        from kvcodec.models.importance import cache_importance
        from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

        importance = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"])
    return plan_preset(name, cache, cal=cal, importance=importance, target=target, **overrides)
