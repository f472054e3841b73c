"""The dtype a model's onboarding runs its prefills in (issue 54: a new model usable within minutes).

A first ``kvc calibrate`` is forward passes: the calibration's captures and Fisher backward passes, the rate model's
prefills and continuations, the answer probe's greedy answers. In float32 they cost a 0.5B model 400-490 CPU-s on a
2-vCPU Xeon; on a CPU with native bfloat16 matrix units (AMX, AVX512-BF16) a prefill runs ~3.5x faster in bfloat16.

Not every pass may move to bfloat16. A continuation scored in bfloat16 carries a KL floor of ~1e-3 of its own
(SmolLM2, 1,024 tokens: 0.0042 where float32 measures 0.0020 at ``balanced``'s step, 0.0020 where it measures 8.3e-5 at
``faithful``'s), which a rate model fitted that way reads as the codec's: ``faithful``'s fitted constant came out 12x
float32's. A bfloat16 prefill's cache continued in float32 gives float32's KL to 12 % at ``balanced``, ``small`` and
``faithful`` on both shipped models (``near-lossless``'s ~3e-7: 2.4e-7 for 3.8e-7 on Gemma 3). So onboarding
uses this module's twin for what measures statistics or makes text (the calibration's captures and Fisher passes,
the rate fit's and probes' prefills and token importance, the chat factors' greedy answers), and the model itself
for every continuation a KL, an NLL or an answer is read from (BENCHMARKS.md, "Onboarding a new model").

:func:`onboard_model` hands out a bfloat16 twin of a float32 model when this CPU computes bfloat16 natively, and the
model itself otherwise. The twin keeps the model's fingerprint and layout: what it measures is filed under the model
the user runs. ``KVCODEC_ONBOARD_DTYPE`` (``auto``, ``float32``, ``bfloat16``) overrides the choice; a file records
the dtype it was measured in when that is not the model's own (:func:`compute_dtype_name`). The twin is a second copy
of the weights (peak RSS of a 0.5B model's first ``kvc calibrate``: 5.40 -> 6.41 GB), so a model whose twin would take
more than :data:`TWIN_MEMORY_SHARE` of the available memory onboards in its own dtype.
"""

from __future__ import annotations

import copy
import os
from typing import TYPE_CHECKING, Any

from kvcodec.errors import KvcInputError

if TYPE_CHECKING:
    from kvcodec.models.load import LoadedModel

ENV = "KVCODEC_ONBOARD_DTYPE"
CHOICES = ("auto", "float32", "bfloat16")
# the twin's weights may take at most this share of the memory the OS says is available (MemAvailable): onboarding a
# large model must not trade minutes of CPU for swapping or the OOM killer; past it, onboarding runs in float32
TWIN_MEMORY_SHARE = 0.5


def available_memory() -> int | None:
    """Bytes the OS says a new allocation can get without swapping (Linux ``MemAvailable``); None where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f.read(1 << 16).splitlines():
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX tiles or AVX512-BF16); elsewhere torch emulates it, slower
    than float32."""
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the probes: assume not
        return False


def onboard_dtype(model_dtype: str) -> str:
    """The dtype onboarding computes in for a model whose weights are ``model_dtype`` (module docstring)."""
    choice = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if choice not in CHOICES:
        raise KvcInputError(f"{ENV}={choice!r:.40}: expected one of {', '.join(CHOICES)}")
    if model_dtype != "float32":  # a half-precision model already computes in its own dtype
        return model_dtype
    if choice == "auto":
        return "bfloat16" if native_bf16() else "float32"
    return choice


def onboard_model(lm: LoadedModel) -> LoadedModel:
    """``lm`` itself, or a twin of it in :func:`onboard_dtype` (same tokenizer, fingerprint and layout; its own
    weights, so ``lm`` is never touched and another thread may keep using it)."""
    import torch

    from kvcodec.models.load import LoadedModel

    own = lm.weights_dtype
    want = onboard_dtype(own)
    if want == own or lm.onboard_of is not None:
        return lm
    dt = getattr(torch, want)
    src: Any = lm.model  # a transformers PreTrainedModel (LoadedModel types it as object)
    need = sum(p.numel() for p in src.parameters()) * torch.finfo(dt).bits // 8
    avail = available_memory()
    if avail is not None and need > TWIN_MEMORY_SHARE * avail:  # module docstring; the model's own dtype is exact
        return lm
    # parameters converted one by one (tied ones stay tied: deepcopy's memo maps each once); buffers such as RoPE's
    # inverse frequencies keep their float32, as transformers keeps them when it loads a model in bfloat16
    memo: dict[int, Any] = {id(p): torch.nn.Parameter(p.detach().to(dt), requires_grad=False)
                            for p in src.parameters()}
    model = copy.deepcopy(src, memo)
    model.eval()
    try:  # a family that adds a float32 buffer to its hidden states (XGLM's sinusoidal positions) meets its bfloat16
        with torch.inference_mode():  # layer norm's weights and cannot run: it onboards in its own dtype
            model(input_ids=torch.tensor([[1, 2]], device=next(model.parameters()).device), use_cache=False)
    except RuntimeError:
        return lm
    twin = LoadedModel(model=model, tokenizer=lm.tokenizer, name=lm.name, path=lm.path, onboard_of=lm)
    twin.__dict__["fingerprint"] = lm.fingerprint  # cached_property slots: the twin answers for lm
    twin.__dict__["layout"] = lm.layout
    return twin


def compute_dtype_name(lm: LoadedModel) -> str | None:
    """The dtype ``lm`` computes in when it is an onboarding twin (recorded in what it measures), else None."""
    return lm.weights_dtype if lm.onboard_of is not None else None
