"""The one place every chunk is decoded: the device switch and the error contract.

``backend`` is ``"cpu"``, ``"gpu"`` or ``"auto"`` (argument, then
``$KVCODEC_BACKEND``, then ``"auto"``); the rules live in
:func:`kvcodec.decode.triton.backend.resolve_backend` (``"auto"`` picks the GPU only
with CUDA and Triton; ``"gpu"`` without either is a :class:`KvcBackendError`,
except under ``TRITON_INTERPRET=1``, where the real kernels run on CPU
tensors). Which implementation decodes a chunk on that device is the decoder
registry's choice (:mod:`kvcodec.decode.registry`). The GPU path must return exactly
what the CPU path returns.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.decode.registry import decode_with
from kvcodec.errors import KvcCodecError, KvcError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ChunkContext, EncoderInputs, Pipeline, SideData

BACKENDS = ("cpu", "gpu", "auto")


def resolve_backend(backend: str | None) -> str:
    """Map None/"auto"/"cpu"/"gpu" to the concrete device used ("cpu" or "gpu")."""
    import importlib

    # by name (the GPU package is a plugin of the container, like the stages); imports no Triton
    resolve: Any = importlib.import_module("kvcodec.decode.triton.backend").resolve_backend
    return str(resolve(backend))


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
    device = resolve_backend(backend)
    try:
        out = decode_with(pipeline, payload, sides, sizes, spec, ctx, device="gpu" if device == "gpu" else "cpu")
    except KvcFormatError as exc:
        raise type(exc)(f"{where}: {exc}") from exc
    except KvcCodecError as exc:  # a stage refusing what the file asks of it: the file is at fault
        raise KvcFormatError(f"{where}: {exc}") from exc
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
    encoder: EncoderInputs | None = None,
) -> ChunkContext:
    """The ChunkContext a chunk is encoded and decoded with (writer and reader must agree).

    ``positions`` are the original positions of the chunk's tokens: shape
    (tokens,) when the file's positions are per token (or absent: then
    ``arange(token_start, token_end)``), shape (heads, tokens) when they are
    per (layer, head). ``encoder`` is the tensor's encoder-only inputs (writer only).
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
        encoder=encoder if encoder is not None else {},
    )
