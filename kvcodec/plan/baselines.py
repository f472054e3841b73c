"""Reimplemented baselines (fp16, fp16+zstd, int8, KIVI, CacheGen-as-shipped) as real `.kvc` encoders.

Importing this module registers the ``bl_*`` stages, which a reader needs to
decode a baseline file.
"""

from kvcodec.codecs import baselines as _stages  # noqa: F401  (registers the bl_* stages)
from kvcodec.plan.baseline_plans import BASELINES, get_baseline_plan

__all__ = ["BASELINES", "get_baseline_plan"]
