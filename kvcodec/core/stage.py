"""The codec stage interface and registry (numcodecs / Zarr v3 style).

A tensor's pipeline is: zero or more array->array stages, exactly one
array->bytes stage, zero or more bytes->bytes stages. Each stage has a
``name``, an integer ``version`` and a JSON ``config``; the `.kvc` header
stores ``{"name", "version", "config"}`` for each stage and readers look the
class up in :data:`REGISTRY`, whose versions the module providing each name registers when the plugin
registry (:data:`STAGES`, :mod:`kvcodec.registry`) imports it. An unknown name or version is a
:class:`~kvcodec.errors.KvcCodecError` that names it.

Stages may emit *side data* (scales, zero points, kept-token indices ...):
small named numpy arrays that the container stores inside the chunk next to
the payload and hands back on decode. Side data names are namespaced by the
container per stage index, so two stages may both use ``"scale"``.

The CPU implementation is the definition of a stage. Faster decoders (the fused
numba decoder, the Triton kernels) are not subclasses: they are backends of the
decoder registry (:mod:`kvcodec.decode.registry`), which must match this reference bit
for bit (tests/conformance/test_backend_conformance.py). Stages are immutable configuration;
what only the encoder needs (token classes, ...) arrives in :attr:`ChunkContext.encoder`.
"""

from __future__ import annotations

import json
from abc import ABC, ABCMeta, abstractmethod
from collections.abc import Mapping
from dataclasses import FrozenInstanceError, dataclass, field
from types import ModuleType
from typing import Any, Callable, ClassVar, Literal, Union

import numpy as np

from kvcodec.digest import array_sha256
from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.registry import STAGES_GROUP, Registry

StageKind = Literal["array->array", "array->bytes", "bytes->bytes"]
SideData = dict[str, np.ndarray]
# Encoder-only inputs of one tensor's pipeline, keyed by stage name (e.g. ``"tokenscale"`` ->
# :class:`kvcodec.codecs.tokenscale.TokenClasses`). Not config: never in the file, absent on decode.
EncoderInputs = Mapping[str, Any]
EncoderInputsSpec = Callable[[int, str], EncoderInputs]


@dataclass(frozen=True)
class ArraySpec:
    """Shape and dtype of the array entering (or leaving) a stage."""

    shape: tuple[int, ...]
    dtype: str  # numpy dtype name, e.g. "float16", "uint8"

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def side_array(side: SideData, key: str, stage: str, shape: tuple[int, ...], dtype: str) -> np.ndarray:
    """Side data ``key`` of a chunk, checked to be exactly ``dtype`` with ``shape`` (KvcFormatError otherwise)."""
    a = side.get(key)
    if a is None:
        raise KvcFormatError(f"codec {stage!r}: side data {key!r} missing")
    a = np.asarray(a)
    if a.dtype != np.dtype(dtype) or tuple(a.shape) != tuple(shape):
        raise KvcFormatError(f"codec {stage!r}: side data {key!r} is {a.dtype}{tuple(a.shape)}, expected {dtype}{tuple(shape)}")
    return a


@dataclass
class ChunkContext:
    """What a stage may know about the chunk it codes, besides the data.

    ``layer`` and ``kind`` ("k" or "v") let stages pick per-layer settings;
    ``positions`` are the original token positions of the chunk's tokens (for
    RoPE); ``attachments`` are file-level blobs (e.g. calibration matrices)
    keyed by name, stored or external alike; ``encoder`` holds this tensor's
    encoder-only inputs (:data:`EncoderInputs`), handed in by the writer from the
    plan -- stages hold none themselves, so one stage object may encode any layer.
    """

    layer: int = 0
    kind: str = "k"
    token_start: int = 0
    positions: np.ndarray | None = None
    attachments: dict[str, np.ndarray] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    encoder: EncoderInputs = field(default_factory=dict)


class _FrozenAfterInit(ABCMeta):
    """Seals every stage once its ``__init__`` (the config validation) has run."""

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        obj = super().__call__(*args, **kwargs)
        object.__setattr__(obj, "_sealed", True)
        return obj


class Stage(ABC, metaclass=_FrozenAfterInit):
    """One step of a codec pipeline. Subclasses set name/version/kind.

    A stage is pure configuration, immutable once built (as zarr v3 codecs are frozen
    dataclasses): ``__init__`` validates the config and sets attributes, after which any
    assignment raises :class:`dataclasses.FrozenInstanceError`. Why: the writer stores one
    pipeline per distinct config and may encode several layers with one stage object, so
    per-layer encoder inputs travel in :attr:`ChunkContext.encoder`, never on the stage.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if self.__dict__.get("_sealed"):
            raise FrozenInstanceError(f"codec {self.name!r}: a stage is immutable configuration (cannot set {name!r})")
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        raise FrozenInstanceError(f"codec {self.name!r}: a stage is immutable configuration (cannot delete {name!r})")

    name: ClassVar[str]
    version: ClassVar[int] = 1
    kind: ClassVar[StageKind]

    def get_config(self) -> dict[str, Any]:
        """JSON-serialisable configuration; ``from_config`` must invert it."""
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Stage":
        try:
            return cls(**config)
        except TypeError as exc:
            raise KvcCodecError(f"codec {cls.name!r}: bad config {config!r}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "config": self.get_config()}

    def resolve_spec(self, spec: ArraySpec) -> ArraySpec:
        """Spec of the output given the input spec (array->array stages only)."""
        return spec

    def __repr__(self) -> str:
        return f"{type(self).__name__}({json.dumps(self.get_config(), sort_keys=True)})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Stage) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(json.dumps(self.to_json(), sort_keys=True))


class ArrayToArray(Stage):
    kind: ClassVar[StageKind] = "array->array"

    @abstractmethod
    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[np.ndarray, SideData]: ...

    @abstractmethod
    def decode(self, arr: np.ndarray, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        """Invert ``encode``; ``spec`` is this stage's *input* spec."""


class ArrayToBytes(Stage):
    kind: ClassVar[StageKind] = "array->bytes"

    @abstractmethod
    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]: ...

    @abstractmethod
    def decode(self, data: bytes | memoryview, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        """Rebuild an array of exactly ``spec``; raise KvcFormatError otherwise."""


class BytesToBytes(Stage):
    kind: ClassVar[StageKind] = "bytes->bytes"

    @abstractmethod
    def encode(self, data: bytes, ctx: ChunkContext) -> bytes: ...

    @abstractmethod
    def decode(self, data: bytes | memoryview, max_size: int, ctx: ChunkContext) -> bytes:
        """Invert ``encode``; never produce more than ``max_size`` bytes."""


REGISTRY: dict[tuple[str, int], type[Stage]] = {}  # every loaded stage version, (name, version) -> class


def _check_stage(name: str, obj: Any, builtin: bool) -> str | None:
    """What the stage group holds: a module that registers ``name`` on import, or a Stage subclass called ``name``."""
    if isinstance(obj, type) and issubclass(obj, Stage):
        if getattr(obj, "name", None) != name:
            return f"is the stage {getattr(obj, 'name', None)!r}, not {name!r}"
        try:
            register(obj)
        except KvcCodecError as exc:
            return f"cannot be registered: {exc}"
    elif not isinstance(obj, ModuleType):
        return f"is a {type(obj).__name__}, not a Stage subclass or a module that registers one"
    if not any(n == name for n, _ in REGISTRY):
        return f"registers no stage {name!r}"
    return None


# The stage group of the one plugin registry (kvcodec/registry.py): a reader meets stages by name in a file's header
# and the registry imports the module that provides the name then -- kvcodec's own are declared in kvcodec/plugins.py,
# any installed package's through its "kvcodec.stages" entry points -- so opening a lossless file does not import the
# lossy codec, and this interface module imports none of the modules that implement it.
STAGES: Registry[Any] = Registry(STAGES_GROUP, "codec", KvcCodecError, _check_stage)


def register(cls: type[Stage]) -> type[Stage]:
    """Class decorator adding a stage version to :data:`REGISTRY` under (name, version).

    The name must be one its module provides in the plugin registry (:data:`STAGES`): a module cannot add versions
    to a stage another module provides (a file's stages decode as their provider defines them)."""
    key = (cls.name, cls.version)
    if key in REGISTRY and REGISTRY[key] is not cls:
        raise KvcCodecError(f"codec {cls.name!r} v{cls.version} registered twice")
    if cls.name in STAGES.names(entry_points=False):
        owner = STAGES.target(cls.name).partition(":")[0]
        if owner != cls.__module__:
            raise KvcCodecError(f"codec {cls.name!r} is provided by {owner}; {cls.__module__}.{cls.__qualname__} "
                                "cannot register it")
    REGISTRY[key] = cls
    return cls


def stage_from_json(obj: Any) -> Stage:
    """Instantiate a stage from its header JSON; unknown codecs are named."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        raise KvcFormatError(f"codec entry must be an object with a name, got {obj!r:.200}")
    name, version, config = obj["name"], obj.get("version", 1), obj.get("config", {})
    if not isinstance(version, int) or isinstance(version, bool) or not isinstance(config, dict):
        raise KvcFormatError(f"codec {name!r}: version must be an int and config an object")
    cls = REGISTRY.get((name, version))
    if cls is None:
        if not STAGES.has(name):
            raise KvcCodecError(f"unknown codec {name!r} version {version} (known: {', '.join(STAGES.names())})")
        STAGES.get(name)  # imports its provider: KvcCodecError for one that is broken or declared twice
        cls = REGISTRY.get((name, version))
    if cls is None:
        known = ", ".join(f"v{v}" for n, v in sorted(REGISTRY) if n == name)
        raise KvcCodecError(f"unknown codec {name!r} version {version} (known: {name} {known})")
    return cls.from_config(config)


@dataclass
class Pipeline:
    """An ordered, validated list of stages for one tensor."""

    stages: list[Stage]

    def __post_init__(self) -> None:
        kinds = [s.kind for s in self.stages]
        n_ab = kinds.count("array->bytes")
        if n_ab != 1:
            raise KvcCodecError(f"a pipeline needs exactly one array->bytes stage, got {n_ab}")
        i = kinds.index("array->bytes")
        if any(k != "array->array" for k in kinds[:i]) or any(k != "bytes->bytes" for k in kinds[i + 1 :]):
            raise KvcCodecError(f"pipeline stages out of order: {kinds}")

    @classmethod
    def from_json(cls, objs: Any) -> "Pipeline":
        if not isinstance(objs, list):
            raise KvcFormatError("codec pipeline must be a list")
        return cls([stage_from_json(o) for o in objs])

    def to_json(self) -> list[dict[str, Any]]:
        return [s.to_json() for s in self.stages]

    @property
    def array_stages(self) -> list[ArrayToArray]:
        return [s for s in self.stages if isinstance(s, ArrayToArray)]

    @property
    def bytes_stage(self) -> ArrayToBytes:
        return next(s for s in self.stages if isinstance(s, ArrayToBytes))

    @property
    def byte_stages(self) -> list[BytesToBytes]:
        return [s for s in self.stages if isinstance(s, BytesToBytes)]

    def specs(self, spec: ArraySpec) -> list[ArraySpec]:
        """Input spec of every array->array stage plus that of the array->bytes stage."""
        out = [spec]
        for s in self.array_stages:
            out.append(s.resolve_spec(out[-1]))
        return out

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, list[SideData], list[int]]:
        """Run the pipeline. Returns (payload, side data per stage, size after each bytes stage).

        The last list holds the byte length entering each bytes->bytes stage,
        which the container records so decoding can cap every decompression.
        """
        sides: list[SideData] = []
        for s in self.array_stages:
            arr, side = s.encode(arr, ctx)
            sides.append(side)
        data, side = self.bytes_stage.encode(arr, ctx)
        sides.append(side)
        sizes: list[int] = []
        for b in self.byte_stages:
            sizes.append(len(data))
            data = b.encode(data, ctx)
            sides.append({})
        return data, sides, sizes

    def decode(
        self, data: bytes | memoryview, sides: list[SideData], sizes: list[int], spec: ArraySpec, ctx: ChunkContext
    ) -> np.ndarray:
        """Invert :meth:`encode` given the input spec of the whole pipeline."""
        n_arr = len(self.array_stages)
        if len(sides) != len(self.stages) or len(sizes) != len(self.byte_stages):
            raise KvcFormatError("chunk side data does not match its codec pipeline")
        for s, size in zip(reversed(self.byte_stages), reversed(sizes)):
            data = s.decode(data, size, ctx)
            if len(data) != size:
                raise KvcFormatError(f"codec {s.name!r} produced {len(data)} bytes, expected {size}")
        specs = self.specs(spec)
        arr = self.bytes_stage.decode(data, sides[n_arr], specs[-1], ctx)
        if tuple(arr.shape) != specs[-1].shape or arr.dtype != np.dtype(specs[-1].dtype):
            raise KvcFormatError(f"codec {self.bytes_stage.name!r} returned {arr.dtype}{arr.shape}, expected {specs[-1]}")
        for i in reversed(range(n_arr)):
            arr = self.array_stages[i].decode(arr, sides[i], specs[i], ctx)
        return arr


PipelineSpec = Union[Pipeline, Callable[[int, str], Pipeline]]

#: The pipeline table's limits (spec/kvc-v1.md): stages per pipeline and distinct pipelines per file. Here, not in
#: the container, because the round-trip probe (:mod:`kvcodec.core.roundtrip`) builds the same table with no container.
MAX_STAGES = 32
MAX_PIPELINES = 65535


@dataclass(frozen=True)
class ExternalAttachment:
    """A plan's attachment referenced by identity only; the reader resolves it by name / sha256.

    Here, beside :class:`Plan`, because a plan carries them (a calibration's bases) to the writer and to the
    round-trip probe alike."""

    sha256: str
    dtype: str
    shape: tuple[int, ...]
    # the array itself when the writer has it (never stored in the file): lets the writer read its output back
    array: np.ndarray | None = field(default=None, compare=False, repr=False)

    @classmethod
    def of(cls, arr: np.ndarray) -> "ExternalAttachment":
        arr = np.asarray(arr)
        return cls(array_sha256(arr), arr.dtype.name, tuple(int(d) for d in arr.shape), arr)


@dataclass
class Plan:
    """What the writer needs to encode one cache: the ONE plan type (built by :func:`kvcodec.plan.presets.get_plan`).

    ``pipelines`` is one pipeline for every tensor or a ``(layer, kind) -> Pipeline``
    function; ``attachments`` maps name -> array (stored in the file) or
    :class:`ExternalAttachment` (referenced by sha256);
    ``params`` records the plan's settings (written under ``meta["plan"]`` by callers
    that want them); ``chunk_tokens`` is a layout the plan requires (the baselines' KIVI
    window needs a whole tensor per chunk), None for the writer's default;
    ``encoder_inputs`` gives each (layer, kind) its encoder-only inputs (tokenscale's token
    classes), which the writer passes to that tensor's chunks in :attr:`ChunkContext.encoder`.
    """

    pipelines: PipelineSpec
    attachments: dict[str, Any] = field(default_factory=dict)
    preset: str | None = None
    params: dict[str, Any] = field(default_factory=dict)
    chunk_tokens: int | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    encoder_inputs: EncoderInputsSpec | None = None

    def pipeline(self, layer: int, kind: str) -> Pipeline:
        """The pipeline of one tensor, whichever form ``pipelines`` takes."""
        return self.pipelines if isinstance(self.pipelines, Pipeline) else self.pipelines(layer, kind)


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


def chunk_ranges(n: int, step: int | None) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``0..n`` in pieces of ``step`` (one piece when ``step`` is None or 0): the
    chunk grid the writer encodes and the round-trip probe measures, from one definition."""
    step = n if not step else step
    return [(a, min(a + step, n)) for a in range(0, n, step)]


def pipeline_table(pipelines: PipelineSpec, n_layers: int, *, max_stages: int,
                   max_pipelines: int) -> tuple[list[Pipeline], dict[tuple[int, str], int]]:
    """The header's pipeline table (one entry per distinct config) and each tensor's table index.

    Every tensor is encoded with its table entry, so layers with equal configs share stage
    objects: stages are immutable configuration and a tensor's encoder-only inputs come
    from ``WriteOptions.encoder_inputs`` (tests/codecs/test_quant_tokenscale.py checks that layers
    merged into one entry keep their own token classes). ``max_stages`` / ``max_pipelines`` are the container's
    limits (:data:`MAX_STAGES`, :data:`MAX_PIPELINES`: the writer and :mod:`kvcodec.core.roundtrip` pass them).
    """
    table: list[Pipeline] = []
    keys: dict[str, int] = {}
    ids: dict[tuple[int, str], int] = {}
    for layer in range(n_layers):
        for kind in ("k", "v"):
            p = pipelines(layer, kind) if callable(pipelines) and not isinstance(pipelines, Pipeline) else pipelines
            if not isinstance(p, Pipeline):
                raise KvcCodecError(f"pipeline for layer {layer} {kind.upper()} is a {type(p).__name__}, not a Pipeline")
            if len(p.stages) > max_stages:
                raise KvcCodecError(f"pipeline for layer {layer} has {len(p.stages)} stages (limit {max_stages})")
            key = json.dumps(p.to_json(), sort_keys=True)
            if key not in keys:
                keys[key] = len(table)
                table.append(p)
            ids[(layer, kind)] = keys[key]
    if len(table) > max_pipelines:
        raise KvcCodecError(f"{len(table)} distinct pipelines exceed the limit {max_pipelines}")
    return table, ids
