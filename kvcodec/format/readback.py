"""The writer's read-back check: what every chunk of a file being written must decode to, and what the decode cost
in error against the encoder's input.

Split from ``format/writer.py`` (one room per concern): the writer streams a cache into a container; this module
decides whether the container, read back through the reader as a user would read it, holds what was written.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import numpy as np
from numba import njit

from kvcodec.codecs.common import float32_copy
from kvcodec.core.dtypes import is_bf16
from kvcodec.core.stage import ArraySpec, Pipeline
from kvcodec.digest import array_sha256
from kvcodec.errors import KvcCodecError, KvcError, KvcFormatError
from kvcodec.format.container import crc32c

if TYPE_CHECKING:
    from kvcodec.core.kvcache import KVCache

LOSSY_BOUND = 2.0  # read-back: a lossy chunk decoded farther than this x its input's energy is corrupt (small zeroes whole low-sensitivity tensors: ~1)


@njit(cache=True, nogil=True, fastmath={"reassoc"})
def _energy_sums(o, x):  # pragma: no cover - numba
    """(sum (o-x)^2, sum x^2, max |o-x|, max |x|) in float64 over flat arrays, the sums reassociated so that LLVM
    vectorises them (the maxima do not vectorise: the pass costs ~5x the sums alone, still ~15x less than a decode).
    Non-finite inputs make a sum non-finite (and float64 sums of float32 squares cannot overflow), which sends
    :func:`_sums` to its float64 numpy form."""
    d2 = 0.0
    x2 = 0.0
    md = 0.0
    mx = 0.0
    for i in range(x.size):
        xi = np.float64(x[i])
        d = np.float64(o[i]) - xi
        d2 += d * d
        x2 += xi * xi
        md = max(md, abs(d))
        mx = max(mx, abs(xi))
    return d2, x2, md, mx


@dataclass
class ErrorSums:
    """What the read-back measured of one (layer, K/V)'s decoded values against the encoder's input, over its lossy
    chunks: the squared error and squared input summed (float64), their count, the largest error and value; a
    non-finite error (a finite input decoded to inf or NaN) makes ``d2`` inf.

    Why: an engine's chunk unlike the model's KV (a zeroed page, a constant fill) is decoded far from its input by a
    lossy preset (kvcodec.integrations.fidelity); these sums let that check read the read-back's own decode instead of
    decoding the file once more (1.26-1.30x the serde's encode CPU-s)."""

    d2: float = 0.0
    x2: float = 0.0
    n: int = 0
    max_err: float = 0.0
    max_x: float = 0.0

    def add(self, d2: float, x2: float, n: int, max_err: float, max_x: float) -> None:
        self.d2, self.x2, self.n = self.d2 + d2, self.x2 + x2, self.n + n
        self.max_err, self.max_x = max(self.max_err, max_err), max(self.max_x, max_x)

    @property
    def rms_err(self) -> float:
        return math.sqrt(self.d2 / self.n) if self.n else 0.0

    @property
    def rms_x(self) -> float:
        return math.sqrt(self.x2 / self.n) if self.n else 0.0


@dataclass
class ReadBackErrors:
    """Filled by the writer's read-back for its caller: ``read`` once the file was read back and passed, ``layers``
    the :class:`ErrorSums` of every (layer, ``"k"``/``"v"``) with array stages (lossless ``raw`` pipelines, decoded
    bit for bit, have none)."""

    read: bool = False
    layers: dict[tuple[int, str], ErrorSums] = field(default_factory=dict)


def _sums(out: np.ndarray, want: np.ndarray) -> tuple[float, float, float, float] | None:
    """``out`` against ``want`` (same shape, else None): (sum (o-x)^2, sum x^2, max |o-x|, max |x|) over ``want``'s
    finite values; inf for the error sum where ``out`` is not finite where ``want`` is, or differs where it is not.

    One vectorised numba pass over float32 copies (float16 -> float32 is exact, and :func:`float32_copy` makes them
    7-17x faster than numpy) when everything is finite; the float64 numpy form only when something is not (float32
    sums of squares overflow at |x| ~ 1e19). The numpy form everywhere was 13 % of a SmolLM2 2K `balanced` encode."""
    if out.shape != want.shape:
        return None
    if out.dtype.itemsize <= 4 and want.dtype.itemsize <= 4:
        d2, x2, md, mx = _energy_sums(float32_copy(out).reshape(-1), float32_copy(want).reshape(-1))
        if math.isfinite(d2) and math.isfinite(x2):
            return d2, x2, md, mx
    x, o = np.ravel(want).astype(np.float64), np.ravel(out).astype(np.float64)
    fin = np.isfinite(x)
    if not fin.all():
        if not np.array_equal(o[~fin], x[~fin], equal_nan=True):
            return math.inf, 0.0, math.inf, 0.0
        x, o = x[fin], o[fin]
    if not np.isfinite(o).all():
        return math.inf, float(x @ x), math.inf, float(np.abs(x).max(initial=0.0))
    d = o - x
    return float(d @ d), float(x @ x), float(np.abs(d).max(initial=0.0)), float(np.abs(x).max(initial=0.0))


def _near(out: np.ndarray, want: np.ndarray) -> bool:
    """``out`` has ``want``'s shape, is finite where ``want`` is (and equal where it is not), and lies within
    ``LOSSY_BOUND`` x ``want``'s energy of it, summed in float64 (:func:`_sums`)."""
    s = _sums(out, want)
    return s is not None and s[0] <= LOSSY_BOUND * s[1]


def _refuse_overflow(dec: np.ndarray, x: np.ndarray, ctx: Any) -> None:
    """One KvcCodecError line if a lossy chunk decodes a finite input value to inf or NaN.

    Why: the read-back accepts an out-of-distribution chunk far from its input when it equals the reference decode,
    which let a float16 cache with values near 65504 (a constant 60000 under ``balanced``) be written and decoded
    with inf in it: silently wrong KV. A lossy code's input is always finite (its codecs refuse NaN and inf)."""
    if dec.shape == x.shape and bool((np.isfinite(x) & ~np.isfinite(dec)).any()):
        raise KvcCodecError(f"layer {ctx.layer} {ctx.kind.upper()}: the lossy code decodes finite values to inf (values "
                            "too close to their dtype's maximum, float16's 65504, for this preset); use the lossless "
                            "preset for this cache")


class Expectation:
    """What each chunk of a file being written must decode to, for the read-back check.

    The read-back decodes the *file* once through the reader (container parsing, side-data round
    trip, the fused fast decoders: what a user gets) and checks every chunk against this:

    * a pipeline without array->array stages over ``raw`` (raw / shuffle / zstd: lossless by
      definition): the input itself, bit for bit (no copy is kept);
    * the first chunk of every lossy stage structure (e.g. balanced's K and V pipelines): the
      normative stage-by-stage ``Pipeline.decode`` of the encoder's own output, bit for bit (a
      CRC32C is kept), so a fused decoder that disagrees with the definition is caught on every file;
    * every other chunk of a pipeline with array stages: finite where its input is (non-finite inputs,
      which a cast keeps, decoded exactly), and no farther from the input than ``LOSSY_BOUND`` x the
      input's own energy (a coarse preset that zeroes a low-sensitivity tensor lands at ~1, below it);
      a chunk outside that bound (gross corruption, or a degenerate input such as an all-zero layer)
      must equal the reference decode exactly, so the bound is a fast path, never a loosening.

    Why not the reference decode of every chunk: it doubled the encoder's decode work (issue 33)
    to re-prove, file after file, a decoder property the conformance vectors prove once.

    Every chunk of a pipeline with array stages also adds its decoded error to ``errors`` (:class:`ErrorSums` per
    (layer, ``"k"``/``"v"``)), which the writer's callers may read once the check has passed.
    """

    def __init__(self, cache: KVCache) -> None:
        self.cache = cache
        self.checks: list[Callable[[np.ndarray], bool]] = []
        self.external: dict[str, np.ndarray] = {}
        self._tensor: tuple[tuple[int, str], np.ndarray] | None = None
        self._referenced: set[str] = set()  # lossy stage structures whose first chunk was reference-decoded
        self.errors: dict[tuple[int, str], ErrorSums] = {}

    def _measured(self, out: np.ndarray, layer: int, kind: str, rows: tuple[int, int, int, int]) -> bool:
        """Add ``out``'s error against its input (heads h0:h1, tokens t0:t1 of the layer) to :attr:`errors`; True
        when it lies within :data:`LOSSY_BOUND` of the input's energy (:func:`_near`)."""
        h0, h1, t0, t1 = rows
        off = self.cache.layer_offset(layer)
        s = _sums(out, self._input(layer, kind)[h0:h1, t0 - off:t1 - off, :])
        if s is None:
            return False
        self.errors.setdefault((layer, kind), ErrorSums()).add(s[0], s[1], int(out.size), s[2], s[3])
        return s[0] <= LOSSY_BOUND * s[1]

    def _input(self, layer: int, kind: str) -> np.ndarray:
        key = (layer, kind)
        if self._tensor is None or self._tensor[0] != key:
            t = (self.cache.keys if kind == "k" else self.cache.values)[layer].detach().cpu()
            self._tensor = (key, (t.float() if is_bf16(t) else t).contiguous().numpy())
        return self._tensor[1]

    def add(self, p: Pipeline, arr: np.ndarray, payload: bytes, sides: list, sizes: list[int], ctx: Any) -> None:
        from kvcodec.codecs.lossless import Raw

        if not p.array_stages and isinstance(p.bytes_stage, Raw):
            layer, kind, t0, h0 = ctx.layer, ctx.kind, ctx.token_start, ctx.extra["head_start"]
            t1, h1 = ctx.extra["token_end"], ctx.extra["head_end"]

            def same_as_input(out: np.ndarray) -> bool:
                off = self.cache.layer_offset(layer)
                want = self._input(layer, kind)[h0:h1, t0 - off:t1 - off, :]
                return out.shape == want.shape and out.dtype == want.dtype and np.array_equal(
                    np.ascontiguousarray(out).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))

            self.checks.append(same_as_input)
            return
        # the stage structure, not its parameters: every tensor of a lossy plan has its own steps
        structure = json.dumps([[st.name, st.version] for st in p.stages])
        if structure in self._referenced:
            layer, kind, t0, h0 = ctx.layer, ctx.kind, ctx.token_start, ctx.extra["head_start"]
            t1, h1 = ctx.extra["token_end"], ctx.extra["head_end"]
            spec = ArraySpec(tuple(arr.shape), arr.dtype.name)

            def close_to_input_or_reference(out: np.ndarray) -> bool:
                if self._measured(out, layer, kind, (h0, h1, t0, t1)):
                    return True
                off = self.cache.layer_offset(layer)
                x = self._input(layer, kind)[h0:h1, t0 - off:t1 - off, :]
                # outside the fast bound (degenerate or out-of-distribution input, e.g. an all-zero layer whose
                # error is the basis mean's rounding): the chunk must then equal the reference decode exactly
                try:
                    ref = np.ascontiguousarray(p.decode(payload, sides, sizes, spec, ctx))
                except KvcError:
                    return False
                _refuse_overflow(ref, x, ctx)
                out = np.ascontiguousarray(out)
                return out.shape == ref.shape and out.dtype == ref.dtype and np.array_equal(
                    out.view(np.uint8), ref.view(np.uint8))

            self.checks.append(close_to_input_or_reference)
            return
        self._referenced.add(structure)
        spec = ArraySpec(tuple(arr.shape), arr.dtype.name)
        try:
            expected = np.ascontiguousarray(p.decode(payload, sides, sizes, spec, ctx))
        except KvcError as exc:
            raise KvcCodecError(f"chunk {len(self.checks)} (layer {ctx.layer} {ctx.kind.upper()}): "
                                f"the encoder's output does not decode: {exc}") from None
        _refuse_overflow(expected, arr, ctx)
        want = (expected.shape, expected.dtype, crc32c(expected.view(np.uint8).data))
        rows = (ctx.extra["head_start"], ctx.extra["head_end"], ctx.token_start, ctx.extra["token_end"])

        def same_as_reference(out: np.ndarray, want: tuple = want, layer: int = ctx.layer, kind: str = ctx.kind) -> bool:
            out = np.ascontiguousarray(out)
            if not ((out.shape, out.dtype) == want[:2] and crc32c(out.view(np.uint8).data) == want[2]):
                return False
            self._measured(out, layer, kind, rows)  # its distance from the input is the reference's own: no bound
            return True

        self.checks.append(same_as_reference)

    def resolver(self) -> Callable[[str, Any], np.ndarray | None]:
        """Attachment resolver for the read-back: the arrays the encoder itself used, then the default resolver."""
        from kvcodec.calibration.store import default_resolver

        known: dict[str, np.ndarray] = dict(self.external)
        fallback = default_resolver

        def resolve(name: str, info: Any) -> np.ndarray | None:
            a = known.get(name)
            if a is not None and array_sha256(a) == info.sha256:
                return a
            return fallback(name, info) if fallback is not None else None

        return resolve

    def check(self, source: Any, cache: KVCache, what: str) -> None:
        """Read ``source`` back with :class:`KvcReader`: structure, every CRC, padding, blob and chunk, bit for bit."""
        from kvcodec.format.reader import KvcReader

        try:
            with KvcReader(source, self.resolver(), max_decoded_bytes=_declared_bytes(cache), max_decoded_ratio=0) as r:
                r.verify(strict=True, backend="cpu", expected=self.checks)
                pos = r.positions
                want = cache.positions
                if (pos is None) != (want is None) or (pos is not None and want is not None and not np.array_equal(pos, want)):
                    raise KvcFormatError("positions read back differently")
        except KvcError as exc:
            raise KvcCodecError(f"{what}: the written file does not read back as written ({exc}); nothing was kept") from None


def _declared_bytes(cache: KVCache) -> int:
    itemsize = 4 if is_bf16(cache) else cache.dtype.itemsize
    return max(1, cache.num_elements * itemsize)
