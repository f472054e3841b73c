"""The ``rans`` array->bytes stages: uint8 (H, T, D) -> interleaved rANS stream, versions 1 and 2.

Contexts are ``(h, j)`` for ``h < H``, ``j < D // g`` (h-major), where ``g`` is
the ``channel_group`` config (default ``D``); context ``(h, j)`` codes
``arr[h, :, j*g:(j+1)*g]`` in row-major (token-major) order. Version 1 gives each
context its own 12-bit frequency table (spec/rans-v1.md); version 2 shares a bank
of tables among the chunk's contexts and picks one per block of tokens
(spec/rans-v2.md). No side data: the tables live in the stream.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.core.stage import ArraySpec, ArrayToBytes, ChunkContext, SideData, register
from kvcodec.entropy import rans
from kvcodec.entropy.model import empirical_entropy_bits
from kvcodec.entropy.rans import SizeBreakdown, size_breakdown

__all__ = ["RansStage", "RansBankStage", "to_contexts", "from_contexts", "empirical_entropy_bits", "size_breakdown", "overhead_split", "SizeBreakdown"]


def _group(d: int, g: int | None) -> int:
    g = d if g is None else g
    if g <= 0 or d % g:
        raise KvcCodecError(f"codec 'rans': channel_group {g} does not divide the {d} channels")
    return g


def to_contexts(arr: np.ndarray, channel_group: int | None = None) -> np.ndarray:
    """(H, T, D) -> symbols [H * D/g, T * g] in the stage's context order."""
    H, T, D = arr.shape
    if D == 0:
        return np.zeros((0, 0), dtype=arr.dtype)
    g = _group(D, channel_group)
    return np.ascontiguousarray(arr.reshape(H, T, D // g, g).transpose(0, 2, 1, 3)).reshape(H * (D // g), T * g)


def from_contexts(sym: np.ndarray, shape: tuple[int, int, int], channel_group: int | None = None) -> np.ndarray:
    """Inverse of :func:`to_contexts`."""
    H, T, D = shape
    if D == 0:
        return np.zeros(shape, dtype=sym.dtype)
    g = _group(D, channel_group)
    return np.ascontiguousarray(sym.reshape(H, D // g, T, g).transpose(0, 2, 1, 3)).reshape(H, T, D)


@register
class RansStage(ArrayToBytes):
    """Interleaved 32-lane rANS (12-bit tables, 32-bit state, 16-bit words)."""

    name = "rans"
    version = 1

    def __init__(self, channel_group: int | None = None) -> None:
        if channel_group is not None and (
            isinstance(channel_group, bool) or not isinstance(channel_group, (int, np.integer)) or channel_group <= 0
        ):
            raise KvcCodecError(f"codec 'rans': channel_group must be a positive integer, got {channel_group!r}")
        self.channel_group = None if channel_group is None else int(channel_group)

    def get_config(self) -> dict[str, Any]:
        return {} if self.channel_group is None else {"channel_group": self.channel_group}

    def _check_spec(self, shape: tuple[int, ...], dtype: Any) -> tuple[int, int, int]:
        if len(shape) != 3 or np.dtype(dtype) != np.uint8:
            raise KvcCodecError(f"codec 'rans' codes uint8 (heads, tokens, channels) arrays, got {np.dtype(dtype)}{tuple(shape)}")
        H, T, D = (int(v) for v in shape)
        if D:
            _group(D, self.channel_group)
        return H, T, D

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]:
        arr = np.asarray(arr)
        self._check_spec(arr.shape, arr.dtype)
        return rans.encode_contexts(to_contexts(arr, self.channel_group)), {}

    def expected_counts(self, shape: tuple[int, int, int]) -> tuple[int, int]:
        """(n_contexts, symbols per context) of a chunk of this shape."""
        H, T, D = shape
        if D == 0:
            return 0, 0
        g = _group(D, self.channel_group)
        return H * (D // g), T * g

    def parse(self, data: bytes | memoryview, spec: ArraySpec) -> rans.RansStream:
        """Validate ``data`` against ``spec`` (for decoders on other devices)."""
        shape = self._check_spec(spec.shape, spec.dtype)
        n_ctx, n_sym = self.expected_counts(shape)
        return rans.parse_header(data, n_ctx, n_sym)

    def decode(self, data: bytes | memoryview, side: SideData, spec: ArraySpec, ctx: ChunkContext) -> np.ndarray:
        if side:
            raise KvcFormatError(f"codec 'rans' has no side data, got {sorted(side)}")
        stream = self.parse(data, spec)
        flat = rans.decode(stream)
        shape = self._check_spec(spec.shape, spec.dtype)
        n_ctx, n_sym = self.expected_counts(shape)
        return from_contexts(flat.reshape(n_ctx, n_sym), shape, self.channel_group)


def _int_in(v: Any, lo: int, hi: int) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool) and lo <= int(v) <= hi


@register
class RansBankStage(RansStage):
    """rANS v2 (spec/rans-v2.md): v1's lanes and words, with a bank of tables shared by the chunk's contexts and a
    table chosen for every block of ``block_tokens`` tokens of a context.

    Why: v1 gives each context one table for all its tokens and stores it (about 117 bytes). On real caches a
    context's symbols change scale along the tokens (the tokenscale classes, the attention's recent tokens), and
    the chunk's contexts share a few shapes, so a handful of shared tables chosen per block codes the same
    symbols in about 9 % fewer bits (benchmarks/BENCHMARKS.md, "Entropy contexts"). ``block_tokens`` is a
    multiple of 32, so one 32-lane step never straddles two blocks; ``tables`` (the bank's largest size) only
    steers the encoder: a decoder reads the bank's size from the stream.
    """

    version = 2

    def __init__(self, channel_group: int | None = None, block_tokens: int = 128, tables: int = 8) -> None:
        super().__init__(channel_group)
        if not _int_in(block_tokens, 32, 1 << 20) or block_tokens % 32:
            raise KvcCodecError(f"codec 'rans' v2: block_tokens must be a multiple of 32 in [32, 2**20], got {block_tokens!r}")
        if not _int_in(tables, 1, rans.MAX_TABLES):
            raise KvcCodecError(f"codec 'rans' v2: tables must be an integer in [1, {rans.MAX_TABLES}], got {tables!r}")
        self.block_tokens = int(block_tokens)
        self.tables = int(tables)

    def get_config(self) -> dict[str, Any]:
        return {**super().get_config(), "block_tokens": self.block_tokens, "tables": self.tables}

    def block_symbols(self, shape: tuple[int, int, int]) -> int:
        """Symbols of one block of a context: ``block_tokens`` tokens x the channel group."""
        D = shape[2]
        return self.block_tokens * (_group(D, self.channel_group) if D else 1)

    def encode(self, arr: np.ndarray, ctx: ChunkContext) -> tuple[bytes, SideData]:
        arr = np.asarray(arr)
        shape = self._check_spec(arr.shape, arr.dtype)
        return rans.encode_banked(to_contexts(arr, self.channel_group), self.block_symbols(shape), self.tables), {}

    def parse(self, data: bytes | memoryview, spec: ArraySpec) -> rans.RansStream:
        shape = self._check_spec(spec.shape, spec.dtype)
        n_ctx, n_sym = self.expected_counts(shape)
        return rans.parse_banked(data, n_ctx, n_sym, self.block_symbols(shape))


def overhead_split(data: bytes | memoryview) -> tuple[int, int, int]:
    """(payload bits, table bytes, state-flush bytes) of an encoded stage output.

    Payload bits are 16 x the number of renormalisation words; table bytes the
    LEB128 frequency tables; flush bytes 128 per context (32 final u32 states).
    The fixed header (6 + 8 per context) and padding are in :func:`size_breakdown`.
    """
    b = size_breakdown(data)
    return b.payload_bits, b.table_bytes, b.flush_bytes
