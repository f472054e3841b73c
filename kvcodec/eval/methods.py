"""The methods a rate-quality sweep compares: the codec's presets and target-KL plans, the baselines, the peers
and H2O, each a builder from a captured text to the cache (and plan) it stores.

Why a module of its own: which methods exist, how a ``--methods`` list selects them and what each builds is
independent of how a sweep runs them (:mod:`kvcodec.eval.curve`) and how its rows are reported
(:mod:`kvcodec.eval.report`); ``kvc demo`` and the tests select methods without running a sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from kvcodec.core.kvcache import KVCache
from kvcodec.errors import KvcInputError
from kvcodec.models.cachelayout import cache_prefix
from kvcodec.api import PRESETS as _PRESETS
from kvcodec.api import make_plan
from kvcodec.plan import pipelines as codecplan

LOSSY_PRESETS = [n for n, p in _PRESETS.items() if p.lossy]
BASELINE_FAMILIES = ("fp16", "fp16+zstd", "int8", "kivi", "cachegen")
# real peer libraries (kvcodec/eval/peers.py): run their own code, skipped with a reason when not installed
PEER_FAMILIES = ("hf-quanto", "hf-hqq", "kvpress")
# kvcodec's lossy presets in another configuration: family -> (keyword arguments of _preset, row note)
_PRESET_VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "kvcodec-fixed": ({"rate": "fixed"}, "the preset's table step0, without rate control"),
    "kvcodec-checked": ({"rate": "check"}, "rate control confirmed by the opt-in encode-time check (--check)"),
    "kvcodec-embedded": ({"embedded": True}, "calibration embedded in the file (its bytes are charged to this one file)"),
}
ALL_FAMILIES = ("kvcodec", "kvcodec-kl", *BASELINE_FAMILIES, *PEER_FAMILIES, "h2o")
# not in "all": the lossy presets at their table step0, with the opt-in check, or with an embedded calibration
EXTRA_FAMILIES = ("kvcodec-fixed", "kvcodec-checked", "kvcodec-embedded")
DEFAULT_TARGET_KLS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
DEFAULT_H2O_BUDGETS = ("h2o:0.2", "h2o:0.35", "h2o:0.5", "h2o:0.75")


# -- the codec's presets ------------------------------------------------------------------
def codec_presets() -> list[str]:
    """Preset names worth sweeping: ``lossless`` and ``fp16`` (format) and the lossy presets (codec).

    ``raw`` (fp32 as is) and ``zstd`` (lossless minus shuffle) are left out of sweeps.
    """
    return ["lossless", "fp16"] + [n for n in LOSSY_PRESETS if n not in ("lossless", "fp16")]


# -- method registry ----------------------------------------------------------------------
@dataclass
class TextCase:
    """One text: the exact capture and what the evaluation needs from it."""

    name: str
    cache: KVCache
    continuation: np.ndarray
    tokens_sha: str
    exact_logits: Any = None
    exact_greedy: list[int] | None = None
    scores: np.ndarray | None = None  # H2O attention scores, computed on demand
    kvpress_kept: dict[str, np.ndarray] | None = None  # kvpress runner key -> kept indices, computed on demand
    near_tie_at: int | None = None  # first exact greedy step with a top-2 margin under guard.NEAR_TIE (None: none)


@dataclass
class Method:
    family: str
    setting: str
    # (lm, case) -> (cache to encode, plan with .pipelines/.attachments/.preset[/.chunk_tokens])
    build: Callable[[Any, TextCase], tuple[KVCache, Any]] | None
    note: str = ""
    # peers that are not .kvc encoders: (lm, case) -> (the cache the peer attends to, bits it stores)
    roundtrip: Callable[[Any, TextCase], tuple[KVCache, int]] | None = None

    @property
    def key(self) -> str:
        return f"{self.family}/{self.setting}"


@dataclass
class MethodList:
    methods: list[Method] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _baseline(name: str) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        from kvcodec.plan.baselines import get_baseline_plan

        return case.cache, get_baseline_plan(name, case.cache)

    return build


def _preset(name: str, rate: str = "predict", embedded: bool = False) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        # the calibration travels inside the file when embedded (self-contained; its bytes are in file_bytes)
        return case.cache, make_plan(case.cache, name, model=lm, rate=rate,
                                     overrides={"calibration": "embedded"} if embedded else None)

    return build


TUNE_TOKENS = 256


def _target(kl: float) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    """kvcodec at a KL target, tuned *without* peeking at the evaluation continuation.

    ``plan_for_target`` bisects the rate knob on a cache and a continuation;
    here the cache is the context minus its last TUNE_TOKENS tokens and the
    continuation is those tokens, all inside the context. The knob found is
    then applied to the full cache, which is evaluated on the held-out text
    that follows it.
    """
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        c = case.cache
        n_tune = min(TUNE_TOKENS, c.num_tokens // 4)
        if c.positions is not None or n_tune < 2:
            raise KvcInputError("target-KL tuning needs an unpruned cache of at least 8 tokens")
        from kvcodec.calibration.store import require_calibration

        cal = require_calibration(c.fingerprint)  # the planner's input, resolved once for the search and the plan
        tune = cache_prefix(c, c.num_tokens - n_tune, lm)
        _, info = codecplan.plan_for_target(tune, lm, target_kl=kl, continuation=c.token_ids[c.num_tokens - n_tune:], cal=cal)
        plan = codecplan.transform_plan(c, info["step0"], cal=cal, lm=lm, preset=f"target-kl-{kl:g}")
        plan.params = dict(getattr(plan, "params", {}) or {}, tuned_kl=info.get("kl_mean"), tuned_on="context tail")
        return c, plan

    return build


def _hf_quant(name: str) -> Callable[[Any, TextCase], tuple[KVCache, int]]:
    def roundtrip(lm: Any, case: TextCase) -> tuple[KVCache, int]:
        from kvcodec.eval.peers import HFQuantSpec, hf_quantized_roundtrip

        return hf_quantized_roundtrip(case.cache, HFQuantSpec.parse(name))

    return roundtrip


def _kvpress(name: str, every: list[str]) -> Callable[[Any, TextCase], tuple[KVCache, int]]:
    """A kvpress press (real library, own venv): the presses of ``every`` run once per text, in one subprocess."""
    def roundtrip(lm: Any, case: TextCase) -> tuple[KVCache, int]:
        from kvcodec.eval.peers import KvpressSpec, kvpress_indices, kvpress_roundtrip

        spec = KvpressSpec.parse(name)
        if case.kvpress_kept is None or spec.runner_key not in case.kvpress_kept:
            case.kvpress_kept = kvpress_indices(lm, case.cache, [KvpressSpec.parse(n) for n in every])
        return kvpress_roundtrip(case.cache, case.kvpress_kept[spec.runner_key], spec)

    return roundtrip


def _h2o(spec: str) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        from kvcodec.plan.baselines import get_baseline_plan
        from kvcodec.prune.budget import H2OBudget, parse_prune
        from kvcodec.prune.h2o import attention_scores, h2o_prune

        budget = parse_prune(spec)
        if not isinstance(budget, H2OBudget):  # select_methods routes only "h2o:..." specs here
            raise KvcInputError(f"not an H2O budget: {spec!r}")
        if case.scores is None:
            _, case.scores = attention_scores(lm, case.cache.token_ids, budget.window)
        pruned = h2o_prune(case.cache, case.scores, budget)
        return pruned, get_baseline_plan("fp16", pruned)

    return build


def select_methods(selected: list[str] | None = None, target_kls: list[float] | None = None,
                   h2o_budgets: list[str] | None = None) -> MethodList:
    """Methods for the families/names in ``selected`` (default: all).

    Entries may be families (``kivi``), one setting (``kivi2``, ``kvcodec:NAME``,
    ``h2o:0.25``) or ``all``.
    """
    sel = [s.strip() for s in (selected or ["all"]) if s.strip()]
    if "all" in sel:
        sel = [s for s in sel if s != "all"] + list(ALL_FAMILIES)
    out = MethodList()
    seen: set[str] = set()
    kv_names: list[str] = []  # every kvpress setting selected: their presses run in one subprocess per text

    def add(m: Method) -> None:
        if m.key not in seen:
            seen.add(m.key)
            out.methods.append(m)

    bl_family = {"fp16": ["fp16"], "fp16+zstd": ["fp16+zstd"], "int8": ["int8"], "kivi": ["kivi2", "kivi4"],
                 "cachegen": ["cachegen-lo", "cachegen", "cachegen-hi", "cachegen-ctx-lo", "cachegen-ctx", "cachegen-ctx-hi"],
                 "kivi-window": ["kivi2-window", "kivi4-window"]}
    bl_of = {name: fam for fam, names in bl_family.items() for name in names}
    for s in sel:
        if s in bl_family:
            for name in bl_family[s]:
                add(Method(s, name, _baseline(name)))
        elif s in bl_of:
            add(Method(bl_of[s], s, _baseline(s)))
        elif s == "kvcodec" or s.startswith("kvcodec:"):
            for n in codec_presets() if s == "kvcodec" else [s.split(":", 1)[1]]:
                if n not in _PRESETS:  # refused here, not when its turn comes after the model load and the captures
                    raise KvcInputError(f"kvcodec:{n}: unknown preset (available: {', '.join(_PRESETS)})")
                add(Method("kvcodec", n, _preset(n)))
        elif s.split(":", 1)[0] in _PRESET_VARIANTS:
            fam = s.split(":", 1)[0]
            kw, note = _PRESET_VARIANTS[fam]
            for n in list(LOSSY_PRESETS) if s == fam else [s.split(":", 1)[1]]:
                if n not in LOSSY_PRESETS:
                    raise KvcInputError(f"{fam}: {n!r} is not a lossy preset ({', '.join(LOSSY_PRESETS)})")
                add(Method(fam, n, _preset(n, **kw), note=note))
        elif s == "kvpress" or s.startswith("kvpress:"):
            from kvcodec.eval.peers import DEFAULT_KVPRESS_SPECS, KvpressSpec, kvpress_available

            reason = kvpress_available()
            if reason is not None:
                if not any(n.startswith("kvpress") for n in out.notes):
                    out.notes.append(f"kvpress skipped: {reason}")
                continue
            names = [sp.name for sp in DEFAULT_KVPRESS_SPECS] if s == "kvpress" else [KvpressSpec.parse(s.split(":", 1)[1]).name]
            kv_names.extend(names)
            for n in names:
                add(Method("kvpress", n, None, roundtrip=_kvpress(n, kv_names),
                           note="real library (NVIDIA kvpress 0.5.5, own venv) picks the kept tokens; "
                                "bits = kept fraction x 16, or the QuantizedCache's stored bits of the kept entries"))
        elif s in PEER_FAMILIES or s.split(":", 1)[0] in PEER_FAMILIES:
            from kvcodec.eval.peers import DEFAULT_SPECS, HFQuantSpec, available

            fam = s.split(":", 1)[0]
            backend = fam.removeprefix("hf-")
            reason = available(backend)
            if reason is not None:
                if not any(backend in n for n in out.notes):
                    out.notes.append(f"{fam} skipped: {reason}")
                continue
            specs = [sp for sp in DEFAULT_SPECS if sp.backend == backend] if ":" not in s else [HFQuantSpec.parse(s.split(":", 1)[1])]
            for sp in specs:
                add(Method(fam, sp.name, None, roundtrip=_hf_quant(sp.name),
                           note="real library (transformers QuantizedCache); bits = codes + 16-bit scales/zeros"))
        elif s == "kvcodec-kl":
            for kl in target_kls or DEFAULT_TARGET_KLS:
                add(Method("kvcodec-kl", f"kl<={kl:g}", _target(float(kl)),
                           note=f"rate knob tuned on the context's last {TUNE_TOKENS} tokens, evaluated on the held-out continuation"))
        elif s == "h2o" or s.startswith("h2o:"):
            for spec in ([s] if s.startswith("h2o:") else (h2o_budgets or list(DEFAULT_H2O_BUDGETS))):
                from kvcodec.prune.budget import H2OBudget, parse_prune

                if not isinstance(parse_prune(spec), H2OBudget):  # parsed only when its turn came (--h2o bogus)
                    raise KvcInputError(f"--h2o: not an H2O budget: {spec!r} (e.g. h2o:0.25)")
                add(Method("h2o", spec, _h2o(spec), note="H2O pruning only; kept tokens stored as fp16"))
        else:
            raise KvcInputError(
                f"unknown method {s!r} (families: {', '.join(ALL_FAMILIES)}; or one of "
                f"{', '.join(bl_of)}, kvcodec:PRESET, h2o:BUDGET)"
            )
    return out


