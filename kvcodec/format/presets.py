"""Preset name -> encoding plan; the ONE place preset names are looked up.

``lossless`` (raw -> shuffle -> zstd), ``zstd`` (raw -> zstd) and ``raw`` are
built in; every other name is delegated to
``kvcodec.quant.presets.get_plan(name, cache, **kw)`` when that module exists.
"""

from __future__ import annotations

import importlib
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
    try:
        mod = importlib.import_module("kvcodec.quant.presets")
    except ModuleNotFoundError as exc:
        if exc.name not in ("kvcodec.quant.presets", "kvcodec.quant"):
            raise
        raise KvcInputError(f"unknown preset {name!r} (available: {', '.join(BUILTIN_PRESETS)})") from None
    plan = mod.get_plan(name, cache, **kw)
    return Plan(plan.pipelines, dict(getattr(plan, "attachments", None) or {}), getattr(plan, "preset", name))


def available_presets() -> list[str]:
    names = list(BUILTIN_PRESETS)
    try:
        mod = importlib.import_module("kvcodec.quant.presets")
        extra = getattr(mod, "PRESETS", None) or getattr(mod, "available_presets", lambda: [])()
        names += [n for n in extra if n not in names]
    except Exception:  # the lossy presets are optional here
        pass
    return names



def default_attachment_resolver() -> Any:
    """The resolver for external attachments the lossy presets reference (per-model calibration)."""
    from ..quant.presets import attachment_resolver

    return attachment_resolver
