"""`.kvc` reader: validates the whole structure on open, decodes on demand.

Opening reads the preamble, the footer + index (one read at the end of the
file), and the header; it checks their CRC32Cs and the complete layout (every
blob and chunk inside the data section, in order, without holes or overlaps,
chunks tiling every (layer, K/V) tensor exactly) before anything is decoded.
Chunks are read and CRC-checked one at a time, so reading layer 0 of a file
on a ranged source touches only layer 0's bytes.

The header's meaning and the layout checks that run before any decode are :mod:`kvcodec.format.header`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

import numpy as np

from kvcodec.calibration.store import default_resolver
from kvcodec.digest import array_sha256
from kvcodec.errors import KvcError, KvcFormatError, KvcInputError, is_int
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.dtypes import f32_to_bf16
from kvcodec.digest import token_ids_sha256
from kvcodec.core.stage import ArraySpec, chunk_context
from kvcodec.format.container import (
    FOOTER_SIZE, HEADER_CRC_SIZE, INDEX_ENTRY_SIZE, MAX_CHUNK_DECODED_BYTES, PREAMBLE_SIZE, STAGE_SLACK, Footer, IndexEntry, Preamble, align_up, crc32c,
    data_start, load_header, np_le, parse_chunk, parse_index, pipeline_dtype,
)
from kvcodec.limits import check_declared, max_decoded_bytes as max_decoded_bytes_limit, max_decoded_ratio as max_ratio_limit
from kvcodec.decode.device import resolve_device
from kvcodec.decode.registry import decode_chunk
from kvcodec.core.source import open_source
from kvcodec.format.header import AttachmentInfo, check_layout, parse_header

if TYPE_CHECKING:  # torch only where tensors are made: opening a file, its header and its chunks need none
    import torch

    from kvcodec.core.kvcache import KVCache

Resolver = Mapping[str, np.ndarray] | Callable[[str, "AttachmentInfo"], "np.ndarray | None"]
_TAIL_READ = 1 << 16

class KvcReader:
    """Random access to a `.kvc` file. ``source``: bytes, path, binary file, or object with size + read(offset, length)."""

    def __init__(self, source: Any, attachment_resolver: Resolver | None = None, max_decoded_bytes: int | None = None,
                 max_decoded_ratio: float | None = None, max_chunk_bytes: int | None = None) -> None:
        """``attachment_resolver`` finds external attachments; default: the per-model calibration store.
        ``max_decoded_bytes`` caps the total output the header may declare (default: :func:`kvcodec.limits.max_decoded_bytes`),
        ``max_decoded_ratio`` the same relative to the source's size (default: :func:`kvcodec.limits.max_decoded_ratio`;
        0: none), ``max_chunk_bytes`` one chunk's decoded size (default: the format's 2^32). All are checked
        when the header and index are parsed, before anything is decoded; decoding holds one chunk at a
        time, so they bound what reading the file can allocate (spec/kvc-v1.md §9)."""
        self._max_decoded = max_decoded_bytes_limit(max_decoded_bytes)
        self._max_ratio = max_ratio_limit(max_decoded_ratio)
        if max_chunk_bytes is not None and (isinstance(max_chunk_bytes, bool) or not isinstance(max_chunk_bytes, int)
                                            or max_chunk_bytes <= 0):
            raise KvcInputError(f"max_chunk_bytes must be a positive integer, got {max_chunk_bytes!r}")
        self._max_chunk = MAX_CHUNK_DECODED_BYTES if max_chunk_bytes is None else min(max_chunk_bytes,
                                                                                       MAX_CHUNK_DECODED_BYTES)
        if attachment_resolver is not None and not (isinstance(attachment_resolver, Mapping) or callable(attachment_resolver)):
            raise KvcInputError("attachment_resolver must be a mapping of name -> array or a callable, got "
                                f"{type(attachment_resolver).__name__}")
        self._src = open_source(source)
        self._resolver = attachment_resolver or default_resolver
        self._attachments: dict[str, np.ndarray] | None = None
        self._token_ids: np.ndarray | None = None
        self._positions: np.ndarray | None = None
        try:
            self._open()
        except BaseException:
            self._src.close()
            raise

    def _open(self) -> None:
        src, size = self._src, self._src.size
        pre = Preamble.unpack(src.read(0, min(size, PREAMBLE_SIZE)), size)
        if size < PREAMBLE_SIZE + FOOTER_SIZE:
            raise KvcFormatError(f"file of {size} bytes is too short to be a .kvc file")
        # one ranged read at the end fetches footer and (usually) the whole index
        tail_len = min(size, _TAIL_READ)
        tail = src.read(size - tail_len, tail_len)
        footer = Footer.unpack(tail[tail_len - FOOTER_SIZE :], size)
        ilen = footer.entry_count * INDEX_ENTRY_SIZE
        if ilen + FOOTER_SIZE <= tail_len:
            ibytes = tail[tail_len - FOOTER_SIZE - ilen : tail_len - FOOTER_SIZE]
        else:
            ibytes = src.read(footer.index_offset, ilen)
        entries = parse_index(ibytes, footer, footer.index_offset)
        hlen = pre.header_length
        hb = src.read(0, PREAMBLE_SIZE + hlen + HEADER_CRC_SIZE)
        stored = int.from_bytes(bytes(hb[PREAMBLE_SIZE + hlen :]), "little")
        if crc32c(bytes(hb[: PREAMBLE_SIZE + hlen])) != stored:
            raise KvcFormatError(f"header CRC32C mismatch (CRC at offset {PREAMBLE_SIZE + hlen})")
        if data_start(hlen) > footer.index_offset:
            raise KvcFormatError(f"header (length {hlen}) overlaps the index at offset {footer.index_offset}")
        self.header = parse_header(load_header(hb[PREAMBLE_SIZE : PREAMBLE_SIZE + hlen]), pre)
        self.declared_bytes = self.header.num_elements * np.dtype(pipeline_dtype(self.header.dtype)).itemsize
        check_declared(self.declared_bytes, size, max_bytes=self._max_decoded, max_ratio=self._max_ratio)
        check_layout(self.header, entries, footer.index_offset)
        if self._max_chunk < MAX_CHUNK_DECODED_BYTES:
            item = np.dtype(pipeline_dtype(self.header.dtype)).itemsize
            hd = self.header.head_dims
            for j, e in enumerate(entries):
                n = e.heads * e.tokens * hd[e.layer] * item
                if n > self._max_chunk:
                    raise KvcFormatError(f"chunk {j} decodes to {n:,} bytes, over the limit of {self._max_chunk:,} "
                                         "(write smaller chunks: chunk_tokens)")
        self.entries = entries
        self.footer = footer
        self.size = size
        self._by_tensor: dict[tuple[int, str], list[int]] = {}
        for j, e in enumerate(entries):
            self._by_tensor.setdefault((e.layer, e.kind), []).append(j)

    # -- lifecycle ----------------------------------------------------------
    def close(self) -> None:
        self._src.close()

    def __enter__(self) -> "KvcReader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- metadata -----------------------------------------------------------
    @property
    def fingerprint(self) -> ModelFingerprint:
        return self.header.fingerprint

    @property
    def num_layers(self) -> int:
        return self.header.num_layers

    @property
    def num_chunks(self) -> int:
        return len(self.entries)

    def _read_blob(self, i: int, what: str) -> np.ndarray:
        b = self.header.blobs[i]
        at = self.header.data_start + b.offset
        raw = self._src.read(at, b.length)
        if crc32c(raw) != b.crc32c:
            raise KvcFormatError(f"{what} (blob {i}, offset {at}) CRC32C mismatch")
        dt = np_le(b.dtype)
        return np.frombuffer(raw, dtype=dt).astype(dt.newbyteorder("="), copy=True).reshape(b.shape)

    @property
    def token_ids(self) -> np.ndarray | None:
        """Context token ids (int64), or None when the file stores only their count and hash."""
        hd = self.header
        if hd.token_ids_blob is None:
            return None
        if self._token_ids is None:
            ids = self._read_blob(hd.token_ids_blob, "token ids").astype(np.int64)
            if token_ids_sha256(ids) != hd.token_ids_sha256:
                raise KvcFormatError("token ids do not match context.token_ids_sha256")
            self._token_ids = ids
        return self._token_ids

    @property
    def positions(self) -> np.ndarray | None:
        """Original positions of the stored tokens (int64, (T,) or (layers, kv_heads, T)), None if not pruned."""
        hd = self.header
        if hd.positions_blob is None:
            return None
        if self._positions is None:
            p = self._read_blob(hd.positions_blob, "positions").astype(np.int64)
            if p.size and (p.min() < 0 or p.max() >= hd.num_context_tokens):
                raise KvcFormatError(f"positions point outside the {hd.num_context_tokens}-token context")
            self._positions = p
        return self._positions

    @property
    def attachments(self) -> dict[str, np.ndarray]:
        """All attachments, internal ones read and CRC-checked, external ones resolved; cached."""
        if self._attachments is None:
            out = {}
            for name, a in self.header.attachments.items():
                arr = self._read_blob(a.blob, f"attachment {name!r}") if a.blob is not None else self._resolve(a)
                if array_sha256(arr) != a.sha256:
                    raise KvcFormatError(f"attachment {name!r} does not match its sha256")
                out[name] = arr
            self._attachments = out
        return self._attachments

    def _resolve(self, a: AttachmentInfo) -> np.ndarray:
        r = self._resolver
        arr = None
        if r is None:
            raise KvcFormatError(f"external attachment {a.name!r} (sha256 {a.sha256[:16]}...) needed but no attachment resolver was given")
        if callable(r) and not isinstance(r, Mapping):
            arr = r(a.name, a)
        else:
            arr = r.get(a.name, r.get(a.sha256))
        if arr is None:
            raise KvcFormatError(f"external attachment {a.name!r} (sha256 {a.sha256[:16]}...) could not be resolved")
        arr = np.asarray(arr)
        if arr.dtype.name != a.dtype or tuple(arr.shape) != a.shape:
            raise KvcFormatError(f"external attachment {a.name!r}: resolved {arr.dtype}{arr.shape}, file expects {a.dtype}{a.shape}")
        return arr

    # -- decoding -----------------------------------------------------------
    def chunk_info(self, j: int) -> IndexEntry:
        if not is_int(j, 0, len(self.entries) - 1):
            raise KvcInputError(f"chunk {j!r} does not exist (file has {len(self.entries)})")
        return self.entries[j]

    def read_chunk_record(self, j: int) -> bytes | memoryview:
        """The CRC-checked bytes of chunk ``j``."""
        e = self.chunk_info(j)
        at = self.header.data_start + e.offset
        raw = self._src.read(at, e.length)
        if crc32c(raw) != e.crc32c:
            raise KvcFormatError(f"chunk {j} (layer {e.layer} {e.kind.upper()}, offset {at}) CRC32C mismatch")
        return raw

    def read_chunk(self, j: int, backend: str | None = None) -> Any:
        """Decode chunk ``j`` to an array of shape (heads, tokens, head_dim) on the device ``backend`` resolves
        to: a numpy array on the CPU, a torch tensor on the GPU.

        The dtype is the pipeline dtype: the tensor dtype, except bfloat16
        which comes back as (exactly equal) float32.
        """
        return decode_chunk(*self.chunk_inputs(j), backend)

    def chunk_inputs(self, j: int) -> tuple[Any, Any, list[Any], list[int], ArraySpec, Any]:
        """Chunk ``j`` as a decoder backend takes it: (pipeline, payload, side data, stage sizes, spec, context).

        Its record is CRC-checked and its declared stage sizes bounded here, so the
        conformance harness and benchmarks feed backends exactly what :meth:`read_chunk` does.
        """
        e = self.chunk_info(j)
        hd = self.header
        pipeline = hd.pipelines[e.pipeline]
        raw = self.read_chunk_record(j)
        payload, sides, sizes = parse_chunk(raw, len(pipeline.stages), len(pipeline.byte_stages), j)
        spec = ArraySpec((e.heads, e.tokens, hd.head_dims[e.layer]), pipeline_dtype(hd.dtype))
        itemsize = 2 if hd.dtype == "bfloat16" else np.dtype(hd.dtype).itemsize
        limit = 2 * e.heads * e.tokens * hd.head_dims[e.layer] * itemsize + STAGE_SLACK
        for s in sizes:
            if s > limit:
                raise KvcFormatError(f"chunk {j}: declared stage size {s} exceeds the limit {limit}")
        ctx = chunk_context(e.layer, e.kind, e.token_start, e.token_end, e.head_start, e.head_end,
                            self.positions, self.attachments, j)
        return pipeline, payload, sides, sizes, spec, ctx

    def _read_tensor(self, layer: int, kind: str, backend: str | None) -> torch.Tensor:
        """One tensor, assembled where its chunks were decoded: numpy chunks (CPU) into a CPU tensor, torch chunks
        (the GPU) with torch on their device, never through the host (the device contract of decode_chunk)."""
        import torch

        js = self._by_tensor[(layer, kind)]
        decoded = [(self.entries[j], self.read_chunk(j, backend)) for j in js]
        on_device = not isinstance(decoded[0][1], np.ndarray)
        cat: Any = torch.cat if on_device else np.concatenate
        rows: list[Any] = []
        group: list[Any] = []
        for e, arr in decoded:  # head groups of one token range, then the next token range
            group.append(arr)
            if e.head_end == self.header.kv_heads:
                rows.append(group[0] if len(group) == 1 else cat(group, axis=0))
                group = []
        full = rows[0] if len(rows) == 1 else cat(rows, axis=1)
        t = full.contiguous() if on_device else torch.from_numpy(np.ascontiguousarray(full))
        return f32_to_bf16(t) if self.header.dtype == "bfloat16" else t

    def read_layer(self, i: int, backend: str | None = None, apply_bias: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of layer ``i``, (kv_heads, tokens, head_dim) in the original dtype.

        A file with an attention bias (spec section 4.6) is refused unless the caller applies it
        (``apply_bias``): the K/V without their bias are not the cache the file describes."""
        if self.header.attention_bias is not None and not apply_bias:
            raise KvcFormatError("this file carries an attention bias (required feature bit 1, spec/kvc-v1.md 4.6) "
                                 "that this loader does not apply; load it with the HF loader (kvcodec.integrations.hf)")
        if not is_int(i, 0, self.header.num_layers - 1):
            raise KvcInputError(f"layer {i!r} does not exist (file has {self.header.num_layers})")
        backend = resolve_device(backend)
        return self._read_tensor(i, "k", backend), self._read_tensor(i, "v", backend)

    def iter_layers(self, backend: str | None = None) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """Yield (layer, keys, values) in file order, reading each layer's chunks only when reached."""
        for i in range(self.header.num_layers):
            k, v = self.read_layer(i, backend)
            yield i, k, v

    def check_model(self, model: Any) -> None:
        """Raise KvcModelMismatchError unless ``model`` (LoadedModel or ModelFingerprint) is this file's model."""
        fp = model if isinstance(model, ModelFingerprint) else getattr(model, "fingerprint", None)
        if not isinstance(fp, ModelFingerprint):  # model=3 escaped as AttributeError
            raise KvcInputError(f"model must be a loaded model or a ModelFingerprint, got {type(model).__name__}")
        fp.check_compatible(self.fingerprint, what=".kvc file")  # the model's view: "<x> in the .kvc file, <y> in the model"

    def read_cache(self, backend: str | None = None, model: Any = None, token_ids: np.ndarray | None = None) -> KVCache:
        """The whole cache. ``model`` (if given) is checked first; ``token_ids`` supplies ids the file omits."""
        if model is not None:
            self.check_model(model)
        from kvcodec.core.kvcache import KVCache, as_token_ids

        ids = self.token_ids
        if ids is None:
            if token_ids is None:
                raise KvcInputError("this file stores only the hash of its token ids; pass token_ids=")
            ids = as_token_ids(token_ids, "token_ids", allow_empty=False)
            if token_ids_sha256(ids) != self.header.token_ids_sha256:
                raise KvcInputError("the given token ids do not match the file's token_ids_sha256")

        keys, values = [], []
        for _, k, v in self.iter_layers(backend):
            keys.append(k)
            values.append(v)
        return KVCache(keys, values, ids, self.fingerprint, self.positions, dict(self.header.meta))

    # -- integrity ----------------------------------------------------------
    def _gaps(self) -> list[tuple[int, int]]:
        hd = self.header
        gaps = [(PREAMBLE_SIZE + hd.header_length + HEADER_CRC_SIZE, hd.data_start)]
        ends = [(b.offset + b.length) for b in hd.blobs] + [(e.offset + e.length) for e in self.entries]
        for end in ends:
            gaps.append((hd.data_start + end, hd.data_start + align_up(end)))
        return [(a, b) for a, b in gaps if b > a]

    def verify(self, strict: bool = False, backend: str | None = None,
               expected: "list[Callable[[np.ndarray], bool]] | None" = None) -> list[str]:
        """Check every CRC, padding byte, blob and chunk (decoding each). Returns problems; ``strict`` raises the first.

        ``expected`` (the writer's read-back check): per chunk, a predicate its
        decoded array must satisfy (bit equality with what was encoded).
        """
        problems: list[str] = []
        # a backend that cannot be used is the caller's problem, not the file's: raised, never listed as one of
        # its problems (`kvc verify --backend gpu` without CUDA said every chunk of a good file was bad)
        resolve_device(backend)
        if expected is not None and len(expected) != len(self.entries):
            raise KvcFormatError(f"file has {len(self.entries)} chunks, {len(expected)} were written")

        def chunk(j: int) -> None:
            arr = self.read_chunk(j, backend)
            if expected is not None and not expected[j](arr):
                raise KvcFormatError(f"chunk {j} decodes to different values than were encoded")

        def check(fn: Callable[[], Any]) -> None:
            try:
                fn()
            except KvcError as exc:
                if strict:
                    raise
                problems.append(str(exc))

        for a, b in self._gaps():
            def pad(a: int = a, b: int = b) -> None:
                if any(bytes(self._src.read(a, b - a))):
                    raise KvcFormatError(f"non-zero padding in bytes [{a}, {b})")
            check(pad)
        check(lambda: self.token_ids)
        check(lambda: self.positions)
        check(lambda: self.attachments)
        for j in range(len(self.entries)):
            check(lambda j=j: chunk(j))
        return problems

    def describe(self, name: str | None = None) -> dict[str, Any]:
        """Everything ``kvc info`` reports (header, model, rates, pipelines per layer, sizes) as plain data."""
        from kvcodec.format.describe import describe

        return describe(self, name if name is not None else "<bytes>")

    def sizes(self) -> dict[str, Any]:
        """Bytes per section and per layer/kind (everything in the file is counted once)."""
        hd = self.header
        blobs = {"token_ids": 0, "positions": 0, "attachments": 0}
        if hd.token_ids_blob is not None:
            blobs["token_ids"] = hd.blobs[hd.token_ids_blob].length
        if hd.positions_blob is not None:
            blobs["positions"] = hd.blobs[hd.positions_blob].length
        blobs["attachments"] = sum(hd.blobs[a.blob].length for a in hd.attachments.values() if a.blob is not None)
        layers = [{"k": 0, "v": 0} for _ in range(hd.num_layers)]
        for e in self.entries:
            layers[e.layer][e.kind] += e.length
        chunks = sum(e.length for e in self.entries)
        index = len(self.entries) * INDEX_ENTRY_SIZE
        header = PREAMBLE_SIZE + hd.header_length + HEADER_CRC_SIZE
        padding = self.size - header - sum(blobs.values()) - chunks - index - FOOTER_SIZE
        return {
            "file": self.size, "header": header, "blobs": blobs, "chunks": chunks, "index": index,
            "footer": FOOTER_SIZE, "padding": padding, "layers": layers,
        }


def read_kvc(source: Any, backend: str | None = None, model: Any = None, attachment_resolver: Resolver | None = None,
             max_decoded_bytes: int | None = None, max_decoded_ratio: float | None = None) -> KVCache:
    """Read a whole `.kvc` file as a KVCache (checking ``model`` compatibility first if given)."""
    with KvcReader(source, attachment_resolver, max_decoded_bytes, max_decoded_ratio) as r:
        return r.read_cache(backend=backend, model=model)


def verify_kvc(source: Any, attachment_resolver: Resolver | None = None, backend: str | None = None) -> list[str]:
    """All problems found in ``source`` (an open failure is the single problem); [] when clean."""
    try:
        r = KvcReader(source, attachment_resolver)
    except KvcFormatError as exc:
        return [str(exc)]
    with r:
        return r.verify(backend=backend)
