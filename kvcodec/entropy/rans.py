"""Interleaved rANS entropy coder, bitstreams v1 and v2 (spec/rans-v1.md, spec/rans-v2.md): the coder.

The probability model (counts -> 12-bit tables, ideal code lengths, v2's table banks) is
:mod:`kvcodec.entropy.model`; the bitstream constants are
:mod:`kvcodec.entropy.constants` (shared with the Triton decoder); the compiled loops (the encoder's body,
the stream checks, the scalar decoder) are :mod:`kvcodec.entropy.rans_kernels`.

The normative definitions are the spec files; this module is their CPU implementation. In short:

* symbols are uint8, probability precision ``P = 12`` bits (``M = 4096``),
* state ``x`` is in ``[L, 2**32)`` with ``L = 2**16``, renormalisation moves
  16-bit words, every lane's encoder starts at ``x = L``,
* 32 lanes per context: symbol ``i`` belongs to lane ``i % 32``, step ``i // 32``;
  within a step the decoder refills lanes in ascending lane order from the
  context's single word stream,
* after decoding every lane must be back at ``L`` and every word consumed,
* v1: one table per context; v2: a bank of tables shared by the stream's contexts, symbol ``i`` of
  context ``c`` coded with table ``table_of[c, i // block_symbols]``. One set of kernels codes both
  (:class:`RansStream` describes v1 as one block per context, table ``c``).

Public API
----------
``encode_contexts(symbols, freqs=None)`` symbols [C, N] uint8 -> v1 stream bytes
``encode_banked(symbols, block_symbols)`` symbols [C, N] uint8 -> v2 stream bytes
``parse_header(buf, ...)``              validate a v1 stream -> :class:`RansStream`
``parse_banked(buf, C, N, block)``      validate a v2 stream -> :class:`RansStream`
``decode(stream)``                      :class:`RansStream` -> flat uint8 symbols
``decode_contexts(buf, ...)``           v1 bytes -> symbols [C, N] (parse + decode)
``decode_reference(stream)``            readable numpy decoder mirroring the GPU one
``size_breakdown(buf, stream=None)``    payload / table / flush / padding byte split

``python kvcodec/testing/golden.py rans --write`` (``rans2`` for v2) writes the golden vectors under
``spec/vectors/rans/`` (``rans-v2/``), never over existing ones; tests only ever read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvcodec.errors import KvcFormatError
from kvcodec.entropy.constants import (
    E_FINAL_STATE, E_FREQ_RANGE, E_FREQ_SUM, E_LEB_LONG, E_LEB_NONCANON, E_OVERRUN, E_TRUNC, E_UNDERRUN, N_LANES, OK,
    PROB_BITS, PROB_SCALE, RANS_L, SLOT_MASK, STATE_BYTES, WORD_BITS,
)
from kvcodec.entropy import rans_kernels as kernels
from kvcodec.entropy.model import block_counts, count_symbols, cumulative, learn_bank, normalize_freqs

__all__ = [
    "RansStream", "SizeBreakdown", "encode_contexts", "encode_banked", "parse_header", "parse_banked", "decode",
    "decode_contexts", "decode_reference", "size_breakdown", "DECODE_ERRORS",
]


# --------------------------------------------------------------------------- encoder


def _leb128(freqs: np.ndarray) -> np.ndarray:
    """Unsigned LEB128 of every value of ``freqs`` (row-major), as uint8."""
    v = freqs.ravel().astype(np.int64)
    two = v >= 128
    out = np.empty(v.size + int(two.sum()), dtype=np.uint8)
    pos = np.arange(v.size) + np.concatenate(([0], np.cumsum(two)[:-1]))
    out[pos] = np.where(two, (v & 0x7F) | 0x80, v).astype(np.uint8)
    out[pos[two] + 1] = (v[two] >> 7).astype(np.uint8)
    return out


def _excl_cumsum(v: np.ndarray) -> np.ndarray:
    out = np.zeros(len(v), dtype=np.int64)
    if len(v) > 1:
        np.cumsum(v[:-1], out=out[1:])
    return out


def _pad4(n: int) -> int:
    return (n + 3) & ~3


def _check_tables(freqs: np.ndarray) -> None:
    """Explicit tables given to an encoder (golden vectors): every row a valid 12-bit table."""
    if (freqs < 0).any() or (freqs > PROB_SCALE).any() or (freqs.sum(axis=1) != PROB_SCALE).any():
        raise ValueError("every frequency table must hold values in [0, 4096] summing to 4096")


def _own_tables(C: int) -> np.ndarray:
    """v1's table map: context ``c`` codes all its symbols with table ``c``."""
    return np.arange(C, dtype=np.int64).reshape(C, 1)


def encode_contexts(symbols: np.ndarray, freqs: np.ndarray | None = None) -> bytes:
    """Encode contexts ``symbols`` [C, N] (uint8) into one rANS v1 stream.

    ``freqs`` [C, A] (12-bit tables, rows summing to 4096) defaults to
    :func:`normalize_freqs` of the per-context histograms with
    ``A = max symbol + 1`` (1 when there are no symbols). Every symbol that
    occurs must have a nonzero frequency in its context's table.
    """
    symbols = np.ascontiguousarray(symbols)
    if symbols.dtype != np.uint8 or symbols.ndim != 2:
        raise ValueError(f"symbols must be a uint8 [C, N] array, got {symbols.dtype}{symbols.shape}")
    C, N = symbols.shape
    if N >= 2**32 or C >= 2**32:
        raise ValueError("too many symbols or contexts for a rANS v1 stream")
    counts = count_symbols(symbols)
    A = counts.shape[1]
    if freqs is None:
        freqs = normalize_freqs(counts)
    else:
        freqs = np.ascontiguousarray(np.asarray(freqs).astype(np.int64))
        if freqs.ndim != 2 or freqs.shape[0] != C or not (A <= freqs.shape[1] <= 256):
            raise ValueError(f"freqs must be [C={C}, A] with {A} <= A <= 256, got {freqs.shape}")
        _check_tables(freqs)
        if (counts[:, : freqs.shape[1]][freqs[:, :A] == 0] > 0).any():
            raise ValueError("a symbol with frequency 0 occurs in its context")
        # A = highest symbol with a nonzero frequency in some context + 1 (canonical)
        A = int(np.flatnonzero(freqs.any(axis=0)).max()) + 1 if C else A
        freqs = freqs[:, :A]
        freqs = freqs.astype(np.uint32)
    cums = cumulative(freqs)
    leb = _leb128(freqs)
    header = 6 + 8 * C + leb.size
    body_start = _pad4(header)
    cap = body_start + C * _pad4(STATE_BYTES + 2 * N)
    out = np.zeros(cap, dtype=np.uint8)
    n_words = np.zeros(C, dtype=np.int64)
    end = kernels.encode_body(symbols, freqs, cums, _own_tables(C), max(N, 1), out, body_start, n_words)
    # header: u32 C, u16 A, per context u32 n_symbols, u32 n_words, A x LEB128
    out[0:4] = np.frombuffer(np.uint32(C).astype("<u4").tobytes(), np.uint8)
    out[4:6] = np.frombuffer(np.uint16(A).astype("<u2").tobytes(), np.uint8)
    leb_len = (freqs >= 128).sum(axis=1) + A  # bytes of each table
    entry = 8 + leb_len
    offs = 6 + _excl_cumsum(entry)
    counts_hdr = np.empty((C, 2), dtype="<u4")
    counts_hdr[:, 0] = N
    counts_hdr[:, 1] = n_words
    cb = counts_hdr.view(np.uint8).reshape(C, 8)
    for k in range(8):
        out[offs + k] = cb[:, k]
    # tables: scatter the LEB bytes after each 8-byte entry head
    tbl_dst = np.repeat(offs + 8, leb_len) + (np.arange(leb.size) - np.repeat(_excl_cumsum(leb_len), leb_len))
    out[tbl_dst] = leb
    return out[:end].tobytes()


MAX_TABLES = 255  # rans v2: a bank holds 1..255 tables (u8 count, u8 indices)


def encode_banked(symbols: np.ndarray, block_symbols: int, max_tables: int = 8,
                  bank: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """Encode contexts ``symbols`` [C, N] (uint8) into one rANS v2 stream (spec/rans-v2.md): a bank of tables
    shared by the stream's contexts, and for each context's block of ``block_symbols`` symbols (a multiple of
    32: a step never straddles two blocks) the index of its table.

    ``bank`` = (freqs [K, A], table_of [C, nb]) gives the tables and the choice (golden vectors); by default
    :func:`kvcodec.entropy.model.learn_bank` learns at most ``max_tables`` of them from the blocks.
    """
    symbols = np.ascontiguousarray(symbols)
    if symbols.dtype != np.uint8 or symbols.ndim != 2:
        raise ValueError(f"symbols must be a uint8 [C, N] array, got {symbols.dtype}{symbols.shape}")
    C, N = symbols.shape
    if block_symbols <= 0 or block_symbols % N_LANES:
        raise ValueError(f"block_symbols must be a positive multiple of {N_LANES}, got {block_symbols}")
    if N >= 2**32 or C >= 2**32:
        raise ValueError("too many symbols or contexts for a rANS stream")
    nb = max(1, -(-N // block_symbols))
    if bank is None:
        if not 1 <= max_tables <= MAX_TABLES:
            raise ValueError(f"max_tables must be in [1, {MAX_TABLES}], got {max_tables}")
        freqs, table_of = learn_bank(symbols, block_symbols, max_tables)
    else:
        freqs = np.ascontiguousarray(np.asarray(bank[0]).astype(np.int64))
        table_of = np.ascontiguousarray(np.asarray(bank[1]).astype(np.int64))
        K = freqs.shape[0] if freqs.ndim == 2 else 0
        if not (1 <= K <= MAX_TABLES) or not 1 <= freqs.shape[1] <= 256 or table_of.shape != (C, nb):
            raise ValueError(f"bank must be freqs [1..{MAX_TABLES}, A] and table_of [{C}, {nb}]")
        _check_tables(freqs)
        if C and ((table_of < 0).any() or (table_of >= K).any() or np.unique(table_of).size != K):
            raise ValueError("table_of must reference every table of the bank, and only those")
        blocks = block_counts(symbols, block_symbols)
        A0 = freqs.shape[1]
        if blocks[:, A0:].any() or ((blocks[:, :A0] > 0) & (freqs[table_of.reshape(-1)] == 0)).any():
            raise ValueError("a symbol with frequency 0 occurs in its block")
        A = int(np.flatnonzero(freqs.any(axis=0)).max()) + 1 if C else 1
        freqs = freqs[:, :A] if C else np.full((1, 1), PROB_SCALE, np.int64)
    freqs = freqs.astype(np.uint32)
    K, A = freqs.shape
    cums = cumulative(freqs)
    leb = _leb128(freqs)
    header = 8 + leb.size + C * nb + 4 * C
    body_start = _pad4(header)
    out = np.zeros(body_start + C * _pad4(STATE_BYTES + 2 * N), dtype=np.uint8)
    n_words = np.zeros(C, dtype=np.int64)
    end = kernels.encode_body(symbols, freqs, cums, table_of.astype(np.int64), block_symbols, out, body_start, n_words)
    out[0:8] = np.frombuffer(np.uint32(C).astype("<u4").tobytes() + np.uint16(A).astype("<u2").tobytes()
                             + bytes([K, 0]), np.uint8)
    pos = 8
    out[pos:pos + leb.size] = leb
    pos += leb.size
    out[pos:pos + C * nb] = table_of.astype(np.uint8).reshape(-1)
    pos += C * nb
    out[pos:pos + 4 * C] = np.frombuffer(n_words.astype("<u4").tobytes(), np.uint8)
    return out[:end].tobytes()


# --------------------------------------------------------------------------- parsing


@dataclass(frozen=True)
class RansStream:
    """A validated rANS v1 stream, ready for any decoder (CPU or GPU).

    All arrays are numpy; ``words`` is a zero-copy little-endian uint16 view of
    the whole stream (its length is ``len(buf) // 2``); context ``c``'s words
    are ``words[word_start[c] : word_start[c] + n_words[c]]``.
    """

    n_contexts: int
    alphabet: int  # A, table length shared by all tables
    n_symbols: np.ndarray  # int64 [C]
    sym_offsets: np.ndarray  # int64 [C + 1], cumulative n_symbols (output positions)
    n_words: np.ndarray  # int64 [C]
    freqs: np.ndarray  # uint32 [n_tables, A], rows sum to 4096 (v1: one table per context)
    cums: np.ndarray  # uint32 [n_tables, A], exclusive prefix sums of freqs
    states: np.ndarray  # uint32 [C, 32], final encoder states = initial decoder states
    data_offsets: np.ndarray  # int64 [C], byte offset of each context's states
    word_start: np.ndarray  # int64 [C], index into ``words`` of each context's first word
    words: np.ndarray  # uint16 view of the whole stream
    nbytes: int  # total stream length
    table_of: np.ndarray  # int64 [C, nb]: symbol i of context c is coded with table table_of[c, i // block_symbols]
    block_symbols: int  # v1: >= every context's n_symbols (one block); v2: the stage's block of tokens x channel group
    version: int = 1

    @property
    def total_symbols(self) -> int:
        return int(self.sym_offsets[-1])


def _as_u8(buf: bytes | bytearray | memoryview | np.ndarray) -> np.ndarray:
    if isinstance(buf, np.ndarray):
        if buf.dtype != np.uint8 or buf.ndim != 1:
            raise KvcFormatError("rans: stream must be a 1-D uint8 buffer")
        return buf
    return np.frombuffer(buf, dtype=np.uint8)


def parse_header(
    buf: bytes | bytearray | memoryview | np.ndarray,
    n_contexts: int | None = None,
    n_symbols: int | np.ndarray | None = None,
) -> RansStream:
    """Validate a rANS v1 stream completely (everything but the symbol data) and index it.

    ``n_contexts`` / ``n_symbols`` (an int for every context, or an array
    [C]) are what the caller expects; ``None`` accepts what the stream says.
    Checks: sizes fit the buffer exactly, counts match, ``n_words <= n_symbols``,
    canonical LEB128 frequencies <= 4096 summing to 4096 per context,
    ``A`` in [1, 256] and canonical (symbol ``A - 1`` has a nonzero
    frequency in some context), final states in [L, 2**32) and exactly L for lanes that
    get no symbol, zero padding. Raises :class:`KvcFormatError` naming the
    first violation. A GPU decoder calls this before launching its kernel.
    Pass ``n_symbols`` for untrusted data: without it the header's counts
    (up to 2**32 - 1 per context) decide how much a decoder allocates.
    """
    b = _as_u8(buf)
    n = b.size
    if n < 6:
        raise KvcFormatError(f"rans: stream of {n} bytes is shorter than its 6-byte header")
    C = int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24
    A = int(b[4]) | int(b[5]) << 8
    if n_contexts is not None and C != n_contexts:
        raise KvcFormatError(f"rans: stream has {C} contexts, expected {n_contexts}")
    if not 1 <= A <= 256:
        raise KvcFormatError(f"rans: alphabet size {A} is outside [1, 256]")
    if 6 + C * (8 + A) > n:  # cheap bound before allocating C x A tables
        raise KvcFormatError(f"rans: header of {C} contexts x {A} frequencies does not fit in {n} bytes")
    ns = np.zeros(C, dtype=np.int64)
    nw = np.zeros(C, dtype=np.int64)
    freqs = np.zeros((C, A), dtype=np.uint32)
    code, c, pos = kernels.parse_tables(b, C, A, ns, nw, freqs)
    if code != OK:
        raise _table_error(code, f"context {c}", pos)
    if C and not freqs[:, A - 1].any():
        raise KvcFormatError(f"rans: alphabet size {A} is not canonical: symbol {A - 1} has frequency 0 in every context")
    if n_symbols is not None:
        exp = np.broadcast_to(np.asarray(n_symbols, dtype=np.int64), (C,))
        bad = np.flatnonzero(ns != exp)
        if bad.size:
            c = int(bad[0])
            raise KvcFormatError(f"rans: context {c} has {ns[c]} symbols, expected {exp[c]}")
    data_off, states = _check_body(b, pos, ns, nw)
    words = b[: n & ~1].view("<u2")
    sym_off = np.zeros(C + 1, dtype=np.int64)
    np.cumsum(ns, out=sym_off[1:])
    return RansStream(
        n_contexts=C, alphabet=A, n_symbols=ns, sym_offsets=sym_off, n_words=nw, freqs=freqs,
        cums=cumulative(freqs) if C else np.zeros((0, A), np.uint32), states=states, data_offsets=data_off,
        word_start=(data_off + STATE_BYTES) // 2, words=words, nbytes=n,
        table_of=_own_tables(C), block_symbols=max(1, int(ns.max(initial=0))),
    )


def _table_error(code: int, which: str, pos: int) -> KvcFormatError:
    """The one-line error of a :func:`kvcodec.entropy.rans_kernels.read_table` failure in ``which`` ("context 3" in
    v1, "table 1" in v2); ``pos`` is the offset, or the table's sum for E_FREQ_SUM."""
    return KvcFormatError("rans: " + {
        E_TRUNC: f"truncated in the header of {which} (offset {pos})",
        E_LEB_LONG: f"frequency of {which} at offset {pos} is longer than 2 LEB128 bytes",
        E_LEB_NONCANON: f"frequency of {which} at offset {pos} is a non-canonical LEB128",
        E_FREQ_RANGE: f"frequency of {which} before offset {pos} exceeds 4096",
        E_FREQ_SUM: f"frequency table of {which} sums to {pos}, not 4096",
    }[code])


def _check_body(b: np.ndarray, pos: int, ns: np.ndarray, nw: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sections 8.6-8.7 of both versions: the context blocks after the header. Returns (data offsets, states)."""
    n = b.size
    C = ns.size
    bad = np.flatnonzero(nw > ns)
    if bad.size:
        c = int(bad[0])
        raise KvcFormatError(f"rans: context {c} claims {nw[c]} words for {ns[c]} symbols (at most one word per symbol)")
    data_off = np.empty(C, dtype=np.int64)
    states = np.empty((C, N_LANES), dtype=np.uint32)
    code, c, k = kernels.parse_body(b, pos, _pad4(pos), ns, nw, data_off, states)
    if code != OK:
        raise KvcFormatError("rans: " + {
            kernels.B_HEADER_PAD: "nonzero padding after the header",
            kernels.B_SIZE: f"stream is {n} bytes, its header describes {c}",
            kernels.B_LOW: f"final state of context {c} lane {k} is below L = 2**16",
            kernels.B_IDLE: f"lane {k} of context {c} gets no symbol but its state is not L",
            kernels.B_WORD_PAD: "nonzero padding after a context's words",
        }[code])
    return data_off, states


def parse_banked(buf: bytes | bytearray | memoryview | np.ndarray, n_contexts: int, n_symbols: int,
                 block_symbols: int) -> RansStream:
    """Validate a rANS v2 stream completely (spec/rans-v2.md section 4) and index it.

    The stream does not store its counts: ``n_contexts``, ``n_symbols`` (per context) and ``block_symbols``
    come from the chunk's shape and the stage's config, so a lying header cannot size any allocation beyond
    what the chunk allows. Raises :class:`KvcFormatError` naming the first violation.
    """
    b = _as_u8(buf)
    n = b.size
    C, N, B = int(n_contexts), int(n_symbols), int(block_symbols)
    if B <= 0 or B % N_LANES:
        raise KvcFormatError(f"rans: block of {B} symbols is not a positive multiple of {N_LANES}")
    if n < 8:
        raise KvcFormatError(f"rans: stream of {n} bytes is shorter than its 8-byte header")
    c_hdr = int(b[0]) | int(b[1]) << 8 | int(b[2]) << 16 | int(b[3]) << 24
    A = int(b[4]) | int(b[5]) << 8
    K, reserved = int(b[6]), int(b[7])
    if c_hdr != C:
        raise KvcFormatError(f"rans: stream has {c_hdr} contexts, expected {C}")
    if not 1 <= A <= 256:
        raise KvcFormatError(f"rans: alphabet size {A} is outside [1, 256]")
    if K < 1:
        raise KvcFormatError("rans: the bank holds no table")
    if reserved:
        raise KvcFormatError("rans: reserved header byte is not 0")
    nb = max(1, -(-N // B))
    if 8 + K * A + C * nb + 4 * C > n:
        raise KvcFormatError(f"rans: header of {K} tables x {A} frequencies and {C} contexts does not fit in {n} bytes")
    freqs = np.zeros((K, A), dtype=np.uint32)
    code, t, pos = kernels.parse_bank(b, 8, freqs)
    if code != OK:
        raise _table_error(code, f"table {t}", pos)
    if pos + C * nb + 4 * C > n:
        raise KvcFormatError(f"rans: truncated in the table indices or word counts (offset {pos})")
    table_of = b[pos:pos + C * nb].astype(np.int64).reshape(C, nb)
    pos += C * nb
    if C:
        if int(table_of.max()) >= K:
            raise KvcFormatError(f"rans: a block's table index {int(table_of.max())} is not below the bank's {K} tables")
        if np.unique(table_of).size != K:
            raise KvcFormatError("rans: a table of the bank is used by no block (not canonical)")
        if not freqs[:, A - 1].any():
            raise KvcFormatError(f"rans: alphabet size {A} is not canonical: symbol {A - 1} has frequency 0 in every table")
    elif K != 1:
        raise KvcFormatError(f"rans: a stream with no contexts has {K} tables, not 1")
    nw = b[pos:pos + 4 * C].view("<u4").astype(np.int64) if C else np.zeros(0, np.int64)
    pos += 4 * C
    ns = np.full(C, N, dtype=np.int64)
    data_off, states = _check_body(b, pos, ns, nw)
    sym_off = np.arange(C + 1, dtype=np.int64) * N
    return RansStream(
        n_contexts=C, alphabet=A, n_symbols=ns, sym_offsets=sym_off, n_words=nw, freqs=freqs, cums=cumulative(freqs),
        states=states, data_offsets=data_off, word_start=(data_off + STATE_BYTES) // 2, words=b[: n & ~1].view("<u2"),
        nbytes=n, table_of=table_of, block_symbols=B, version=2,
    )


# --------------------------------------------------------------------------- decoders


DECODE_ERRORS = {
    E_OVERRUN: "reads past the end of its word stream",
    E_UNDERRUN: "leaves words unread",
    E_FINAL_STATE: "does not end in the initial state L (corrupt data)",
}


def decode(stream: RansStream) -> np.ndarray:
    """Decode a validated stream into a flat uint8 array of ``stream.total_symbols``
    (context ``c`` at ``sym_offsets[c]:sym_offsets[c+1]``). Raises KvcFormatError
    when the data is corrupt (overrun, unread words, wrong final state)."""
    out = np.empty(stream.total_symbols, dtype=np.uint8)
    if stream.n_contexts == 0:
        return out
    words = stream.words if stream.words.size else np.zeros(1, np.uint16)
    err = np.zeros(1, dtype=np.int64)
    code = kernels.decode_kernel(
        stream.freqs, stream.cums, stream.table_of, stream.block_symbols, stream.states, stream.n_symbols,
        stream.sym_offsets, stream.n_words, stream.word_start, words, out, err,
    )
    if code != OK:
        raise KvcFormatError(f"rans: context {int(err[0])} {DECODE_ERRORS[code]}")
    return out


def decode_contexts(
    buf: bytes | bytearray | memoryview | np.ndarray,
    n_contexts: int | None = None,
    n_symbols: int | None = None,
    reference: bool = False,
) -> np.ndarray:
    """Parse, validate and decode a stream whose contexts all have the same
    number of symbols; returns symbols [C, N] uint8."""
    stream = parse_header(buf, n_contexts, n_symbols)
    ns = stream.n_symbols
    if ns.size and (ns != ns[0]).any():
        raise KvcFormatError("rans: contexts have different symbol counts")
    flat = decode_reference(stream) if reference else decode(stream)
    return flat.reshape(stream.n_contexts, int(ns[0]) if ns.size else 0)


def decode_reference(stream: RansStream) -> np.ndarray:
    """Readable numpy decoder, vectorised across the 32 lanes exactly like the
    GPU kernel (one warp per context): each step decodes all active lanes, then
    hands out the next words to the lanes that need a refill by an exclusive
    prefix sum of their refill flags (a warp ballot + popcount). Slow (numpy
    per step); for tests and as executable documentation of the spec."""
    out = np.empty(stream.total_symbols, dtype=np.uint8)
    for c in range(stream.n_contexts):
        x = stream.states[c].astype(np.int64)
        n = int(stream.n_symbols[c])
        w = stream.words[stream.word_start[c] : stream.word_start[c] + stream.n_words[c]].astype(np.int64)
        p = 0
        o = int(stream.sym_offsets[c])
        for j in range((n + N_LANES - 1) // N_LANES):
            t = stream.table_of[c, j * N_LANES // stream.block_symbols]  # a step lies inside one block
            f = stream.freqs[t].astype(np.int64)
            cum = stream.cums[t].astype(np.int64)
            sym_of_slot = np.repeat(np.arange(stream.alphabet), f)  # slot -> symbol
            k = min(N_LANES, n - j * N_LANES)  # active lanes 0..k-1
            xs = x[:k]
            slot = xs & SLOT_MASK
            s = sym_of_slot[slot]
            out[o + j * N_LANES : o + j * N_LANES + k] = s
            xs = f[s] * (xs >> PROB_BITS) + slot - cum[s]
            need = xs < RANS_L
            rank = np.cumsum(need) - need  # exclusive prefix sum = ballot popcount below the lane
            cnt = int(need.sum())
            if p + cnt > w.size:
                raise KvcFormatError(f"rans: context {c} {DECODE_ERRORS[E_OVERRUN]}")
            xs[need] = (xs[need] << WORD_BITS) | w[p + rank[need]]
            p += cnt
            x[:k] = xs
        if p != w.size:
            raise KvcFormatError(f"rans: context {c} {DECODE_ERRORS[E_UNDERRUN]}")
        if (x != RANS_L).any():
            raise KvcFormatError(f"rans: context {c} {DECODE_ERRORS[E_FINAL_STATE]}")
    return out


# --------------------------------------------------------------------------- accounting


@dataclass(frozen=True)
class SizeBreakdown:
    """Where the bytes of a stream go."""

    total_bytes: int
    payload_bits: int  # 16 x number of words
    table_bytes: int  # LEB128 frequency tables
    flush_bytes: int  # 32 lanes x 4 bytes of final state per context
    header_bytes: int  # v1: u32 n_contexts + u16 A + 8 bytes per context; v2: 8 + block indices + 4 per context
    padding_bytes: int
    n_symbols: int


def size_breakdown(buf: bytes | bytearray | memoryview | np.ndarray, stream: RansStream | None = None) -> SizeBreakdown:
    """Split a stream's size into payload, tables, state flush, fixed header, padding (``stream``: the parsed
    stream, needed for v2, whose counts come from the chunk; a v1 stream is parsed from ``buf``)."""
    s = parse_header(buf) if stream is None else stream
    C = s.n_contexts
    words = int(s.n_words.sum())
    header = 6 + 8 * C if s.version == 1 else 8 + s.table_of.size + 4 * C  # v2: the block indices count here
    table = int(np.where(s.freqs >= 128, 2, 1).sum()) if C else 0
    flush = STATE_BYTES * C
    pad = s.nbytes - header - table - flush - 2 * words
    return SizeBreakdown(s.nbytes, WORD_BITS * words, table, flush, header, pad, s.total_symbols)
