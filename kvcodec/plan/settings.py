"""The lossy presets' settings and promises: ``step0`` and friends per preset, and each preset's quality target.

The plans themselves are built by :func:`kvcodec.plan.presets.get_plan` (which validates overrides and
decides whether the quality guard runs) from :func:`kvcodec.plan.pipelines.transform_plan`.
"""

from __future__ import annotations

from typing import Any

from kvcodec.plan.check import NEAR_TIE, QualityTarget

# step0 of each preset (in units of the cache's values; SmolLM2-135M-tuned by
# bench_codec.py measurements, valid for any model because the per-layer steps
# are scaled by that model's measured sensitivities).
PRESETS: dict[str, dict[str, Any]] = {
    # 16-bit codes (quantize v2): 8-bit codes widen wide channels' steps, which floors near-lossless (issue 15)
    "near-lossless": {"step0": 0.004, "sink": 4, "group": 8, "max_bits": 16},
    # tokenscale (importance-weighted steps, needs the model at encode time; uniform steps without it)
    "balanced": {"step0": 0.33, "sink": 4, "group": 8, "tokenscale": {"max_log2": 2.0}},
    "small": {"step0": 0.8, "sink": 4, "group": 8, "tokenscale": {"max_log2": 3.0}},
}
# What each lossy preset promises on a continuation of the document (see kvcodec/plan/check.py). With the
# model at hand, get_plan checks every file against its preset's target and lowers step0 until it holds.
PRESET_TARGETS: dict[str, QualityTarget] = {
    "near-lossless": QualityTarget(kl=2e-4, dppl_percent=0.5, greedy_tokens=16, rival_gain=NEAR_TIE),
    "balanced": QualityTarget(kl=0.01, dppl_percent=1.0),
    "small": QualityTarget(kl=0.05, dppl_percent=2.5),
}
