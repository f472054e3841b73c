"""The ONE decoder registry: every implementation of chunk decoding, what it supports, and the pick.

Why: lossy decode exists as the numpy reference (the stages' own ``decode``, the definition of
the codec), a fused numba kernel, Triton per-stage kernels and a fused Triton kernel. They used
to be chosen by code that returned ``None`` to mean "try something else", so a broken fast path
showed up only as a slowdown. Here each backend declares statically what it supports (chain
shape, head_dim, dtype -- its ``supports(pipeline, spec)`` -- and its device) and
:func:`select` picks the fastest eligible one, like zarr's codec-pipeline selection.

When a backend that applies fails on a chunk, the device's reference decodes the chunk: if the
reference fails too, the file is at fault and the reference's (the spec's) error is raised; if
the reference succeeds, the backend has a bug -- it raises :class:`KvcBackendError` when
``KVCODEC_STRICT_BACKENDS=1`` (tests/conftest.py sets it) and warns once otherwise, returning
the reference's result. There is no silent fallback.

Each backend is a :class:`Backend` in the decoder group of the one plugin registry
(:mod:`kvcodec.registry`, :data:`DECODERS`): kvcodec's own four below, and any installed package's
``kvcodec.decoders`` entry points. A Backend names its implementation's module by string, imported
when first used, so this registry (imported by the container reader) pulls in neither numba kernels
nor Triton until a chunk needs them.
"""

from __future__ import annotations

import importlib
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from kvcodec.errors import KvcBackendError, KvcCodecError, KvcError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline, SideData
from kvcodec.decode.device import Device, resolve_device
from kvcodec.registry import DECODERS_GROUP, Registry, generation

__all__ = ["DECODERS", "Backend", "STRICT_ENV", "backend", "backends", "decode_chunk", "decode_chunk_gpu", "decode_with", "select", "strict", "decode_into",
           "store_paged", "warm_cpu"]

STRICT_ENV = "KVCODEC_STRICT_BACKENDS"


@dataclass(frozen=True)
class Backend:
    """One decoder implementation.

    ``module`` provides ``supports_fn(pipeline, spec) -> bool`` (static: stage types/configs,
    shapes, dtypes) and ``decode_fn(pipeline, payload, sides, sizes, spec, ctx)``. ``rank``
    orders eligible backends of a device (higher = faster). ``reference`` marks the device's
    definition: it supports every pipeline and is what the others are checked against.
    """

    name: str
    device: Device
    rank: int
    module: str
    supports_fn: str
    decode_fn: str
    reference: bool = False
    summary: str = ""

    def _fn(self, attr: str) -> Callable[..., Any]:
        fn: Callable[..., Any] = getattr(importlib.import_module(self.module), attr)
        return fn

    def supports(self, pipeline: Pipeline, spec: ArraySpec) -> bool:
        return bool(self._fn(self.supports_fn)(pipeline, spec))

    def decode(self, pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
               ctx: ChunkContext, trace: list[str] | None = None) -> Any:
        """Decode one chunk; GPU backends also record their path in ``trace`` (kernel kind, CPU-run stages)."""
        fn = self._fn(self.decode_fn)
        if trace is not None and self.device == "gpu":
            return fn(pipeline, payload, sides, sizes, spec, ctx, trace=trace)
        return fn(pipeline, payload, sides, sizes, spec, ctx)


REFERENCE = Backend("reference", "cpu", 0, "kvcodec.decode.registry", "_supports_all", "_reference_decode", reference=True,
                    summary="every pipeline: each stage's numpy decode (the codec's definition, spec/codec-v1.md)")
NUMBA_FUSED = Backend("numba-fused", "cpu", 10, "kvcodec.decode.cpu.fused", "supports", "decode",
                      summary="raw[-shuffle]-zstd, and [rope] [keep] transform [tokenscale] quantize(step, v1/v2) rans with "
                              "head_dim 32/64/80/96/128/256, rANS groups 1/2/4/8/16k; float16/float32 chunks")
TRITON_STAGES = Backend("triton-stages", "gpu", 0, "kvcodec.decode.triton.backend", "supports_stages", "decode_stages",
                        reference=True,
                        summary="every pipeline: rANS kernel, per-stage Triton kernels, CPU for stages without one")
TRITON_FUSED = Backend("triton-fused", "gpu", 10, "kvcodec.decode.triton.backend", "supports_fused", "decode_fused",
                       summary="[rope] [keep] transform [tokenscale] quantize(step, v1) rans, float16/float32 chunks: one kernel")


def _check_backend(name: str, obj: Any, builtin: bool) -> str | None:
    """What the decoder group holds: a Backend called ``name``; only kvcodec's own may be a device's reference."""
    if not isinstance(obj, Backend):
        return f"is a {type(obj).__name__}, not a kvcodec.decode.registry.Backend"
    if obj.name != name:
        return f"is the backend {obj.name!r}, not {name!r}"
    if obj.device not in ("cpu", "gpu") or not isinstance(obj.rank, int) or isinstance(obj.rank, bool):
        return f"declares device {obj.device!r} and rank {obj.rank!r} (want 'cpu' or 'gpu' and an int)"
    if obj.reference and not builtin:
        return "claims to be a device's reference decoder (only kvcodec's own are)"
    return None


# The decoder group of the one plugin registry (kvcodec/registry.py): kvcodec's four above are declared in
# kvcodec/plugins.py, an installed package's through its "kvcodec.decoders" entry points (each a Backend).
DECODERS: Registry[Backend] = Registry(DECODERS_GROUP, "decoder backend", KvcBackendError, _check_backend)
_listing: tuple[int, tuple[Backend, ...]] = (-1, ())


def backends() -> tuple[Backend, ...]:
    """Every decoder backend: kvcodec's, then installed plugins' (one that fails to load is skipped with a warning).

    Loads the Backend descriptions only; each implementation's module is imported when it first decodes or checks a
    chunk. Read once per change of the registry (:func:`kvcodec.registry.generation`)."""
    global _listing
    gen = generation()
    if _listing[0] != gen:
        _listing = (gen, tuple(DECODERS.load_all().values()))
    return _listing[1]


def _supports_all(pipeline: Pipeline, spec: ArraySpec) -> bool:
    return True


def _reference_decode(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
                      ctx: ChunkContext) -> Any:
    return pipeline.decode(payload, sides, sizes, spec, ctx)


def backend(name: str) -> Backend:
    """The registered backend called ``name`` (KvcBackendError: unknown, or a plugin that fails to load)."""
    return DECODERS.get(name)


def select(pipeline: Pipeline, spec: ArraySpec, device: Device = "cpu") -> list[Backend]:
    """The backends of ``device`` that support this pipeline and chunk spec, fastest first (the reference last).

    Memoised on the pipeline object (its stages never change once built; the reader shares one
    instance per distinct pipeline), so a file's chunks pay the static checks once per shape.
    """
    memo: dict[tuple, list[Backend]] = pipeline.__dict__.setdefault("_backend_choice", {})
    key = (spec.shape, spec.dtype, device, generation())
    hit = memo.get(key)
    if hit is not None:
        return hit
    eligible = [b for b in backends() if b.device == device and (b.reference or b.supports(pipeline, spec))]
    if not any(b.reference for b in eligible):
        raise KvcBackendError(f"no decoder backend for device {device!r}")
    chosen = sorted(eligible, key=lambda b: (b.reference, -b.rank))  # the reference decides failures: always last
    if len(memo) < 64:
        memo[key] = chosen
    return chosen


def strict() -> bool:
    """True when a failing backend must raise (``KVCODEC_STRICT_BACKENDS=1``, set by the test suite)."""
    return os.environ.get(STRICT_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def decode_with(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
                ctx: ChunkContext, device: Device = "cpu", trace: list[str] | None = None) -> Any:
    """Decode one chunk with the fastest eligible backend of ``device`` (numpy array on cpu, torch tensor on gpu).

    ``trace``, when given, receives the name of the backend whose result is returned.
    """
    chosen = select(pipeline, spec, device)
    first = chosen[0]
    if first.reference:
        out = first.decode(pipeline, payload, sides, sizes, spec, ctx, trace)
        if trace is not None:
            trace.append(first.name)
        return out
    try:
        out = first.decode(pipeline, payload, sides, sizes, spec, ctx, trace)
        if trace is not None:
            trace.append(first.name)
        return out
    except Exception as exc:  # judged below against the reference: the file's fault, or this backend's
        failure = exc
    ref = chosen[-1]
    out = ref.decode(pipeline, payload, sides, sizes, spec, ctx, trace)  # raises the spec's error for a bad chunk
    why = f"{type(failure).__name__}: {failure}" if not isinstance(failure, KvcError) else str(failure)
    if strict():
        raise KvcBackendError(f"decoder backend {first.name!r} failed on a chunk that {ref.name!r} decodes: {why}") from failure
    warnings.warn(f"kvcodec: decoder backend {first.name!r} failed on a chunk that {ref.name!r} decodes; using "
                  f"{ref.name!r} (slower). Please report it; KVCODEC_STRICT_BACKENDS=1 raises instead.",
                  RuntimeWarning, stacklevel=2)
    if trace is not None:
        trace.append(ref.name)
    return out



def decode_chunk_gpu(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
                     ctx: ChunkContext, trace: list[str] | None = None) -> Any:
    """GPU twin of ``Pipeline.decode`` (same checks, same errors, same bits): :func:`decode_with` on the GPU.

    Returns a torch tensor of ``spec.shape`` / ``spec.dtype`` on the GPU device. ``trace``, when
    given, receives the backend that ran and the names of stages that ran on the CPU. (It lived in the
    Triton backend, which imported this registry back for it: the registry loads that backend by name.)
    """
    return decode_with(pipeline, payload, sides, sizes, spec, ctx, device="gpu", trace=trace)

def decode_chunk(
    pipeline: Pipeline,
    payload: bytes | memoryview,
    sides: list[SideData],
    sizes: list[int],
    spec: ArraySpec,
    ctx: ChunkContext,
    device: str | None = "cpu",
) -> Any:
    """Decode one chunk payload to an array of exactly ``spec`` on ``device``: a numpy array on the CPU, a
    torch tensor on the GPU (never copied to the host).

    Any failure inside a codec stage on (CRC-valid but) malformed data becomes
    a :class:`KvcFormatError` naming the chunk; the original exception is chained.
    """
    where = f"chunk {ctx.extra.get('chunk', '?')} (layer {ctx.layer} {ctx.kind.upper()})"
    try:
        out = decode_with(pipeline, payload, sides, sizes, spec, ctx, device=resolve_device(device))
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


def _warm_pipelines() -> list[tuple[list[dict[str, Any]], str]]:
    """One pipeline per CPU decode path a file can take: lossless float16/float32 (shuffled); lossy float16 with
    quantize v1 and v2, keys (RoPE) and values (none); lossy float32; rans v2 (today's lossy files) and v1 (files
    written before 2026-11-28). Kept rows and tokenscale included: numba keys its machine code on the argument
    types, so each of these loads a signature real files use."""
    def lossless(es: int) -> list[dict[str, Any]]:
        return [{"name": "raw", "version": 1, "config": {}},
                {"name": "shuffle", "version": 1, "config": {"elementsize": es}},
                {"name": "zstd", "version": 1, "config": {"level": 3}}]

    def lossy(qv: int, dtype: str, rope: bool = True, rv: int = 2) -> list[dict[str, Any]]:
        q = {"mode": "step", "step": 0.5, "max_bits": 8} if qv == 1 else {"step": 0.5, "max_bits": 12}
        return ([{"name": "rope", "version": 1, "config": {"theta": 10000.0, "dim": 64}}] if rope else []) + [
                {"name": "keep", "version": 1, "config": {"sink": 1, "recent": 0, "dtype": dtype}},
                {"name": "transform", "version": 1, "config": {"basis": "hadamard", "k": 64}},
                {"name": "tokenscale", "version": 1, "config": {"bits": 4}},
                {"name": "quantize", "version": qv, "config": q},
                {"name": "rans", "version": rv, "config": {"channel_group": 8, **({"block_tokens": 32} if rv == 2 else {})}}]

    return [(lossless(2), "float16"), (lossless(4), "float32"), (lossy(1, "float16"), "float16"),
            (lossy(1, "float16", rope=False), "float16"), (lossy(2, "float16"), "float16"),
            (lossy(1, "float32"), "float32"), (lossy(1, "float16", rv=1), "float16")]


def warm_cpu() -> None:
    """Decode one tiny chunk (encoded here, from a fixed seed) along each CPU decode path, once per process.

    Why: a process's first decode pays for importing the codec stages and for numba loading its cached kernels
    (its registries, then each argument signature's machine code): ~0.3-0.5 s, whatever the chunk's size. A
    service worker that met its first put cold answered that put 0.4 s late, which alone set the honest clients'
    p99 under load (issue 35). Calling this before a process takes work moves that cost to its start. It needs
    no model, calibration or file on disk; a mismatch against the reference is raised like any backend bug."""
    import numpy as np

    from kvcodec.core.stage import chunk_context

    g = np.random.default_rng(0)
    for stages, dtype in _warm_pipelines():
        pipeline = Pipeline.from_json(stages)
        spec = ArraySpec((2, 8, 64), dtype)
        ctx = chunk_context(0, "k", 0, 8, 0, 2, None, {}, 0)
        payload, sides, sizes = pipeline.encode(g.standard_normal(spec.shape).astype(dtype), ctx)
        got = decode_chunk(pipeline, payload, sides, sizes, spec, ctx, device="cpu")
        if not np.array_equal(np.asarray(got).view(np.uint8), pipeline.decode(payload, sides, sizes, spec, ctx).view(np.uint8)):
            raise KvcBackendError(f"the CPU decoder differs from the reference on the warm-up chunk of {stages[-2]['name']} "
                                  f"{dtype}")


# --------------------------------------------------------------------------- engine layouts (GPU)
def decode_into(pipeline: Pipeline, payload: Any, sides: list[SideData], sizes: list[int], spec: ArraySpec,
                ctx: ChunkContext, dst: Any, token_start: int = 0, block_table: Any = None) -> None:
    """Decode a chunk on the GPU straight into an engine's KV tensor: an HF per-layer tensor, or with
    ``block_table`` paged blocks (``kvcodec.decode.triton.backend.decode_chunk_into``, loaded by name like
    every implementation here, so a CPU-only install never imports Triton)."""
    importlib.import_module("kvcodec.decode.triton.backend").decode_chunk_into(
        pipeline, payload, sides, sizes, spec, ctx, dst=dst, token_start=token_start, block_table=block_table)


def store_paged(x: Any, dst: Any, block_table: Any, token_start: int) -> None:
    """Store a decoded GPU tensor ``x`` (heads, tokens, head_dim) into paged blocks from ``token_start`` on
    (``kvcodec.decode.triton.dequant_kernels.store_paged``, loaded by name)."""
    importlib.import_module("kvcodec.decode.triton.dequant_kernels").store_paged(x, dst, block_table, token_start)
