"""Preset name -> encoding plan; the ONE place preset names are looked up.

``lossless`` (raw -> shuffle -> zstd), ``fp16`` (cast -> raw -> shuffle -> zstd),
``zstd`` (raw -> zstd) and ``raw`` are built in; the lossy presets
(near-lossless, balanced, small) come from ``kvcodec.quant.presets``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ..errors import KvcInputError
from ..kvcache import KVCache
from ..stages import Pipeline
from .lossless import fp16_pipeline, lossless_pipeline, raw_pipeline

BUILTIN_PRESETS = ("lossless", "fp16", "zstd", "raw")


@dataclass
class Plan:
    pipelines: Pipeline | Callable[[int, str], Pipeline]
    attachments: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None


def _dtype(cache: KVCache) -> str:
    return str(cache.dtype).removeprefix("torch.")


def get_plan(name: str, cache: KVCache, **kw: Any) -> Plan:
    """The pipelines and attachments a preset uses for ``cache``."""
    if name == "lossless":
        return Plan(lossless_pipeline(_dtype(cache), level=kw.get("level", 3)), {}, name)
    if name == "fp16":
        if _dtype(cache) == "bfloat16":
            raise KvcInputError("preset 'fp16' would change a bfloat16 cache's range; use 'lossless'")
        return Plan(fp16_pipeline(level=kw.get("level", 3)), {}, name)
    if name == "zstd":
        return Plan(lossless_pipeline(_dtype(cache), level=kw.get("level", 3), shuffle=False), {}, name)
    if name == "raw":
        return Plan(raw_pipeline(_dtype(cache)), {}, name)
    from ..quant import presets as lossy  # imported lazily: it pulls in the codec stages

    if name not in lossy.PRESETS:
        raise KvcInputError(f"unknown preset {name!r} (available: {', '.join(available_presets())})")
    plan = lossy.get_plan(name, cache, **kw)
    return Plan(plan.pipelines, dict(plan.attachments), plan.preset)


def available_presets() -> list[str]:
    from ..quant.presets import PRESETS

    return list(BUILTIN_PRESETS) + [n for n in PRESETS if n not in BUILTIN_PRESETS]


def default_attachment_resolver() -> Any:
    """The resolver for external attachments the lossy presets reference (per-model calibration)."""
    from ..quant.presets import attachment_resolver

    return attachment_resolver
