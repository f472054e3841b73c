"""The ``.kvc`` header as a model (:class:`KvcHeader`, its blobs and attachments) and the checks that a header and
an index describe one complete, well-formed file (spec/kvc-v1.md §4-§5).

Why a module of its own: the header's *bytes* (preamble, JSON, CRCs, index entries) are
:mod:`kvcodec.format.container`'s, shared with the writer; what the parsed JSON *means* -- every field typed
and bounded, pipelines resolved, the layout tiling every tensor exactly -- is decided here, once, before
:class:`kvcodec.format.reader.KvcReader` decodes anything.  It needs no source, no decoder and no torch.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcodec.lru import BoundedLRU
from kvcodec.errors import KvcCodecError, KvcFormatError, is_int, want, KvcUnknownCodecError
from kvcodec.core.fingerprint import FINGERPRINT_VERSION, ModelFingerprint, check_fingerprint_json
from kvcodec.core.stage import Pipeline
from kvcodec.format.bias import AttentionBias
from kvcodec.format.container import (
    DTYPE_BY_NAME, FEATURE_ATTENTION_BIAS, FEATURE_RAGGED, KINDS, MAX_BLOB_BYTES, MAX_BLOB_NDIM,
    MAX_CHUNK_DECODED_BYTES, MAX_PIPELINES, MAX_STAGES, MAX_TOKENS, TENSOR_DTYPES,
    IndexEntry, Preamble, align_up, check_blob_name, data_start,
)

_HEX64 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class BlobInfo:
    dtype: str
    shape: tuple[int, ...]
    offset: int  # relative to the data section
    length: int
    crc32c: int


@dataclass(frozen=True)
class AttachmentInfo:
    name: str
    sha256: str
    dtype: str
    shape: tuple[int, ...]
    blob: int | None  # None: external


@dataclass
class KvcHeader:
    """The decoded, validated header of a `.kvc` file."""

    version: tuple[int, int]
    required_features: int
    optional_features: int
    header_length: int
    data_start: int
    writer: str
    fingerprint: ModelFingerprint
    dtype: str
    num_layers: int
    kv_heads: int
    head_dims: tuple[int, ...]
    num_tokens: int  # tokens stored in the tensors (the longest layer's count)
    layer_tokens: tuple[int, ...]  # tokens each layer stores: its last ones of the num_tokens (spec section 4.2)
    num_context_tokens: int
    token_ids_sha256: str
    token_ids_blob: int | None
    positions_blob: int | None
    pipelines: list[Pipeline]
    codec: str | None
    attachments: dict[str, AttachmentInfo]
    blobs: list[BlobInfo]
    chunking: dict[str, Any]
    meta: dict[str, Any]
    raw: dict[str, Any] = field(repr=False)
    attention_bias: AttentionBias | None = None  # required feature bit 1 (spec section 4.6)

    @property
    def num_elements(self) -> int:
        return 2 * self.kv_heads * sum(t * d for t, d in zip(self.layer_tokens, self.head_dims))

    @property
    def ragged(self) -> bool:
        return min(self.layer_tokens) != self.num_tokens

    def layer_offset(self, layer: int) -> int:
        """Index, among the ``num_tokens`` stored tokens, of layer ``layer``'s first stored token."""
        return self.num_tokens - self.layer_tokens[layer]

    @property
    def pruned(self) -> bool:
        return self.positions_blob is not None


def _is_name(x: Any, names: Any) -> bool:
    return isinstance(x, str) and x in names


def _shape(x: Any, what: str) -> tuple[int, ...]:
    want(isinstance(x, list) and len(x) <= MAX_BLOB_NDIM and all(is_int(d, 0, (1 << 32) - 1) for d in x),
         f"{what}: shape must be a list of at most {MAX_BLOB_NDIM} dims in [0, 2^32)")
    return tuple(x)


def parse_header(obj: dict[str, Any], pre: Preamble) -> KvcHeader:
    """Validate header JSON (already CRC-checked) into a KvcHeader; every problem is a KvcFormatError."""
    h = "header"
    check_fingerprint_json(obj.get("model"), FINGERPRINT_VERSION)
    fp = ModelFingerprint.from_json(obj.get("model"))
    t = obj.get("tensors")
    want(isinstance(t, dict), f"{h}: 'tensors' must be an object")
    dtype = t.get("dtype")
    want(_is_name(dtype, TENSOR_DTYPES), f"{h}: tensor dtype {dtype!r:.40} is not one of {TENSOR_DTYPES}")
    hd = t.get("head_dims")
    want(is_int(t.get("layers")) and t["layers"] == fp.num_layers and is_int(t.get("kv_heads")) and t["kv_heads"] == fp.num_kv_heads
         and isinstance(hd, list) and all(is_int(d) for d in hd) and hd == list(fp.head_dims),
         f"{h}: tensor shapes disagree with the model fingerprint")
    T = t.get("tokens")
    want(is_int(T, 1, MAX_TOKENS), f"{h}: tensors.tokens must be an int in [1, {MAX_TOKENS}]")
    lt = t.get("layer_tokens")
    ragged = bool(pre.required_features & FEATURE_RAGGED)
    want((lt is not None) == ragged, f"{h}: tensors.layer_tokens must be present exactly when required feature bit 0 is set")
    if lt is None:
        layer_tokens = (T,) * fp.num_layers
    else:
        want(isinstance(lt, list) and len(lt) == fp.num_layers and all(is_int(x, 1, T) for x in lt),
             f"{h}: tensors.layer_tokens must be a list of {fp.num_layers} ints in [1, {T}]")
        want(min(lt) < T, f"{h}: tensors.layer_tokens must not all equal tensors.tokens ({T})")
        layer_tokens = tuple(lt)
    c = obj.get("context")
    want(isinstance(c, dict), f"{h}: 'context' must be an object")
    N = c.get("tokens")
    want(is_int(N, 0, MAX_TOKENS), f"{h}: context.tokens must be an int in [0, {MAX_TOKENS}]")
    sha = c.get("token_ids_sha256")
    want(isinstance(sha, str) and bool(_HEX64.match(sha)), f"{h}: context.token_ids_sha256 must be 64 hex digits")
    tb = c.get("token_ids_blob")
    want(tb is None or is_int(tb), f"{h}: context.token_ids_blob must be null or a blob number")
    p = obj.get("positions")
    want(p is None or (isinstance(p, dict) and is_int(p.get("blob"))), f"{h}: 'positions' must be null or {{\"blob\": n}}")
    pb = None if p is None else p["blob"]
    want(pb is None or lt is None, f"{h}: a file with tensors.layer_tokens cannot carry positions")
    want(pb is not None or N == T, f"{h}: {T} stored tokens but {N} context tokens and no positions")
    want(pb is None or T <= N, f"{h}: more stored tokens ({T}) than context tokens ({N})")
    ab = obj.get("attention_bias")
    want((ab is not None) == bool(pre.required_features & FEATURE_ATTENTION_BIAS) and (ab is None or pb is None),
         f"{h}: attention_bias must be present exactly when required feature bit 1 is set, and never with positions")
    bias = None if ab is None else AttentionBias.from_json(ab, fp.num_layers, N)

    pls = obj.get("pipelines")
    want(isinstance(pls, list) and 1 <= len(pls) <= MAX_PIPELINES, f"{h}: 'pipelines' must be a non-empty list")
    pipelines = []
    for i, pj in enumerate(pls):
        want(isinstance(pj, list) and 1 <= len(pj) <= MAX_STAGES, f"{h}: pipeline {i} must be a list of 1-{MAX_STAGES} stages")
        try:
            pipelines.append(_pipeline(pj))
        except KvcFormatError as exc:
            raise KvcFormatError(f"{h}: pipeline {i}: {exc}") from None
        except KvcCodecError as exc:
            raise KvcUnknownCodecError(f"{h}: pipeline {i}: {exc}") from None
        except Exception as exc:  # a stage constructor rejecting hostile config in its own way
            raise KvcFormatError(f"{h}: pipeline {i}: bad stage config: {type(exc).__name__}: {exc}") from None

    bl = obj.get("blobs", [])
    want(isinstance(bl, list) and len(bl) <= 4096, f"{h}: 'blobs' must be a list of at most 4096 entries")
    blobs = []
    for i, b in enumerate(bl):
        want(isinstance(b, dict), f"{h}: blob {i} must be an object")
        want(_is_name(b.get("dtype"), DTYPE_BY_NAME), f"{h}: blob {i} has unsupported dtype {b.get('dtype')!r:.40}")
        shape = _shape(b.get("shape"), f"{h}: blob {i}")
        n = math.prod(shape) * np.dtype(b["dtype"]).itemsize
        want(n <= MAX_BLOB_BYTES and is_int(b.get("length")) and b["length"] == n, f"{h}: blob {i} length {b.get('length')!r:.40} != {n} (or over the limit)")
        want(is_int(b.get("offset")) and is_int(b.get("crc32c"), 0, (1 << 32) - 1), f"{h}: blob {i} needs int offset and crc32c")
        blobs.append(BlobInfo(b["dtype"], shape, b["offset"], n, b["crc32c"]))

    at = obj.get("attachments", {})
    want(isinstance(at, dict), f"{h}: 'attachments' must be an object")
    attachments: dict[str, AttachmentInfo] = {}
    for name, a in at.items():
        want(check_blob_name(name) and isinstance(a, dict), f"{h}: bad attachment entry {name!r:.60}")
        asha = a.get("sha256")
        want(isinstance(asha, str) and bool(_HEX64.match(asha)), f"{h}: attachment {name!r} sha256 must be 64 hex digits")
        ext = a.get("external", False)
        want(isinstance(ext, bool), f"{h}: attachment {name!r} 'external' must be true or false")
        if ext:
            want(_is_name(a.get("dtype"), DTYPE_BY_NAME), f"{h}: attachment {name!r} has unsupported dtype")
            attachments[name] = AttachmentInfo(name, asha, a["dtype"], _shape(a.get("shape"), f"{h}: attachment {name!r}"), None)
        else:
            bi = a.get("blob")
            want(is_int(bi) and bi < len(blobs), f"{h}: attachment {name!r} refers to a missing blob")
            attachments[name] = AttachmentInfo(name, asha, blobs[bi].dtype, blobs[bi].shape, bi)

    refs = [r for r in [tb, pb] + [a.blob for a in attachments.values()] if r is not None]
    want(all(r < len(blobs) for r in refs), f"{h}: a blob reference points past the {len(blobs)} blobs")
    want(sorted(refs) == list(range(len(blobs))), f"{h}: every blob must be referenced exactly once")
    if tb is not None:
        want(blobs[tb].dtype in ("int32", "int64") and blobs[tb].shape == (N,), f"{h}: token id blob must be int32/int64 of shape ({N},)")
    if pb is not None:
        L, H = fp.num_layers, fp.num_kv_heads
        want(blobs[pb].dtype in ("int32", "int64") and blobs[pb].shape in ((T,), (L, H, T)),
             f"{h}: positions blob must be int32/int64 of shape ({T},) or ({L}, {H}, {T})")
    codec = obj.get("codec")
    want(codec is None or isinstance(codec, str), f"{h}: 'codec' must be null or a string")
    meta = obj.get("meta", {})
    want(isinstance(meta, dict), f"{h}: 'meta' must be an object")
    chunking = obj.get("chunking", {})
    want(isinstance(chunking, dict) and all(chunking.get(k) is None or is_int(chunking[k], 1) for k in ("tokens", "heads")),
         f"{h}: 'chunking' must be an object of null or positive int 'tokens' / 'heads'")
    writer = obj.get("writer", "")
    want(isinstance(writer, str), f"{h}: 'writer' must be a string")
    return KvcHeader(
        version=(pre.major, pre.minor), required_features=pre.required_features, optional_features=pre.optional_features,
        header_length=pre.header_length, data_start=data_start(pre.header_length),
        writer=writer, fingerprint=fp, dtype=dtype, num_layers=fp.num_layers,
        kv_heads=fp.num_kv_heads, head_dims=fp.head_dims, num_tokens=T, layer_tokens=layer_tokens, num_context_tokens=N, token_ids_sha256=sha,
        token_ids_blob=tb, positions_blob=pb, pipelines=pipelines, codec=codec, attachments=attachments, blobs=blobs,
        chunking=chunking, meta=meta, raw=obj, attention_bias=bias,
    )


_PIPELINES: BoundedLRU[Pipeline] = BoundedLRU(1024)


def _pipeline(pj: list) -> Pipeline:
    """``Pipeline.from_json``, memoised on the JSON's repr (a store reads the same few pipelines over and over;
    decoders never mutate a pipeline, so instances can be shared). ``repr`` tells 1, 1.0 and true apart."""
    key = repr(pj)
    hit = _PIPELINES.get(key)
    if hit is None:
        hit = Pipeline.from_json(pj)
        _PIPELINES.put(key, hit)
    return hit


def check_layout(hd: KvcHeader, entries: list[IndexEntry], index_offset: int) -> None:
    """Blobs then chunks, each at the next 64-byte boundary, chunks tiling every tensor in layer-major order."""
    data_len = index_offset - hd.data_start
    want(data_len >= 0, f"index (offset {index_offset}) starts inside the header")
    cur = 0
    for i, b in enumerate(hd.blobs):
        want(b.offset == cur, f"blob {i} at data offset {b.offset}, expected {cur} (blobs must be packed in order)")
        want(b.offset + b.length <= data_len, f"blob {i} ({b.length} bytes at data offset {b.offset}) runs past the data section")
        cur = align_up(b.offset + b.length)
    T, H, npl = hd.num_tokens, hd.kv_heads, len(hd.pipelines)
    itemsize = 2 if hd.dtype == "bfloat16" else np.dtype(hd.dtype).itemsize
    j, n, t1 = 0, len(entries), 0
    for layer in range(hd.num_layers):
        row = hd.head_dims[layer] * itemsize
        start = hd.layer_offset(layer)
        for kind in KINDS:
            t0, h0 = start, 0
            while True:  # hot loop: plain ifs, messages built only on failure
                if j >= n:
                    raise KvcFormatError(f"index ends before layer {layer} {kind.upper()} is complete (tokens from {t0}, heads from {h0})")
                e = entries[j]
                if e.layer != layer or e.kind != kind:
                    raise KvcFormatError(f"index entry {j}: is layer {e.layer} {e.kind.upper()}, expected layer {layer} {kind.upper()}")
                if e.token_start != t0 or e.head_start != h0:
                    raise KvcFormatError(f"index entry {j}: starts at token {e.token_start} head {e.head_start}, expected token {t0} head {h0}")
                if not (t0 < e.token_end <= T and h0 < e.head_end <= H) or (h0 > 0 and e.token_end != t1):
                    raise KvcFormatError(
                        f"index entry {j}: token range [{e.token_start}, {e.token_end}) / head range "
                        f"[{e.head_start}, {e.head_end}) does not tile the ({H}, {T}) tensor")
                if e.pipeline >= npl:
                    raise KvcFormatError(f"index entry {j}: pipeline {e.pipeline} does not exist ({npl} defined)")
                dec = (e.head_end - h0) * (e.token_end - t0) * row
                if dec > MAX_CHUNK_DECODED_BYTES:
                    raise KvcFormatError(f"index entry {j}: decodes to {dec} bytes, over the limit {MAX_CHUNK_DECODED_BYTES}")
                if e.offset != cur:
                    raise KvcFormatError(f"index entry {j}: at data offset {e.offset}, expected {cur} (chunks must be packed in index order)")
                if e.length > data_len - e.offset:
                    raise KvcFormatError(f"index entry {j}: {e.length} bytes at data offset {e.offset} run past the data section")
                cur = align_up(e.offset + e.length)
                j += 1
                t1 = e.token_end
                if e.head_end < H:
                    h0 = e.head_end
                    continue
                h0, t0 = 0, e.token_end
                if t0 == T:
                    break
    want(j == n, f"index has {n - j} entries beyond the last tensor")
    want(cur == data_len, f"data section is {data_len} bytes but its contents end at {cur}")
