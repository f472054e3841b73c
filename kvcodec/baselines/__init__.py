"""Reimplemented baselines (fp16, fp16+zstd, int8, KIVI, CacheGen-as-shipped) as real `.kvc` encoders.

Importing this package registers the ``bl_*`` stages, which a reader needs to
decode a baseline file.
"""

from . import stages  # noqa: F401  (registers the bl_* stages)
from .plans import BASELINES, get_baseline_plan

__all__ = ["BASELINES", "get_baseline_plan"]
