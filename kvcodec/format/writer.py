"""Streaming `.kvc` writer: header first, then blobs and chunks, index + footer last.

Memory stays constant in the size of the cache apart from one chunk in
flight and 48 bytes of index per chunk. Writing to a path goes to a temp file
in the same directory, is fsynced and renamed over the destination, so a
failing writer never leaves a partial file there.
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any, BinaryIO

import google_crc32c
import numpy as np

from kvcodec.digest import array_sha256
from kvcodec.atomic import atomic_file
from kvcodec.errors import KvcCodecError, KvcInputError
from kvcodec.digest import token_ids_sha256
from kvcodec.core.dtypes import is_bf16, tensor_dtype
from kvcodec.core.stage import (
    EncoderInputsSpec, ExternalAttachment, PipelineSpec, Plan, chunk_context, chunk_ranges, pipeline_table,
)
from kvcodec.format.bias import AttentionBias
from kvcodec.format.readback import Expectation, ReadBackErrors
from kvcodec.format.container import (
    ALIGN, DTYPE_BY_NAME, FEATURE_ATTENTION_BIAS, FEATURE_RAGGED, FOOTER_SIZE, MAX_BLOB_BYTES, MAX_BLOB_NDIM, MAX_CHUNK_DECODED_BYTES, MAX_PIPELINES,
    MAX_STAGES, MAX_TOKENS, STAGE_SLACK, VERSION_MAJOR, VERSION_MINOR, Footer, IndexEntry, Preamble, align_up,
    check_blob_name, crc32c, dump_header, np_le, pack_chunk, pipeline_dtype,
)

if TYPE_CHECKING:  # the writer takes a KVCache (torch tensors), but importing the container must not import torch
    from kvcodec.core.kvcache import KVCache

# stages whose encoder needs per-tensor inputs (WriteOptions.encoder_inputs): writing them without any is refused
ENCODER_INPUT_STAGES = frozenset({"tokenscale"})


def writer_version() -> str:
    from kvcodec.version import __version__

    return f"kvcodec {__version__}"


@dataclass(frozen=True)
class WriteOptions:
    """Everything the writer entry points take besides the cache, the destination and the pipelines.

    ``attachments``: name -> array (stored) or :class:`ExternalAttachment` (referenced);
    ``chunk_tokens`` / ``chunk_heads``: chunk layout (None: whole tensor); ``preset``: the
    header's codec name; ``meta``: merged over the cache's meta; ``store_token_ids``: keep the
    context's token ids in the file; ``writer``: the header's writer string (default: this
    package's version); ``encoder_inputs``: (layer, kind) -> that tensor's encoder-only inputs
    (:data:`kvcodec.core.stage.EncoderInputs`), passed to its chunks in ``ChunkContext.encoder``;
    ``attention_bias``: the bias a loader must apply (spec section 4.6; sets required feature bit 1).
    """

    attachments: Mapping[str, np.ndarray | ExternalAttachment] | None = None
    chunk_tokens: int | None = None
    chunk_heads: int | None = None
    preset: str | None = None
    meta: Mapping[str, Any] | None = None
    store_token_ids: bool = True
    writer: str | None = None
    encoder_inputs: EncoderInputsSpec | None = None
    attention_bias: AttentionBias | None = None


#: Read-back policies of the writer's verifying entry points: ``"file"`` reads the written bytes back through
#: the reader (structure, every CRC, every chunk decoded and compared bit for bit with what the encoder's own
#: output decodes to) before they count as written; ``"off"`` writes without reading back (probes whose
#: output is decoded right away and never stored).
VERIFY_POLICIES = ("file", "off")


def plan_options(plan: Plan | PipelineSpec, options: WriteOptions | None, kw: dict[str, Any]) -> tuple[PipelineSpec, WriteOptions]:
    """The pipelines and options that encode ``plan``: the plan's attachments, preset, layout and encoder inputs,
    then ``options``, then the entry point's keyword arguments on top (a misspelt name is a TypeError).

    A bare pipeline (or a ``(layer, kind) -> Pipeline`` function) is the plan of just that pipeline.
    """
    if not isinstance(plan, Plan):
        plan = Plan(plan)
    opts = WriteOptions(attachments=plan.attachments or None, preset=plan.preset, chunk_tokens=plan.chunk_tokens,
                        encoder_inputs=plan.encoder_inputs)
    if options is not None:
        opts = replace(opts, **{f.name: getattr(options, f.name) for f in fields(WriteOptions)
                                if getattr(options, f.name) != getattr(WriteOptions(), f.name)})
    return plan.pipelines, replace(opts, **kw) if kw else opts


def _check_verify(verify: str) -> None:
    if verify not in VERIFY_POLICIES:
        raise KvcInputError(f"verify must be one of {', '.join(VERIFY_POLICIES)}, got {verify!r}")


def _small_int_array(a: np.ndarray) -> np.ndarray:
    a = np.asarray(a, dtype=np.int64)
    if a.size == 0 or (a.min() >= -(1 << 31) and a.max() < (1 << 31)):
        return a.astype(np.int32)
    return a


class _Sink:
    """Counts bytes and position while writing sequentially."""

    def __init__(self, f: BinaryIO) -> None:
        self.f = f
        self.pos = 0

    def write(self, b: bytes | memoryview) -> None:
        n = len(b)
        self.f.write(b)
        self.pos += n

    def pad(self) -> None:
        n = align_up(self.pos) - self.pos
        if n:
            self.write(bytes(n))


def _check_array_blob(name: str, arr: np.ndarray) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype.kind not in "uif" or arr.dtype.name not in DTYPE_BY_NAME:
        raise KvcInputError(f"attachment {name!r} has unsupported dtype {arr.dtype}")
    if arr.ndim > MAX_BLOB_NDIM or arr.nbytes > MAX_BLOB_BYTES:
        raise KvcInputError(f"attachment {name!r} has shape {arr.shape}: at most {MAX_BLOB_NDIM} dims and {MAX_BLOB_BYTES} bytes")
    return np.ascontiguousarray(arr, dtype=np_le(arr.dtype.name))


def write_kvc_stream(cache: KVCache, f: BinaryIO, plan: Plan | PipelineSpec, options: WriteOptions | None = None,
                     **kw: Any) -> int:
    """Write ``cache`` as `.kvc` under ``plan`` to the binary stream ``f`` (sequential writes only); return bytes written.

    The low-level, *unverified* writer (a pipe cannot be read back): :func:`write_kvc`
    and :func:`encode_kvc_bytes` verify what they wrote. ``kw`` are :class:`WriteOptions`
    fields, applied over ``options``.
    """
    pipelines, opts = plan_options(plan, options, kw)
    return _write(cache, f, pipelines, opts, None)


def _write(cache: KVCache, f: BinaryIO, pipelines: PipelineSpec, opts: WriteOptions, expect: "Expectation | None") -> int:
    """The writer; with ``expect``, also records what every chunk must decode to (see :class:`~kvcodec.format.readback.Expectation`)."""
    attachments, chunk_tokens, chunk_heads, meta = opts.attachments, opts.chunk_tokens, opts.chunk_heads, opts.meta
    cache.validate()
    fp = cache.fingerprint
    T, H, L = cache.num_tokens, fp.num_kv_heads, fp.num_layers
    tdtype = tensor_dtype(cache)
    if T > MAX_TOKENS or cache.num_context_tokens > MAX_TOKENS:
        raise KvcInputError(f"caches of more than {MAX_TOKENS} tokens cannot be stored")
    for name, v in (("chunk_tokens", chunk_tokens), ("chunk_heads", chunk_heads)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise KvcInputError(f"{name} must be a positive integer, got {v!r}")
    h_ranges = chunk_ranges(H, chunk_heads)
    # layer i's chunks tile its stored tokens [T - layer_tokens[i], T) in the sequence's coordinates (spec §4.2)
    offsets = [cache.layer_offset(i) for i in range(L)]
    t_ranges = [[(a + off, b + off) for a, b in chunk_ranges(T - off, chunk_tokens)] for off in offsets]
    itemsize = 2 if tdtype == "bfloat16" else np.dtype(tdtype).itemsize
    biggest = max(h1 - h0 for h0, h1 in h_ranges) * max(t1 - t0 for r in t_ranges for t0, t1 in r) * max(fp.head_dims) * itemsize
    if biggest > MAX_CHUNK_DECODED_BYTES:
        raise KvcInputError(f"a chunk would hold {biggest} bytes (limit {MAX_CHUNK_DECODED_BYTES}); use chunk_tokens")
    table, pid = pipeline_table(pipelines, L, max_stages=MAX_STAGES, max_pipelines=MAX_PIPELINES)
    if opts.encoder_inputs is None and any(s.name in ENCODER_INPUT_STAGES for p in table for s in p.stages):
        # a plan's per-layer inputs dropped on the way (its pipelines passed without the plan) would encode
        # every token alike and lose quality silently
        raise KvcCodecError("a pipeline has a tokenscale stage but no encoder inputs were given: "
                            "pass the Plan itself (or encoder_inputs=)")
    merged_meta = dict(cache.meta)
    merged_meta.update(meta or {})

    # -- blobs (sizes known up front, so the header can hold their offsets) --
    blob_arrays: list[np.ndarray] = []
    header_blobs: list[dict[str, Any]] = []

    def add_blob(arr: np.ndarray) -> int:
        arr = np.ascontiguousarray(arr, dtype=np_le(arr.dtype.name))
        blob_arrays.append(arr)
        header_blobs.append({"dtype": arr.dtype.name, "shape": list(arr.shape), "length": arr.nbytes})
        return len(blob_arrays) - 1

    context: dict[str, Any] = {
        "tokens": cache.num_context_tokens,
        "token_ids_sha256": token_ids_sha256(cache.token_ids),
        "token_ids_blob": add_blob(_small_int_array(cache.token_ids)) if opts.store_token_ids else None,
    }
    positions = None if cache.positions is None else np.asarray(cache.positions, dtype=np.int64)
    pos_entry = None if positions is None else {"blob": add_blob(_small_int_array(positions))}
    att_header: dict[str, Any] = {}
    att_arrays: dict[str, np.ndarray] = {}
    # what the encoder sees in ChunkContext.attachments: the stored arrays and the external ones it was
    # given (a reader resolves those by sha256 and decodes with the same arrays)
    enc_arrays: dict[str, np.ndarray] = {}
    for name in sorted(attachments or {}):
        if not check_blob_name(name):
            raise KvcInputError(f"attachment name {name!r} must be 1-128 chars of [A-Za-z0-9_.-/]")
        a = (attachments or {})[name]
        if isinstance(a, ExternalAttachment):
            if a.array is not None:
                enc_arrays[name] = a.array
                if expect is not None:
                    expect.external[name] = a.array
            att_header[name] = {"external": True, "sha256": a.sha256, "dtype": a.dtype, "shape": list(a.shape)}
            continue
        arr = _check_array_blob(name, a)
        att_arrays[name] = enc_arrays[name] = arr.astype(arr.dtype.newbyteorder("="), copy=False)
        att_header[name] = {"blob": add_blob(arr), "sha256": array_sha256(arr)}
    off = 0
    for hb, arr in zip(header_blobs, blob_arrays):
        hb["offset"] = off
        hb["crc32c"] = crc32c(arr.tobytes())
        off = align_up(off + arr.nbytes)
    first_chunk_offset = off

    header = {
        "writer": opts.writer or writer_version(),
        "model": fp.to_json(),
        "tensors": {"dtype": tdtype, "layers": L, "kv_heads": H, "head_dims": list(fp.head_dims), "tokens": T,
                    **({"layer_tokens": list(cache.layer_tokens)} if cache.ragged else {})},
        "context": context,
        "positions": pos_entry,
        "pipelines": [p.to_json() for p in table],
        "codec": opts.preset,
        "chunking": {"tokens": chunk_tokens, "heads": chunk_heads},
        "attachments": att_header,
        "blobs": header_blobs,
        "meta": merged_meta,
    }
    required = FEATURE_RAGGED if cache.ragged else 0
    if opts.attention_bias is not None:
        if cache.positions is not None:
            raise KvcInputError("an attention bias cannot be stored with a pruned cache (its key ranges are positions)")
        # the reader's own checks, so a file it would refuse is never written
        header["attention_bias"] = AttentionBias.from_json(opts.attention_bias.to_json(), L, cache.num_context_tokens).to_json()
        required |= FEATURE_ATTENTION_BIAS
    hbytes = dump_header(header)
    pre = Preamble(VERSION_MAJOR, VERSION_MINOR, len(hbytes), required, 0).pack()
    out = _Sink(f)
    out.write(pre)
    out.write(hbytes)
    out.write(crc32c(pre + hbytes).to_bytes(4, "little"))
    out.pad()
    dstart = out.pos
    for arr in blob_arrays:
        out.write(arr.tobytes())
        out.pad()
    assert out.pos - dstart == first_chunk_offset

    # -- chunks, layer-major ------------------------------------------------
    entries: list[IndexEntry] = []
    for layer in range(L):
        for kind, tensor in (("k", cache.keys[layer]), ("v", cache.values[layer])):
            p = table[pid[(layer, kind)]]
            inputs = opts.encoder_inputs(layer, kind) if opts.encoder_inputs is not None else {}
            t = tensor.detach().cpu()
            if is_bf16(t):
                t = t.float()
            full = t.contiguous().numpy()
            off = offsets[layer]
            for t0, t1 in t_ranges[layer]:
                for h0, h1 in h_ranges:
                    j = len(entries)
                    arr = np.ascontiguousarray(full[h0:h1, t0 - off:t1 - off, :])
                    assert arr.dtype.name == pipeline_dtype(tdtype)
                    ctx = chunk_context(layer, kind, t0, t1, h0, h1, positions, enc_arrays, j, inputs)
                    payload, sides, sizes = p.encode(arr, ctx)
                    limit = 2 * arr.size * itemsize + STAGE_SLACK
                    if any(s > limit for s in sizes):
                        raise KvcCodecError(f"chunk {j}: an intermediate byte string of {max(sizes)} bytes exceeds the limit {limit}")
                    parts = pack_chunk(bytes(payload), sides, sizes)
                    if expect is not None:
                        expect.add(p, arr, payload, sides, sizes, ctx)
                    crc = 0
                    start = out.pos
                    for part in parts:
                        crc = google_crc32c.extend(crc, part)
                        out.write(part)
                    entries.append(IndexEntry(layer, kind, pid[(layer, kind)], t0, t1, h0, h1, start - dstart, out.pos - start, crc))
                    out.pad()

    # -- index + footer -----------------------------------------------------
    index_offset = out.pos
    index = b"".join(e.pack() for e in entries)
    out.write(index)
    out.write(Footer(index_offset, len(entries), crc32c(index)).pack())
    assert (out.pos - FOOTER_SIZE - len(index)) % ALIGN == 0
    return out.pos


def write_kvc(cache: KVCache, dest: str | os.PathLike | BinaryIO, plan: Plan | PipelineSpec,
              options: WriteOptions | None = None, *, verify: str = "file",
              errors: ReadBackErrors | None = None, **kw: Any) -> int:
    """Write ``cache`` under ``plan`` to ``dest`` (a path, atomically, or a binary file object). Returns bytes written.

    ``kw`` are :class:`WriteOptions` fields, applied over ``options`` over the plan's own. ``verify``
    is the read-back policy (:data:`VERIFY_POLICIES`; default ``"file"``): for a path, the temp file
    is read and decoded bit-exactly (see :class:`~kvcodec.format.readback.Expectation`) *before* the atomic rename, so a file
    the reader would reject never appears at ``dest``; a file object is read back when it is
    readable and seekable (e.g. ``BytesIO``), otherwise it cannot be. ``errors``, when given, receives what the
    read-back measured of each lossy (layer, K/V)'s decoded error (:class:`~kvcodec.format.readback.ReadBackErrors`;
    ``read`` stays False when nothing was read back).
    """
    _check_verify(verify)
    pipelines, opts = plan_options(plan, options, kw)
    if not isinstance(dest, (str, os.PathLike)):
        try:
            readable = verify == "file" and _readable(dest)
            start = dest.tell() if readable else 0
            expect = Expectation(cache) if readable else None
            n = _write(cache, dest, pipelines, opts, expect)
            if expect is not None:
                end = dest.tell()
                dest.seek(start)
                data = dest.read(n)
                dest.seek(end)
                expect.check(data, cache, "output stream")
                _hand_over(expect, errors)
        except OSError as exc:  # a file object on a full disk escaped as a raw OSError
            from kvcodec.atomic import io_error

            raise io_error(exc, "cannot write the output stream") from None
        return n
    # atomic_path refuses outputs that are not regular files or lack a directory, and renames
    # only on a clean exit: a file that fails the read-back never appears at ``dest``.
    expect = Expectation(cache) if verify == "file" else None
    with atomic_file(dest, "wb") as f:
        n = _write(cache, f, pipelines, opts, expect)  # type: ignore[arg-type]  # atomic_file("wb") is binary
        if expect is not None:
            f.flush()
            expect.check(f.name, cache, str(dest))  # the temp file, still unrenamed
    _hand_over(expect, errors)
    return n


def _hand_over(expect: Expectation | None, errors: ReadBackErrors | None) -> None:
    """What the read-back measured, to the caller that asked (after the check passed: a failed one raised)."""
    if expect is not None and errors is not None:
        errors.read, errors.layers = True, dict(expect.errors)


def _readable(f: Any) -> bool:
    try:
        return bool(f.readable() and f.seekable())
    except (AttributeError, OSError, ValueError):
        return False


def encode_kvc_bytes(cache: KVCache, plan: Plan | PipelineSpec, options: WriteOptions | None = None, *,
                     verify: str = "file", errors: ReadBackErrors | None = None, **kw: Any) -> bytes:
    """The `.kvc` bytes of ``cache`` under ``plan`` (same arguments as :func:`write_kvc`; verified the same way)."""
    _check_verify(verify)
    pipelines, opts = plan_options(plan, options, kw)
    buf = io.BytesIO()
    expect = Expectation(cache) if verify == "file" else None
    _write(cache, buf, pipelines, opts, expect)
    data = buf.getvalue()
    if expect is not None:
        expect.check(data, cache, "encoded bytes")
    _hand_over(expect, errors)
    return data
