"""The GPU chunk decoders (the ``triton-*`` implementations of :mod:`kvcodec.decode.registry`).

Which device decodes is the registry's choice (:func:`kvcodec.decode.device.resolve_device`).
:func:`kvcodec.decode.registry.decode_chunk_gpu` has the arguments of ``Pipeline.decode`` and returns a torch tensor (on the CUDA device, or a CPU tensor under the
interpreter) equal bit for bit to ``Pipeline.decode``. Stages:

* bytes->bytes stages (zstd, ...): always on the CPU (they run before the
  payload is shipped to the device; only the compressed bytes travel).
* ``rans``: :mod:`kvcodec.decode.triton.rans_kernel` (header validated on the host by
  the CPU's ``parse_header``; data errors flagged by the kernel).
* a transform-codec chain (``[rope] [keep] transform [tokenscale]
  quantize(step)``, :mod:`kvcodec.decode.chain`, every lossy preset): one fused
  kernel for all inverse stages, writing the chunk dtype or straight into an
  engine's layout (:func:`decode_chunk_into`);
* other pipelines, stage by stage: array->array stages with a GPU
  implementation in :data:`GPU_STAGES` (see :mod:`kvcodec.decode.triton.dequant_kernels`);
  every other stage falls back to its CPU implementation for that stage only
  (device -> host -> device).

This module imports neither Triton nor the kernels until a GPU decode runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.decode.device import gpu_device
from kvcodec.errors import KvcBackendError, KvcFormatError

def supports_fused(pipeline: Any, spec: Any) -> bool:
    """Whether the fused Triton kernel decodes ``pipeline`` at chunk spec ``spec`` (static: shape and dtypes only)."""
    from kvcodec.decode.chain import match_chain

    chain = match_chain(pipeline)  # quantize v2 (16-bit codes as byte planes): no fused kernel, stage by stage
    return len(spec.shape) == 3 and spec.dtype in ("float16", "float32") and chain is not None and chain.quantize.version == 1


def supports_stages(pipeline: Any, spec: Any) -> bool:
    """The stage-by-stage GPU decoder takes every pipeline (stages without a kernel run on the CPU)."""
    return True


def decode_fused(pipeline: Any, payload: Any, sides: Any, sizes: Any, spec: Any, ctx: Any,
                 trace: list[str] | None = None) -> Any:
    """The ``triton-fused`` backend: rANS kernel, then one kernel for all inverse stages of the chain."""
    return _decode(pipeline, payload, sides, sizes, spec, ctx, fused=True, trace=trace)


def decode_stages(pipeline: Any, payload: Any, sides: Any, sizes: Any, spec: Any, ctx: Any,
                  trace: list[str] | None = None) -> Any:
    """The ``triton-stages`` backend: each stage's kernel (or its CPU implementation) in turn."""
    return _decode(pipeline, payload, sides, sizes, spec, ctx, fused=False, trace=trace)


def decode_chunk_into(pipeline: Any, payload: bytes | memoryview, sides: list[dict[str, np.ndarray]], sizes: list[int],
                      spec: Any, ctx: Any, dst: Any, token_start: int = 0, block_table: Any = None,
                      trace: list[str] | None = None) -> None:
    """Decode a chunk on the GPU straight into an engine's KV tensor.

    ``dst``: an HF per-layer tensor (1, H, T_cap, D) (tokens from ``token_start``), or with
    ``block_table`` a paged cache (num_blocks, block_size, H, D) where token ``p`` goes to
    ``dst[block_table[p // block_size], p % block_size]``. Values are the chunk's decoded values
    (``Pipeline.decode``) cast to ``dst.dtype``. Transform-codec chunks are written by the fused
    kernel; other pipelines decode, then go through the layout writers.
    """
    out = _decode(pipeline, payload, sides, sizes, spec, ctx, fused=supports_fused(pipeline, spec), dst=dst,
                  token_start=token_start, block_table=block_table, trace=trace)
    if out is None:
        return
    from kvcodec.decode.triton.dequant_kernels import store_hf, store_paged

    if block_table is not None:
        store_paged(out, dst, block_table, token_start)
    else:
        store_hf(out, dst, token_start)


def _decode(pipeline: Any, payload: Any, sides: list[dict[str, np.ndarray]], sizes: list[int], spec: Any, ctx: Any,
            fused: bool, dst: Any = None, token_start: int = 0, block_table: Any = None,
            trace: list[str] | None = None) -> Any:
    """Decode on the GPU device, with the fused chain kernel (``fused``) or stage by stage. With ``dst``:
    write into it when the fused kernel runs and return None, else return the decoded tensor."""
    import torch

    from kvcodec.codecs.rans import RansBankStage, RansStage
    from kvcodec.decode.chain import match_chain
    from kvcodec.decode.triton.dequant_kernels import GPU_STAGES

    device = gpu_device()
    trace = trace if trace is not None else []

    n_arr = len(pipeline.array_stages)
    if len(sides) != len(pipeline.stages) or len(sizes) != len(pipeline.byte_stages):
        raise KvcFormatError("chunk side data does not match its codec pipeline")
    data = payload
    for s, size in zip(reversed(pipeline.byte_stages), reversed(sizes)):
        data = s.decode(data, size, ctx)
        if len(data) != size:
            raise KvcFormatError(f"codec {s.name!r} produced {len(data)} bytes, expected {size}")
    specs = pipeline.specs(spec)
    bs = pipeline.bytes_stage
    if isinstance(bs, RansStage):
        if sides[n_arr]:
            raise KvcFormatError(f"codec 'rans' has no side data, got {sorted(sides[n_arr])}")
        from kvcodec.decode.triton.rans_kernel import decode_stage

        x = decode_stage(np.frombuffer(data, np.uint8) if not isinstance(data, np.ndarray) else data, specs[-1].shape,
                         bs.channel_group, device, block_tokens=bs.block_tokens if isinstance(bs, RansBankStage) else None)
    else:
        trace.append(f"cpu:{bs.name}")
        x = torch.from_numpy(np.ascontiguousarray(bs.decode(data, sides[n_arr], specs[-1], ctx))).to(device)
    want = specs[-1]
    if tuple(x.shape) != want.shape or str(x.dtype).removeprefix("torch.") != want.dtype:
        raise KvcFormatError(f"codec {bs.name!r} returned {x.dtype}{tuple(x.shape)}, expected {want}")
    if fused:
        from kvcodec.decode.triton.dequant_kernels import fused_decode

        chain = match_chain(pipeline)
        if chain is None or not supports_fused(pipeline, spec):
            raise KvcBackendError("the fused GPU decoder does not support this pipeline")
        trace.append("fused")
        out = fused_decode(chain, x, sides, specs, spec, ctx, dst=dst, token_start=token_start, block_table=block_table)
        return None if dst is not None else out
    trace.append("stages")
    for i in reversed(range(n_arr)):
        st = pipeline.array_stages[i]
        fn = GPU_STAGES.get(st.name)
        out = fn(st, x, sides[i], specs[i], ctx) if fn is not None else NotImplemented
        if out is NotImplemented:  # no GPU implementation (or not for this config): CPU fallback
            trace.append(f"cpu:{st.name}")
            out = torch.from_numpy(np.ascontiguousarray(st.decode(x.cpu().numpy(), sides[i], specs[i], ctx))).to(device)
        x = out
    return x
