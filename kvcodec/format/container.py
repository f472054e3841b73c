"""`.kvc` v1 layout: constants, limits and (de)serialisation of the fixed parts.

Everything here follows spec/kvc-v1.md; the section numbers in comments
refer to it. All integers are little-endian. Nothing in this module reads a
file: it turns bytes into validated values (or :class:`KvcFormatError`) and
values into bytes.

File layout::

    preamble (32 B) | header JSON | header CRC32C (4 B) | zero pad to 64
    data section: blobs, then chunks, each at a 64-byte aligned offset,
                  separated only by zero padding (< 64 B)
    index: entry_count x 48-byte entries (64-byte aligned start)
    footer (32 B)
"""

from __future__ import annotations

import json
import math
import re
import struct
import sys
from dataclasses import dataclass
from typing import Any, NamedTuple

import google_crc32c
import numpy as np

from kvcodec.core.dtypes import DTYPE_BY_NAME, DTYPE_CODES, np_le
from kvcodec.core.stage import MAX_PIPELINES, MAX_STAGES  # noqa: F401  (the container's limits; header and writer read them here)
from kvcodec.errors import KvcCodecError, KvcFormatError

# -- 3. preamble ------------------------------------------------------------
MAGIC = b"\x89KVC\r\n\x1a\n"
FOOTER_MAGIC = b"\x89KVCEND\n"
VERSION_MAJOR = 1
VERSION_MINOR = 0
PREAMBLE = struct.Struct("<8sHHIQQ")  # magic, major, minor, header_length, required, optional
PREAMBLE_SIZE = PREAMBLE.size  # 32
HEADER_CRC_SIZE = 4
# Feature bits understood by this reader (spec section 3).
FEATURE_RAGGED = 1 << 0  # required bit 0: layers store different token counts (tensors.layer_tokens, section 4.2)
FEATURE_ATTENTION_BIAS = 1 << 1  # required bit 1: an attention bias the loader must apply (attention_bias, section 4.6)
KNOWN_REQUIRED_FEATURES = FEATURE_RAGGED | FEATURE_ATTENTION_BIAS
KNOWN_OPTIONAL_FEATURES = 0

# -- 7. index and footer ----------------------------------------------------
INDEX_ENTRY = struct.Struct("<IBBHIIIIQQII")  # 48 bytes
INDEX_ENTRY_SIZE = INDEX_ENTRY.size
FOOTER = struct.Struct("<QQII8s")  # index_offset, entry_count, index_crc, footer_crc, magic
FOOTER_SIZE = FOOTER.size  # 32
KINDS = ("k", "v")

# -- 6. chunk record ---------------------------------------------------------
CHUNK_HEAD = struct.Struct("<BBHIQ")  # n_stages, n_sizes, n_side, reserved, payload_length
SIDE_HEAD = struct.Struct("<BBBB")  # stage index, name length, dtype code, ndim

# -- 9. limits ---------------------------------------------------------------
ALIGN = 64
MAX_HEADER_BYTES = 16 << 20
MAX_TOKENS = (1 << 31) - 1
MAX_CHUNK_DECODED_BYTES = 1 << 32
MAX_BLOB_BYTES = 1 << 32
MAX_BLOB_NDIM = 4
MAX_SIDE_NDIM = 4
MAX_SIDE_ARRAYS = 1024
MAX_SIDE_NAME = 64
STAGE_SLACK = 1 << 16  # intermediate byte strings may not exceed 2 * decoded + this
MAX_JSON_DEPTH = 64

TENSOR_DTYPES = ("float16", "bfloat16", "float32")
_SIDE_NAME_RE = re.compile(rb"^[A-Za-z0-9_.\-]{1,64}$")
_BLOB_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-/]{1,128}$")


def align_up(n: int, a: int = ALIGN) -> int:
    return -(-n // a) * a


def crc32c(data: Any) -> int:
    try:
        return google_crc32c.value(data)
    except TypeError:  # writable buffers (bytearray, numpy) must be copied
        return google_crc32c.value(bytes(data))


def pipeline_dtype(tensor_dtype: str) -> str:
    """numpy dtype handed to codec pipelines for a tensor dtype (bfloat16 travels as exact float32)."""
    return "float32" if tensor_dtype == "bfloat16" else tensor_dtype


# -- preamble / header -------------------------------------------------------
@dataclass(frozen=True)
class Preamble:
    major: int
    minor: int
    header_length: int
    required_features: int
    optional_features: int

    def pack(self) -> bytes:
        return PREAMBLE.pack(MAGIC, self.major, self.minor, self.header_length, self.required_features, self.optional_features)

    @classmethod
    def unpack(cls, b: bytes | memoryview, file_size: int | None = None) -> "Preamble":
        if len(b) < PREAMBLE_SIZE:
            raise KvcFormatError(f"file too short for a .kvc preamble ({len(b)} bytes, need {PREAMBLE_SIZE})")
        magic, major, minor, hlen, req, opt = PREAMBLE.unpack_from(b, 0)
        if magic != MAGIC:
            if magic[1:4] == MAGIC[1:4]:
                raise KvcFormatError(f"bad magic at offset 0: {magic!r} (file mangled by a text-mode transfer?)")
            raise KvcFormatError(f"not a .kvc file (magic at offset 0 is {magic!r})")
        if major != VERSION_MAJOR:
            raise KvcFormatError(f"unsupported .kvc major version {major} (this reader reads {VERSION_MAJOR}.x)")
        unknown = req & ~KNOWN_REQUIRED_FEATURES
        if unknown:
            bits = [i for i in range(64) if unknown >> i & 1]
            raise KvcFormatError(f"file requires unknown feature bits {bits} (preamble offset 16)")
        if hlen < 2 or hlen > MAX_HEADER_BYTES:
            raise KvcFormatError(f"header length {hlen} at offset 12 outside [2, {MAX_HEADER_BYTES}]")
        min_size = align_up(PREAMBLE_SIZE + hlen + HEADER_CRC_SIZE) + FOOTER_SIZE
        if file_size is not None and file_size < min_size:
            raise KvcFormatError(f"header length {hlen} at offset 12 does not fit in a {file_size}-byte file")
        return cls(major, minor, hlen, req, opt)


def data_start(header_length: int) -> int:
    return align_up(PREAMBLE_SIZE + header_length + HEADER_CRC_SIZE)


def dump_header(obj: dict[str, Any]) -> bytes:
    """Canonical header bytes: sorted keys, no whitespace, ASCII-only JSON."""
    b = json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode("ascii")
    if len(b) > MAX_HEADER_BYTES:
        raise KvcFormatError(f"header would be {len(b)} bytes, over the {MAX_HEADER_BYTES}-byte limit")
    return b


def _no_dupes(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d: dict[str, Any] = {}
    for k, v in pairs:
        if k in d:
            raise KvcFormatError(f"header JSON repeats the key {k!r}")
        d[k] = v
    return d


def _bad_constant(name: str) -> Any:
    raise KvcFormatError(f"header JSON contains {name}, which is not allowed")


_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_NOT_BRACKETS = str.maketrans("", "", "".join(chr(c) for c in range(128) if chr(c) not in "[]{}"))
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89abcdefABCDEF]")


def _too_deep(text: str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Nesting depth of JSON text over ``limit``? Checked on the text before parsing (no recursion at all)."""
    depth = 0
    for ch in _JSON_STRING.sub("", text).translate(_NOT_BRACKETS):
        if ch in "[{":
            depth += 1
            if depth > limit:
                return True
        elif ch in "]}":
            depth -= 1
    return False


def _finite_float(text: str) -> float:
    v = float(text)
    if not math.isfinite(v):  # 1e400 parses to inf: as forbidden as the Infinity literal
        raise KvcFormatError(f"header JSON number {text[:40]} overflows a double")
    return v


_DOUBLE_MAX_INT = int(sys.float_info.max)


def _double_int(text: str) -> int:
    """An integer literal is a JSON number too: one past a double's range (a 400-digit ``meta`` value) is as
    forbidden as ``1e400`` (spec section 4), and rejecting it here means no consumer of the header (``kvc info``'s
    prune record, the edit log's promise) meets an int that ``float()`` cannot convert (an OverflowError)."""
    v = int(text)
    if abs(v) > _DOUBLE_MAX_INT:
        raise KvcFormatError(f"header JSON number {text[:40]}... ({len(text)} digits) overflows a double")
    return v


def load_header(b: bytes | memoryview) -> dict[str, Any]:
    """Parse header bytes under the JSON rules of spec section 4: strict UTF-8, no duplicate keys,
    no NaN / Infinity (nor numbers that overflow to them), no lone surrogates, depth <= 64, an object."""
    try:
        text = bytes(b).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise KvcFormatError(f"header (offset {PREAMBLE_SIZE}) is not valid UTF-8 JSON: {str(exc)[:200]}") from None
    if _too_deep(text):
        raise KvcFormatError(f"header JSON nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        obj = json.loads(text, object_pairs_hook=_no_dupes, parse_constant=_bad_constant, parse_float=_finite_float,
                         parse_int=_double_int)
    except KvcFormatError:
        raise
    except (ValueError, RecursionError) as exc:
        raise KvcFormatError(f"header (offset {PREAMBLE_SIZE}) is not valid UTF-8 JSON: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise KvcFormatError(f"header (offset {PREAMBLE_SIZE}) must be a JSON object")
    if _SURROGATE_ESCAPE.search(text):  # an escape like \ud800 may decode to a lone surrogate (a valid pair is fine)
        try:
            json.dumps(obj, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise KvcFormatError("header JSON contains a lone UTF-16 surrogate escape (not a Unicode character)") from None
    return obj


# -- index / footer ----------------------------------------------------------
class IndexEntry(NamedTuple):
    layer: int
    kind: str  # "k" | "v"
    pipeline: int
    token_start: int
    token_end: int
    head_start: int
    head_end: int
    offset: int  # relative to the data section start
    length: int
    crc32c: int

    def pack(self) -> bytes:
        return INDEX_ENTRY.pack(
            self.layer, KINDS.index(self.kind), 0, self.pipeline, self.token_start, self.token_end,
            self.head_start, self.head_end, self.offset, self.length, self.crc32c, 0,
        )

    @classmethod
    def unpack(cls, b: bytes | memoryview, pos: int, j: int) -> "IndexEntry":
        return _entry(INDEX_ENTRY.unpack_from(b, pos), j)

    @property
    def tokens(self) -> int:
        return self.token_end - self.token_start

    @property
    def heads(self) -> int:
        return self.head_end - self.head_start


@dataclass(frozen=True)
class Footer:
    index_offset: int
    entry_count: int
    index_crc32c: int

    def pack(self) -> bytes:
        head = struct.pack("<QQI", self.index_offset, self.entry_count, self.index_crc32c)
        return FOOTER.pack(self.index_offset, self.entry_count, self.index_crc32c, crc32c(head), FOOTER_MAGIC)

    @classmethod
    def unpack(cls, b: bytes | memoryview, file_size: int) -> "Footer":
        at = file_size - FOOTER_SIZE
        if len(b) != FOOTER_SIZE:
            raise KvcFormatError(f"file too short for a .kvc footer ({file_size} bytes)")
        off, count, icrc, fcrc, magic = FOOTER.unpack(b)
        if magic != FOOTER_MAGIC:
            raise KvcFormatError(f"bad footer magic at offset {at + 24}: {magic!r} (truncated or not a .kvc file)")
        if crc32c(bytes(b[:20])) != fcrc:
            raise KvcFormatError(f"footer CRC32C mismatch at offset {at + 20}")
        if count > (file_size - FOOTER_SIZE) // INDEX_ENTRY_SIZE:
            raise KvcFormatError(f"footer claims {count} index entries, more than a {file_size}-byte file can hold")
        if off % ALIGN or off + count * INDEX_ENTRY_SIZE != at:
            raise KvcFormatError(f"footer index offset {off} (offset {at}) does not place the index right before the footer")
        return cls(off, count, icrc)


def _entry(f: tuple, j: int) -> IndexEntry:
    layer, kind, res1, pid, t0, t1, h0, h1, off, length, crc, res2 = f
    if kind > 1:
        raise KvcFormatError(f"index entry {j}: kind byte {kind} is neither 0 (K) nor 1 (V)")
    if res1 or res2:
        raise KvcFormatError(f"index entry {j}: reserved fields are not zero")
    return IndexEntry(layer, KINDS[kind], pid, t0, t1, h0, h1, off, length, crc)


def parse_index(b: bytes | memoryview, footer: Footer, index_at: int) -> list[IndexEntry]:
    if len(b) != footer.entry_count * INDEX_ENTRY_SIZE:
        raise KvcFormatError(f"short index at offset {index_at}")
    if crc32c(bytes(b)) != footer.index_crc32c:
        raise KvcFormatError(f"index CRC32C mismatch (index at offset {index_at})")
    return [_entry(f, j) for j, f in enumerate(INDEX_ENTRY.iter_unpack(bytes(b)))]


# -- chunk records -----------------------------------------------------------
def pack_chunk(payload: bytes, sides: list[dict[str, np.ndarray]], sizes: list[int]) -> list[bytes]:
    """Serialise one chunk record; returns a list of byte pieces (concatenate to get the record)."""
    n_side = sum(len(s) for s in sides)
    if len(sides) > MAX_STAGES or n_side > MAX_SIDE_ARRAYS:
        raise KvcCodecError(f"chunk has {len(sides)} stages / {n_side} side arrays (limits {MAX_STAGES} / {MAX_SIDE_ARRAYS})")
    parts = [CHUNK_HEAD.pack(len(sides), len(sizes), n_side, 0, len(payload)), struct.pack(f"<{len(sizes)}Q", *sizes)]
    for si, side in enumerate(sides):
        for name in sorted(side):
            arr = np.asarray(side[name])
            nb = name.encode("ascii", "replace")
            if not _SIDE_NAME_RE.match(nb):
                raise KvcCodecError(f"side data name {name!r} of stage {si} is not 1-64 chars of [A-Za-z0-9_.-]")
            dname = arr.dtype.name
            if arr.dtype.kind not in "uif" or dname not in DTYPE_BY_NAME:
                raise KvcCodecError(f"side data {name!r} of stage {si} has unsupported dtype {arr.dtype}")
            if arr.ndim > MAX_SIDE_NDIM or any(d >= 1 << 32 for d in arr.shape):
                raise KvcCodecError(f"side data {name!r} of stage {si} has shape {arr.shape} (ndim <= {MAX_SIDE_NDIM})")
            parts.append(SIDE_HEAD.pack(si, len(nb), DTYPE_BY_NAME[dname], arr.ndim))
            parts.append(nb)
            parts.append(struct.pack(f"<{arr.ndim}I", *arr.shape))
            parts.append(np.ascontiguousarray(arr, dtype=np_le(dname)).tobytes())
    parts.append(payload)
    return parts


def parse_chunk(b: bytes | memoryview, n_stages: int, n_byte_stages: int, j: int) -> tuple[memoryview, list[dict[str, np.ndarray]], list[int]]:
    """Split a (CRC-checked) chunk record into payload, side data per stage and stage sizes."""
    mv = memoryview(b)
    total = len(mv)
    where = f"chunk {j}"
    if total < CHUNK_HEAD.size:
        raise KvcFormatError(f"{where}: record of {total} bytes is shorter than its {CHUNK_HEAD.size}-byte head")
    ns, nz, nside, res, plen = CHUNK_HEAD.unpack_from(mv, 0)
    if res:
        raise KvcFormatError(f"{where}: reserved field is not zero")
    if ns != n_stages or nz != n_byte_stages:
        raise KvcFormatError(f"{where}: records {ns} stages / {nz} sizes, its pipeline has {n_stages} / {n_byte_stages}")
    if nside > MAX_SIDE_ARRAYS:
        raise KvcFormatError(f"{where}: {nside} side arrays exceed the limit {MAX_SIDE_ARRAYS}")
    pos = CHUNK_HEAD.size
    if pos + 8 * nz > total:
        raise KvcFormatError(f"{where}: truncated stage sizes")
    sizes = list(struct.unpack_from(f"<{nz}Q", mv, pos))
    pos += 8 * nz
    sides: list[dict[str, np.ndarray]] = [{} for _ in range(ns)]
    for a in range(nside):
        if pos + SIDE_HEAD.size > total:
            raise KvcFormatError(f"{where}: side array {a} head runs past the record end")
        si, nlen, code, ndim = SIDE_HEAD.unpack_from(mv, pos)
        pos += SIDE_HEAD.size
        if si >= ns:
            raise KvcFormatError(f"{where}: side array {a} names stage {si}, pipeline has {ns}")
        if code not in DTYPE_CODES or ndim > MAX_SIDE_NDIM or not 1 <= nlen <= MAX_SIDE_NAME:
            raise KvcFormatError(f"{where}: side array {a} has bad dtype code {code}, ndim {ndim} or name length {nlen}")
        if pos + nlen + 4 * ndim > total:
            raise KvcFormatError(f"{where}: side array {a} head runs past the record end")
        name_b = bytes(mv[pos : pos + nlen])
        pos += nlen
        if not _SIDE_NAME_RE.match(name_b):
            raise KvcFormatError(f"{where}: side array {a} has a bad name {name_b!r}")
        shape = struct.unpack_from(f"<{ndim}I", mv, pos)
        pos += 4 * ndim
        dt = np_le(DTYPE_CODES[code])
        nbytes = math.prod(shape) * dt.itemsize
        if pos + nbytes > total:
            raise KvcFormatError(f"{where}: side array {name_b.decode()!r} ({nbytes} bytes) runs past the record end")
        name = name_b.decode("ascii")
        if name in sides[si]:
            raise KvcFormatError(f"{where}: stage {si} has two side arrays named {name!r}")
        sides[si][name] = np.frombuffer(mv[pos : pos + nbytes], dtype=dt).reshape(shape).astype(dt.newbyteorder("="))
        pos += nbytes
    if pos + plen != total:
        raise KvcFormatError(f"{where}: payload length {plen} does not end the {total}-byte record (payload at +{pos})")
    return mv[pos:], sides, sizes


# -- header field helpers ----------------------------------------------------
def check_blob_name(name: Any) -> bool:
    return isinstance(name, str) and bool(_BLOB_NAME_RE.match(name))
