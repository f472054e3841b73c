"""``transformers.cache_utils`` without hqq's import-time cost: the one way kvcodec imports it.

When the ``hqq`` package is installed (kvcodec[peers], for the real HQQ peer in
the curve), ``transformers.cache_utils`` imports ``hqq.core.quantize`` at import
time, and that module's class body calls ``torch.compile``, which imports
``torch._dynamo``. On this project's 2-core machine that was 11 s of a 26 s model
load (cProfile, issue 21), paid by every fresh process: ``kvc ask``, the demo's
cold time-to-first-token, every test subprocess. So the first import of
``cache_utils`` here hides hqq from transformers' availability check, restores
the check right after, and :func:`hqq_quantizer` binds hqq's quantizer into
``cache_utils`` when the HQQ peer first runs (kvcodec/eval/peers.py). Nothing else
in transformers' behaviour changes.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any

__all__ = ["cache_utils", "hqq_quantizer", "models"]


def _no_hqq(*args: Any, **kwargs: Any) -> bool:
    return False


def _import_without_hqq(name: str, modules: tuple[str, ...]) -> ModuleType:
    """Import ``name`` with transformers' ``is_hqq_available`` reporting False to the module bodies of
    ``modules`` (which bind the name from ``transformers.utils``), then give them the real check back."""
    import importlib

    mod = sys.modules.get(name)
    if mod is not None:
        return mod
    import transformers.utils as tu

    real = tu.is_hqq_available
    tu.is_hqq_available = _no_hqq
    try:
        mod = importlib.import_module(name)
    finally:
        tu.is_hqq_available = real
    for m in modules:
        if m in sys.modules and getattr(sys.modules[m], "is_hqq_available", None) is _no_hqq:
            sys.modules[m].is_hqq_available = real  # type: ignore[attr-defined]
    return mod


def cache_utils() -> ModuleType:
    """``transformers.cache_utils``, imported (once) with hqq hidden."""
    return _import_without_hqq("transformers.cache_utils", ("transformers.cache_utils",))


def models() -> None:
    """Import transformers' model-loading stack (``quantizers.auto`` imports the hqq quantizer) with hqq hidden.

    Loading an HQQ-*quantized* checkpoint is then unsupported (its quantizer lacks HQQLinear); kvcodec
    loads float checkpoints only.
    """
    cache_utils()
    _import_without_hqq("transformers.quantizers.auto", ("transformers.quantizers.quantizer_hqq",))


def hqq_quantizer() -> None:
    """Bind ``hqq.core.quantize.Quantizer`` as ``cache_utils.HQQQuantizer`` (what HQQQuantizedLayer uses)."""
    cu = cache_utils()
    if getattr(cu, "HQQQuantizer", None) is None:
        from hqq.core.quantize import Quantizer

        cu.HQQQuantizer = Quantizer  # type: ignore[attr-defined]
