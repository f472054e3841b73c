"""The one place every chunk is decoded, and the backend switch.

``backend`` is ``"cpu"``, ``"gpu"`` or ``"auto"`` (default: ``$KVCODEC_BACKEND``,
else ``"auto"``). ``"auto"`` picks the GPU only when CUDA is available *and*
a GPU decoder has been registered with :func:`register_gpu_decoder`; ``"gpu"``
without one is a :class:`KvcBackendError`. A GPU decoder has the signature of
:func:`decode_chunk` minus ``backend`` and must return exactly what the CPU
path returns (bit for bit), as a numpy array or a torch tensor.
"""

from __future__ import annotations

import os
from typing import Any, Callable

import numpy as np

from ..errors import KvcBackendError, KvcError, KvcFormatError, KvcInputError
from ..stages import ArraySpec, ChunkContext, Pipeline, SideData

BACKENDS = ("cpu", "gpu", "auto")
GpuDecoder = Callable[[Pipeline, Any, list[SideData], list[int], ArraySpec, ChunkContext], Any]
_GPU_DECODER: GpuDecoder | None = None


def register_gpu_decoder(fn: GpuDecoder | None) -> None:
    """Install (or remove, with None) the GPU chunk decoder."""
    global _GPU_DECODER
    _GPU_DECODER = fn


def _cuda_available() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is a dependency
        return False


def resolve_backend(backend: str | None) -> str:
    """Map None/"auto"/"cpu"/"gpu" to the concrete backend used ("cpu" or "gpu")."""
    b = backend or os.environ.get("KVCODEC_BACKEND") or "auto"
    if b not in BACKENDS:
        raise KvcInputError(f"unknown backend {b!r} (choose from {', '.join(BACKENDS)})")
    if b == "cpu":
        return "cpu"
    if b == "auto":
        return "gpu" if _GPU_DECODER is not None and _cuda_available() else "cpu"
    if not _cuda_available():
        raise KvcBackendError("backend 'gpu' requested but no CUDA device is available (use --backend cpu)")
    try:
        import triton  # noqa: F401
    except ImportError:
        raise KvcBackendError("backend 'gpu' requested but Triton is not installed (pip install kvcodec[gpu])") from None
    if _GPU_DECODER is None:
        raise KvcBackendError("backend 'gpu' requested but no GPU decoder is registered in this build")
    return "gpu"


def decode_chunk(
    pipeline: Pipeline,
    payload: bytes | memoryview,
    sides: list[SideData],
    sizes: list[int],
    spec: ArraySpec,
    ctx: ChunkContext,
    backend: str | None = "cpu",
) -> np.ndarray:
    """Decode one chunk payload to an array of exactly ``spec``.

    Any failure inside a codec stage on (CRC-valid but) malformed data becomes
    a :class:`KvcFormatError` naming the chunk; the original exception is chained.
    """
    where = f"chunk {ctx.extra.get('chunk', '?')} (layer {ctx.layer} {ctx.kind.upper()})"
    b = resolve_backend(backend)
    try:
        if b == "gpu":
            assert _GPU_DECODER is not None
            out = _GPU_DECODER(pipeline, payload, sides, sizes, spec, ctx)
        else:
            out = pipeline.decode(payload, sides, sizes, spec, ctx)
    except KvcFormatError as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    except KvcError:
        raise
    except MemoryError:
        raise KvcFormatError(f"{where}: decoding needs more memory than is available") from None
    except Exception as exc:  # malformed side data reaching a stage must not surface as a random exception
        raise KvcFormatError(f"{where}: codec pipeline failed: {type(exc).__name__}: {exc}") from exc
    shape = tuple(out.shape)
    dtype = str(out.dtype).removeprefix("torch.")
    if shape != spec.shape or dtype != spec.dtype:
        raise KvcFormatError(f"{where}: pipeline produced {dtype}{shape}, expected {spec.dtype}{spec.shape}")
    return out


def chunk_context(
    layer: int, kind: str, token_start: int, token_end: int, head_start: int, head_end: int,
    positions: np.ndarray | None, attachments: dict[str, np.ndarray], chunk: int,
) -> ChunkContext:
    """The ChunkContext a chunk is encoded and decoded with (writer and reader must agree).

    ``positions`` are the original positions of the chunk's tokens: shape
    (tokens,) when the file's positions are per token (or absent: then
    ``arange(token_start, token_end)``), shape (heads, tokens) when they are
    per (layer, head).
    """
    if positions is None:
        pos = np.arange(token_start, token_end, dtype=np.int64)
    elif positions.ndim == 1:
        pos = positions[token_start:token_end]
    else:
        pos = positions[layer, head_start:head_end, token_start:token_end]
    return ChunkContext(
        layer=layer, kind=kind, token_start=token_start, positions=pos, attachments=attachments,
        extra={"chunk": chunk, "token_end": token_end, "head_start": head_start, "head_end": head_end},
    )
