"""The opt-in encode-time check (``--check``): confirm the rate control's step on the document's tail with the real model.

By default the encoder picks ``step0`` from the rate model's prediction with no model forward
pass (:mod:`kvcodec.plan.ratecontrol`). A user who wants a measurement on *this* document asks for this
check: it starts at the predicted step and lowers it until the probe meets the promise (a
statistical check, not a proof). A probe whose KL is far from the prediction is logged as a
warning (the rate model is off for this text) and the measured step is used: never a silent miss.

**The probe is the same experiment as the promise, out of sample.** The
context's last ``n`` tokens (the *probe*) are a real continuation of its first
``T - n`` tokens. Each try encodes that *prefix as a document of its own*
(its own token importance: tokenscale scores the prefix's last queries, not
the probe's), decodes it, continues it on the probe with the model and
compares with the exact prefix. An earlier version encoded the whole context
and cut the decoded prefix out of it: tokenscale had then fitted its step
classes to the very queries the probe asks, and the probe's KL came out
1.3-2.3x below the continuation's on every held-out text (the miss on mpl2).

**What is checked: the stable measures.** Mean KL <= ``CHECK_MARGIN`` x the target and top-1
agreement >= the promise, plus near-lossless's greedy tokens. ΔPPL is reported, not checked: on
256 tokens it is dominated by sampling noise (:mod:`kvcodec.plan.targets`).

**Step prediction instead of blind shrinking.** Quantisation noise power is
proportional to step^2, so KL scales as step^2. After a miss the next step is the one this law says
meets the target, times ``SAFETY``; a miss then costs one or two more tries,
not up to ten. Below some step the quantiser's 8-bit limit widens the
step of wide channels, so quality stops improving (KL ~5e-5 with SmolLM2): a
try whose KL did not fall below ``FLOOR_KL_RATIO`` x the previous one's has
hit that floor, and the check stops there and keeps the previous (larger)
step instead of spending tries on bits that buy nothing.

**Greedy tokens and near-ties.** ``near-lossless`` promises the exact cache's
greedy tokens. Where the exact model's top-2 logit margin is below
``NEAR_TIE`` no codec can promise it: rounding the exact cache to fp16 (what
engines keep KV in) moves logits by up to ~0.012 on the held-out texts, so such
a token can flip with any storage. The promise (and this check) is: greedy
tokens identical up to the first token whose exact top-2 margin is below
``NEAR_TIE``, all 16 when there is none.

**Greedy tokens by construction: the rival gain.** A 16-token greedy check on
the probe is a sample of 16 margins; the continuation a user asks has others.
A greedy token can flip only where some token's logit gains more on the exact
top-1 token's than the exact top-2 margin (:func:`kvcodec.models.quality.max_rival_gain`). So
``near-lossless`` also bounds the largest such gain over all probe positions
(256 positions x the vocabulary) by ``NEAR_TIE``: flips are then confined to
near-ties, which the promise exempts. The bound is a maximum over 256 probe
positions standing for a 16-token greedy run, which is its margin. Gains scale
with the step, so a miss predicts the next step linearly. This needs codes finer than 8 bits on wide coefficient
channels (``quantize`` v2, ``max_bits`` 16): with v1 the gain floors at ~0.3
(benchmarks/results/floor/floor.txt).

The chosen ``step0`` is then applied to the whole context (the caller encodes
it once). Nothing in the file format changes: ``step0`` is already in every
stage config and in the plan's metadata.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvcodec.models.cachelayout import cache_prefix
from kvcodec.plan.targets import NEAR_TIE, QualityTarget

log = logging.getLogger("kvcodec.guard")

PROBE_TOKENS = 256  # probe continuation length (tokens inside the context)
MIN_PROBE_TOKENS = 16  # a shorter context is encoded at the predicted step, unchecked (reported as such)
CHECK_MARGIN = 0.8  # the probe's KL must be <= this x the target (the probe is itself a sample)
SAFETY = 0.9  # step factor under the KL ∝ step^2 law's prediction after a miss
GREEDY_SHRINK = 0.5  # step factor after a greedy flip at a clear (non-tie) margin
TOP1_SHRINK = 0.7  # step factor after a top-1 agreement under the promise
MAX_TRIES = 4  # with prediction a miss costs 1-2 tries; 4 leaves room for one bad prediction
FLOOR_KL_RATIO = 0.8  # a smaller step that leaves KL above this x the last try's: the format's floor (max_bits)
OFF_RATIO = 3.0  # a probe KL this far (either way) from the rate model's prediction is warned about


@dataclass(frozen=True)
class ProbeStats:
    """One try's probe: KL, top-1 agreement, the per-token ΔPPL terms (reported) and the greedy check."""

    kl: float
    top1: float
    d_mean: float  # mean of nll_decoded - nll_exact per probe token (nats)
    d_std: float
    n: int
    greedy_ok: bool
    rival_gain: float = 0.0  # max_rival_gain of the probe

    def meets(self, target: QualityTarget) -> bool:
        return (self.kl <= CHECK_MARGIN * target.kl and self.top1 >= target.top1 and self.greedy_ok
                and (not target.rival_gain or self.rival_gain <= target.rival_gain))

    def step_factor(self, target: QualityTarget) -> float:
        """Largest r <= 1 such that step0 x r meets ``target`` under KL ∝ step^2 and rival gain ∝ step."""
        r = 1.0
        if self.kl > 0:
            r = min(r, math.sqrt(CHECK_MARGIN * target.kl / self.kl))
        if self.top1 < target.top1:
            r = min(r, TOP1_SHRINK)
        if target.rival_gain and self.rival_gain > 0:
            r = min(r, target.rival_gain / self.rival_gain)
        if not self.greedy_ok:
            r = min(r, GREEDY_SHRINK)
        return r


def guarded_plan(cache: Any, lm: Any, preset: str, args: dict[str, Any], target: QualityTarget,
                 probe_tokens: int = PROBE_TOKENS, predicted_kl: float | None = None, verbose: bool = False) -> Any:
    """The plan of ``preset`` for ``cache`` at the step :func:`guarded_step` checks (``args['importance']``: the whole
    context's token importance, when the preset weighs tokens). Returns a :class:`~kvcodec.core.stage.Plan` whose
    ``params['check']`` records the probe, every try and the time the check cost."""
    from kvcodec.plan.pipelines import transform_plan

    args = dict(args)
    whole_importance = args.pop("importance", None)
    step0, record = guarded_step(cache, lm, preset, args, target, probe_tokens, predicted_kl, verbose)
    plan = transform_plan(cache, step0, lm=lm, preset=preset, importance=whole_importance,
                          **{k: v for k, v in args.items() if k != "step0"})
    plan.params["check"] = record
    return plan


def guarded_step(cache: Any, lm: Any, preset: str, args: dict[str, Any], target: QualityTarget,
                 probe_tokens: int = PROBE_TOKENS, predicted_kl: float | None = None,
                 verbose: bool = False) -> tuple[float, dict[str, Any]]:
    """The largest ``step0`` (from ``args['step0']`` down) at which the plan of ``preset`` (``args``: its settings with
    ``cal``) meets ``target`` on the probe, and the check's record: ``(step0, record)``. The caller builds the
    whole context's plan at that step, once (:func:`kvcodec.plan.ratecontrol.rate_controlled_plan`).

    ``predicted_kl`` is the rate model's prediction at ``args['step0']``: a first probe this far
    from it (:data:`OFF_RATIO`) is warned about. The record (``params['check']``) holds the probe, every try and
    the time the check cost; a pruned or short context is not checked (``checked: False``, the step unchanged).
    """
    from kvcodec.models.quality import continue_logits, first_near_tie, greedy_promise_met, greedy_with_margins, probe_terms
    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT, transform_plan
    from kvcodec.models.importance import cache_importance

    t_start = time.perf_counter()
    args = dict(args)
    step0 = float(args.pop("step0"))
    args.pop("importance", None)  # the whole context's: the tries plan the prefix with its own
    T = int(cache.num_tokens)
    n = min(probe_tokens, T // 4)
    if cache.positions is not None or n < MIN_PROBE_TOKENS:
        return step0, {"checked": False, "reason": "pruned cache or context under "
                       f"{4 * MIN_PROBE_TOKENS} tokens: encoded at the predicted step0 unchecked"}
    probe = np.asarray(cache.token_ids[T - n:], np.int64)
    prefix = cache_prefix(cache, T - n, lm)
    exact_logits = continue_logits(lm, prefix, probe)
    exact_greedy, margins = greedy_with_margins(lm, prefix, int(probe[0]), target.greedy_tokens) if target.greedy_tokens else ([], [])
    prefix_args = dict(args)
    if args.get("tokenscale") is not None:  # the prefix's own importance: its last queries, not the probe's
        window = {**TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"]
        prefix_args["importance"] = cache_importance(lm, prefix, window)
    tries: list[dict[str, Any]] = []
    ok = False
    off: float | None = None
    for i in range(MAX_TRIES):
        # the pipelines' own round trip on the prefix: no container, nothing stored
        dec, nbytes = roundtrip(prefix, transform_plan(prefix, step0, preset=preset, **prefix_args))
        same = True
        if target.greedy_tokens:
            got, _ = greedy_with_margins(lm, dec, int(probe[0]), target.greedy_tokens)
            same = greedy_promise_met(exact_greedy, got, margins, NEAR_TIE)
        s = ProbeStats(**probe_terms(exact_logits, continue_logits(lm, dec, probe), probe), greedy_ok=same)
        ok = s.meets(target)
        tries.append({"step0": step0, "probe_payload_bytes": nbytes, "kl_mean": s.kl, "top1": s.top1,
                      "dppl_percent": 100.0 * math.expm1(s.d_mean), "greedy_ok": same if target.greedy_tokens else None,
                      "rival_gain": s.rival_gain, "ok": ok})
        if i == 0 and predicted_kl and s.kl > 0 and not 1 / OFF_RATIO <= s.kl / predicted_kl <= OFF_RATIO:
            off = s.kl / predicted_kl
            log.warning(f"preset {preset}: the rate model predicted KL {predicted_kl:.3g} at step0 {step0:.3g}, the probe "
                        f"measured {s.kl:.3g} ({off:.2g}x); using the measured step")
        if verbose:
            print(f"check {preset}: step0={step0:.4g} probe payload bytes={nbytes} kl={s.kl:.3g} top1={s.top1:.3f} "
                  f"dppl={tries[-1]['dppl_percent']:+.3f}% greedy={same} rival={s.rival_gain:.3g} ok={ok}", flush=True)
        if ok or i == MAX_TRIES - 1:
            break
        if i and s.kl > FLOOR_KL_RATIO * tries[-2]["kl_mean"]:  # the format's quality floor: smaller steps buy nothing
            step0 = tries[-2]["step0"]
            tries[-1]["floor"] = True
            break
        step0 *= min(SAFETY * s.step_factor(target), SAFETY)
    if not ok:
        log.warning(f"preset {preset}: no step0 down to {tries[-1]['step0']:.3g} met its quality target on the context's last "
                    f"{n} tokens (KL <= {CHECK_MARGIN * target.kl:g}, top-1 >= {target.top1:g}"
                    f"{', greedy tokens up to the first near-tie' if target.greedy_tokens else ''}"
                    f"{f', logit gain of a rival token <= {target.rival_gain:g}' if target.rival_gain else ''}); "
                    f"encoded at step0 {step0:.3g}")
    return step0, {"checked": True, "met": ok, "target": asdict(target), "probe_tokens": n,
                   "near_tie_at": first_near_tie(margins, NEAR_TIE) if target.greedy_tokens else None,
                   "predictor_off": off, "tries": tries, "check_s": round(time.perf_counter() - t_start, 3)}
