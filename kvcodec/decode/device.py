"""Which device decodes: the CPU or the GPU (CUDA, or Triton's interpreter on the CPU), and whether it is usable.

Why a module of its own: the decoder registry (:mod:`kvcodec.decode.registry`) loads the Triton backends by
name, and those backends need the device (the torch device they write to, whether the interpreter runs). Kept in
the registry, that was an import circle import-linter could not see (issue 56); here, both import this and it
imports neither.
"""

from __future__ import annotations

import os
from typing import Any, Literal

from kvcodec.errors import KvcBackendError, KvcInputError

__all__ = ["DEVICES", "Device", "ENV_VAR", "NO_DEVICE_MSG", "gpu_device", "interpret_mode", "resolve_device"]

Device = Literal["cpu", "gpu"]
#: What a caller may ask for: a device, or "auto" (the GPU iff CUDA and Triton are present).
DEVICES = ("cpu", "gpu", "auto")
ENV_VAR = "KVCODEC_BACKEND"
NO_DEVICE_MSG = "no CUDA device; set TRITON_INTERPRET=1 to run the kernels on the CPU"



def interpret_mode() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "yes", "on")


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def resolve_device(device: str | None = None) -> Device:
    """``"cpu"`` or ``"gpu"`` from the argument, then $KVCODEC_BACKEND, then auto."""
    if device is not None and not isinstance(device, str):  # backend=3 escaped as AttributeError
        raise KvcInputError(f"backend must be one of {', '.join(DEVICES)}, got {type(device).__name__}")
    b = device or os.environ.get(ENV_VAR) or "auto"
    b = b.strip().lower()
    if b not in DEVICES:
        raise KvcInputError(f"unknown backend {b!r} (choose from {', '.join(DEVICES)})")
    if b == "cpu":
        return "cpu"
    if b == "auto":
        return "gpu" if _cuda_available() and _triton_importable() else "cpu"
    gpu_device()  # raises KvcBackendError when unusable
    return "gpu"


def gpu_device() -> Any:
    """The torch device the GPU backend runs on: ``cuda`` or, under the interpreter, ``cpu``."""
    import torch

    if not _triton_importable():
        raise KvcBackendError("backend 'gpu' needs Triton, which is not installed (pip install kvcodec[gpu])")
    if interpret_mode():
        return torch.device("cpu")
    if not _cuda_available():
        raise KvcBackendError(NO_DEVICE_MSG)
    return torch.device("cuda", torch.cuda.current_device())
