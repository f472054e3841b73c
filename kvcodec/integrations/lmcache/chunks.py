"""LMCache chunk <-> `.kvc` bytes, with no LMCache import (the main test suite covers it).

One LMCache chunk object is one KV tensor of one model's chunk of tokens. In LMCache's multiprocess mode it has
the layout ``KV_2LTD``: ``[2, num_layers, num_tokens, num_kv_heads * head_dim]`` (K then V). That is the only
layout this codec accepts; MLA's single-plane ``[num_layers, num_tokens, dim]``, a chunk object of several
kernel groups (hybrid models), and the per-layer formats of LMCache's non-MP engine are refused in one line.

Why a frame around the `.kvc`: LMCache's ``fs`` L2 adapter (and others) read a stored object back into a buffer
of exactly ``estimate_serialized_size`` bytes and count a shorter file as a miss ("Incomplete read"), while a
`.kvc` with trailing bytes is not a `.kvc`. So the serialized object is ``MAGIC | u64 length | .kvc | zero
padding``; :func:`unframe` (and ``python -m kvcodec.integrations.lmcache extract``) gives the `.kvc` back for
``kvc info`` / ``kvc verify``.

Post-RoPE keys: a chunk carries no absolute positions (LMCache keys it by a content hash). The codec encodes it
as a context of its own starting at position 0: the lossy presets un-rotate its keys by the angles of positions
0..T-1, not the true ones, and the decoder re-rotates by the same angles, so the keys come back post-RoPE at
their true positions (the rotation is undone exactly, the stored keys are only rotated by a constant per-chunk
offset). What it costs is energy compaction in the calibrated basis: docs/guide/engines.md gives the measured
difference.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelMismatchError

MAGIC = b"KVCLMC01"  # the frame: magic, u64 little-endian length of the .kvc, the .kvc, zero padding
_HEAD = struct.Struct("<8sQ")
FRAME_OVERHEAD = _HEAD.size
DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
# the .kvc's own header JSON (fingerprint, meta), chunk index and footer beyond the per-layer allowance
_KVC_SLACK = 64 << 10


@dataclass(frozen=True)
class ChunkLayout:
    """One KV_2LTD chunk's shape: ``[2, layers, tokens, heads * head_dim]`` of ``dtype``."""

    layers: int
    tokens: int
    width: int
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return 2 * self.layers * self.tokens * self.width * self.dtype.itemsize


def chunk_layout(shapes: Any, dtypes: Any) -> ChunkLayout:
    """The chunk layout of an LMCache ``MemoryLayoutDesc`` (shapes, dtypes), or one KvcInputError line why not."""
    shapes, dtypes = list(shapes), list(dtypes)
    if len(shapes) != 1 or len(dtypes) != 1:
        raise KvcInputError(f"kvcodec serde: a chunk object of {len(shapes)} kernel groups is not supported "
                            "(one KV_2LTD tensor per object only: no hybrid models)")
    shape, dtype = tuple(int(d) for d in shapes[0]), dtypes[0]
    if len(shape) == 3:
        raise KvcInputError(f"kvcodec serde: layout {list(shape)} is MLA's single plane [layers, tokens, dim]; "
                            "only KV_2LTD [2, layers, tokens, heads*head_dim] is supported")
    if len(shape) != 4 or shape[0] != 2 or min(shape) < 1:
        raise KvcInputError(f"kvcodec serde: layout {list(shape)} is not KV_2LTD [2, layers, tokens, heads*head_dim]")
    if dtype not in DTYPES:
        raise KvcInputError(f"kvcodec serde: dtype {dtype} is not supported (float16, bfloat16, float32)")
    return ChunkLayout(shape[1], shape[2], shape[3], dtype)


def check_model_layout(lay: ChunkLayout, fp: Any) -> None:
    """Refuse a chunk whose shape is not this model's KV (one line): it would be encoded under the wrong model."""
    dims = set(fp.head_dims)
    if len(dims) != 1:
        raise KvcInputError(f"kvcodec serde: model {fp.id} has layers of different head sizes {sorted(dims)}, which a "
                            "KV_2LTD chunk cannot hold")
    want = fp.num_kv_heads * fp.head_dims[0]
    if lay.layers != fp.num_layers or lay.width != want:
        raise KvcInputError(f"kvcodec serde: chunk [2, {lay.layers}, {lay.tokens}, {lay.width}] does not fit the model "
                            f"({fp.num_layers} layers x {fp.num_kv_heads} KV heads x {fp.head_dims[0]})")


def upper_bound(lay: ChunkLayout, fp: Any | None = None) -> int:
    """Bytes no serialized chunk of ``lay`` exceeds, whatever its values (the serde's estimate).

    Why it holds: the serializer encodes with its preset and, should that ever not fit (incompressible values
    under zstd grow by its frame overhead), encodes again with the ``raw`` preset, whose payload is the raw
    values. So the bound is the raw bytes plus the frame, the token ids and the `.kvc`'s own header, chunk index and
    footer (fingerprint and metadata JSON, per-layer records), with room to spare; tests/integrations/lmcache checks it
    on incompressible chunks of every preset.
    """
    fp_json = 0 if fp is None else len(str(getattr(fp, "rope", ""))) + 4096
    # + the chunk's token ids, stored uncompressed (int32, int64 at most): past 32K tokens of SmolLM2 they alone
    # outgrew the slack, and the raw fallback with them
    return FRAME_OVERHEAD + lay.nbytes + 8 * lay.tokens + 1024 * 2 * lay.layers + fp_json + _KVC_SLACK


def key_meta(key: Any) -> dict[str, Any]:
    """What a `.kvc` records of its LMCache ObjectKey, checked again at deserialize; a key whose fields are not
    ObjectKey's types is one KvcInputError line. Why: ``bytes(chunk_hash)`` of an integer hash (LMCache's
    CacheEngineKey carries one) allocated that many zero bytes (10**10: 10 GB, then 20 GB of hex), hashes 3 and
    b"\\0\\0\\0" became one key, and a missing field escaped as AttributeError."""
    h, name = getattr(key, "chunk_hash", None), getattr(key, "model_name", None)
    rank, group = getattr(key, "kv_rank", None), getattr(key, "object_group_id", 0)
    salt = getattr(key, "cache_salt", "")
    if not isinstance(h, (bytes, bytearray, memoryview)) or not 0 < len(bytes(h)) <= 1024:
        raise KvcInputError(f"kvcodec serde: an LMCache key's chunk_hash must be 1 to 1024 bytes, got "
                            f"{type(h).__name__}")
    if not isinstance(name, str) or not isinstance(salt, str):
        raise KvcInputError("kvcodec serde: an LMCache key's model_name and cache_salt must be strings")
    ints: list[int] = []
    for f, v in (("kv_rank", rank), ("object_group_id", group)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise KvcInputError(f"kvcodec serde: an LMCache key's {f} must be an integer, got {type(v).__name__}")
        ints.append(int(v))
    return {"chunk_hash": bytes(h).hex(), "model_name": name, "kv_rank": ints[0], "object_group_id": ints[1],
            "cache_salt": salt}


def key_digest(key: Any) -> str:
    """64 hex digits binding every field of an ObjectKey (a store key's digest)."""
    m = key_meta(key)
    blob = "\0".join([m["chunk_hash"], m["model_name"], str(m["kv_rank"]), str(m["object_group_id"]), m["cache_salt"]])
    return hashlib.sha256(b"lmcache-object-key\0" + blob.encode()).hexdigest()


def to_cache(tensor: torch.Tensor, fp: Any, meta: dict[str, Any]) -> Any:
    """A KV_2LTD chunk tensor as a KVCache of ``fp``'s model: a context of its own (positions 0..T-1)."""
    from kvcodec.core.kvcache import KVCache

    lay = chunk_layout([tensor.shape], [tensor.dtype])
    check_model_layout(lay, fp)
    h, d = fp.num_kv_heads, fp.head_dims[0]
    t = tensor.detach().to("cpu")
    keys = [t[0, i].reshape(lay.tokens, h, d).transpose(0, 1).contiguous() for i in range(lay.layers)]
    values = [t[1, i].reshape(lay.tokens, h, d).transpose(0, 1).contiguous() for i in range(lay.layers)]
    # token ids: the chunk has none (LMCache keys it by a hash, recorded in meta); zeros keep the file valid
    # dtype: the chunk's own, which a re-based lossy chunk's header (float32, :func:`shift_cache`) no longer says
    return KVCache(keys, values, np.zeros(lay.tokens, dtype=np.int64), fp, None,
                   {"source": "lmcache", "dtype": DTYPES[lay.dtype], **meta})


def frame(kvc: bytes, capacity: int, pad: bool) -> bytes:
    """The serialized object: the frame head, the `.kvc`, and zeros up to ``capacity`` when ``pad``."""
    n = FRAME_OVERHEAD + len(kvc)
    if n > capacity:
        raise KvcInputError(f"kvcodec serde: the encoded chunk ({n} bytes) exceeds the buffer ({capacity} bytes)")
    out = _HEAD.pack(MAGIC, len(kvc)) + kvc
    return out + bytes(capacity - n) if pad else out


def unframe(blob: bytes | memoryview) -> bytes:
    """The `.kvc` inside a serialized object, or one KvcFormatError line (not ours, truncated, forged length)."""
    mv = memoryview(blob).cast("B")
    if len(mv) < FRAME_OVERHEAD:
        raise KvcFormatError(f"kvcodec serde: object of {len(mv)} bytes is shorter than its frame")
    magic, n = _HEAD.unpack_from(mv, 0)
    if magic != MAGIC:
        raise KvcFormatError(f"kvcodec serde: not a kvcodec object (magic {bytes(magic)!r})")
    if n > len(mv) - FRAME_OVERHEAD:
        raise KvcFormatError(f"kvcodec serde: frame says {n} bytes, the object holds {len(mv) - FRAME_OVERHEAD}")
    return bytes(mv[FRAME_OVERHEAD:FRAME_OVERHEAD + n])


def check_entry(r: Any, fp: Any, key: Any, lay: ChunkLayout, preset: str | None = None) -> None:
    """Refuse (KvcError) a `.kvc` that is not this key's chunk of this model in this layout: never decode it into
    the cache. Another model, another chunk (a renamed or swapped file), another shape: all a miss; with
    ``preset``, an object a serde of another preset wrote, too (:func:`check_preset`)."""
    if not fp.same_model(r.fingerprint):
        raise KvcModelMismatchError(f"kvcodec serde: object written for model {r.fingerprint.id}, this key's model "
                                    f"is {fp.id}")
    meta = r.header.meta if isinstance(r.header.meta, dict) else {}
    if preset is not None:
        check_preset(meta, str(r.header.codec), preset)
    if meta.get("source") != "lmcache" or meta.get("chunk_hash") != key_meta(key)["chunk_hash"]:
        raise KvcFormatError("kvcodec serde: object was written for another chunk (its recorded key differs)")
    for f in ("kv_rank", "object_group_id", "cache_salt"):
        if meta.get(f) != key_meta(key)[f]:
            raise KvcFormatError(f"kvcodec serde: object was written for another {f}")
    off = meta.get("rope_offset", 0)
    if isinstance(off, bool) or not isinstance(off, int) or not 0 <= off < OFFSET_CAP:
        raise KvcFormatError(f"kvcodec serde: object records a bad rope_offset {off!r}")
    h = r.header
    # Why: LMCache's ObjectKey has no dtype, so an engine serving the model in float16 finds the entries of one
    # serving it in bfloat16 (a shared store); cast, a bfloat16 value past 65504 loaded as inf and a lossless
    # entry was rounded. An entry from before the meta recorded it: its header's dtype, unless re-based (float32).
    stored = meta.get("dtype", None if off else h.dtype)
    if stored is not None and stored != DTYPES[lay.dtype]:
        raise KvcFormatError(f"kvcodec serde: object holds {stored} values, the buffer is {DTYPES[lay.dtype]}")
    if int(h.num_layers) != lay.layers or int(h.num_tokens) != lay.tokens or h.ragged or r.positions is not None:
        raise KvcFormatError(f"kvcodec serde: object holds {h.num_layers} layers x {h.num_tokens} tokens, the buffer "
                             f"wants {lay.layers} x {lay.tokens}")


def check_preset(meta: dict[str, Any], codec: str, preset: str) -> None:
    """Refuse an object that a serde configured with another preset wrote (its meta's ``serde_preset``; an object
    from before that was recorded: its header's codec, the preset it was encoded with, unless ``raw``, the exact
    fallback every preset writes). Why: LMCache's ``fs`` adapter names an object by its key alone, so a deployment
    switched from ``small`` to ``lossless`` on the same path served the old ``small`` objects (errors up to 5 on
    SmolLM2) as lossless ones. Another step of the same preset (``overrides``) is the same preset: its steps are in
    the `.kvc` and a reader needs none."""
    rec = meta.get("serde_preset")
    if rec is None and codec != "raw":
        rec = codec
    if rec is not None and rec != preset:
        raise KvcFormatError(f"kvcodec serde: object was written with preset {str(rec)[:40]!r}, this serde's is "
                             f"{preset!r}")


def write_chunk(r: Any, dst: torch.Tensor, lay: ChunkLayout, ropes: list[tuple[float, int] | None] | None = None) -> None:
    """Decode every layer of reader ``r`` into the KV_2LTD tensor ``dst`` (same dtype in and out: bit-exact for
    the lossless presets); keys rotated forward by the object's ``rope_offset`` (:func:`shift_cache`), if any."""
    meta = r.header.meta if isinstance(r.header.meta, dict) else {}
    off = int(meta.get("rope_offset", 0))
    if off and ropes is None:
        raise KvcFormatError("kvcodec serde: object records a rope_offset but no RoPE parameters were given")
    from kvcodec.core.dtypes import cast_in_range

    for i, k, v in r.iter_layers():
        if off:
            assert ropes is not None
            k = rotate(k, off, ropes[i])
        # [H, T, D] -> [T, H*D]; a lossy layer decodes to float32: a value its error carried past a float16
        # buffer's 65504 was copied in as inf (copy_ casts unchecked), now one line
        dst[0, i].copy_(cast_in_range(k, dst.dtype).transpose(0, 1).reshape(lay.tokens, lay.width))
        dst[1, i].copy_(cast_in_range(v, dst.dtype).transpose(0, 1).reshape(lay.tokens, lay.width))


# ------------------------------------------------------------------------------------------------ the RoPE offset
# Why: a chunk's keys are post-RoPE at positions off..off+T-1, and the codec un-rotates a chunk as a context of its
# own (positions 0..T-1), so its stored keys stay rotated by the constant angle of ``off`` per frequency: the
# calibrated PCA basis (fitted on pre-RoPE keys) then compacts them badly. Measured on SmolLM2's 256-token chunks at
# faithful's settings with step0 0.2: keys 2.65 bits per element against 1.99 at the true positions (BENCHMARKS.md,
# "LMCache serdes"). LMCache keys a chunk by a content hash, so ``off`` is not given: it is estimated from the keys
# themselves (:func:`estimate_offset`), the keys are rotated back by it before encoding (so the `.kvc` holds the
# chunk re-based to position 0: a valid file, RoPE being relative), and the offset is recorded in the `.kvc`'s meta
# (``rope_offset``) for the deserializer to rotate the decoded keys forward again. A wrong estimate costs bytes,
# never correctness: the decoder rotates by exactly the recorded offset.
OFFSET_CAP = 1 << 17  # positions the search tries: [0, min(this, the model's max_position_embeddings))


def layer_ropes(fp: Any) -> list[tuple[float, int] | None]:
    """(theta, rotary dim) of each layer of ``fp``, None where the layer has no plain RoPE (its keys are left as is)."""
    from kvcodec.codecs.rope_tables import layer_rope_config

    out: list[tuple[float, int] | None] = []
    for i in range(fp.num_layers):
        c = layer_rope_config(fp, i, fp.head_dims[i])
        out.append(None if c is None else (float(c["theta"]), int(c["dim"])))
    return out


def rotate(x: torch.Tensor, delta: int, rope: tuple[float, int] | None) -> torch.Tensor:
    """Keys ``x`` [H, T, D] rotated by the RoPE angle of ``delta`` positions (negative: back), float32."""
    from kvcodec.codecs.rope import rope_decode
    from kvcodec.codecs.rope_tables import rope_tables

    x = x.to(torch.float32)
    if rope is None or delta == 0:
        return x
    theta, dim = rope
    cos, sin = rope_tables(np.array([delta], dtype=np.int64), theta, dim)  # [1, dim]: one angle for every token
    return torch.from_numpy(rope_decode(x.numpy(), cos, sin, dim))  # the rope stage's own rotation (float32)


def estimate_offset(keys: list[torch.Tensor], ropes: list[tuple[float, int] | None], key_means: Any, step: int = 16,
                    cap: int = OFFSET_CAP) -> int:
    """The position offset in [0, cap) (searched on multiples of ``step``, then to the position) at which the chunk's post-RoPE ``keys`` (per layer
    [H, T, D], positions off..off+T-1) agree best with the calibration's pre-RoPE key means ``key_means`` [L, H, D].

    Why it works: un-rotating each key by its index t (0..T-1) leaves the chunk's mean pre-RoPE key rotated by the
    angle of ``off`` alone; in complex form per frequency pair j, ``z_j = mean_j * exp(i theta_j off)``. The offset
    maximises ``Re sum_j conj(mu_j) z_j exp(-i theta_j off)`` (least squares against the calibrated means mu), a sum
    over the model's few distinct frequencies, evaluated on every candidate at once."""
    from kvcodec.codecs.rope_tables import inv_freq, rope_tables

    acc: dict[float, complex] = {}
    for i, (k, rope) in enumerate(zip(keys, ropes)):
        if rope is None:
            continue
        theta, dim = rope
        h = dim // 2
        T = k.shape[1]
        cos, sin = (torch.from_numpy(a) for a in rope_tables(np.arange(T, dtype=np.int64), theta, dim))  # [T, dim]
        r = k[..., :dim].to(torch.float32)
        rh = torch.cat([-r[..., h:], r[..., :h]], dim=-1)
        m = (r * cos - rh * sin).mean(1).double().numpy()  # [H, dim]: the mean of the keys un-rotated by t
        mu = np.asarray(key_means[i], dtype=np.float64)[:, :dim]
        with np.errstate(all="ignore"):  # keys of inf / NaN / 1e38: judged below, not warned about in the log
            z = (m[:, :h] + 1j * m[:, h:]) * np.conj(mu[:, :h] + 1j * mu[:, h:])
            for f, c in zip(inv_freq(theta, dim), z.sum(0)):
                acc[float(f)] = acc.get(float(f), 0j) + complex(c)
    if not acc or step < 1 or cap <= step:
        return 0
    if not all(np.isfinite(v) for v in acc.values()):  # no angle to read (numpy's overflow warnings before): at 0
        return 0
    f = np.fromiter(acc, dtype=np.float64)
    c = np.array(list(acc.values()), dtype=np.complex128)

    def argbest(cand: np.ndarray) -> int:
        best, score = 0, -np.inf
        for s in range(0, len(cand), 4096):  # bounded memory: 4096 candidates x frequencies at a time
            p = cand[s:s + 4096]
            sc = (np.exp(-1j * np.outer(p, f)) @ c).real
            j = int(np.argmax(sc))
            if sc[j] > score:
                best, score = int(p[j]), float(sc[j])
        return best

    coarse = argbest(np.arange(0, cap, step, dtype=np.float64))  # then every position within a step of it
    return argbest(np.arange(max(0, coarse - step + 1), min(cap, coarse + step), dtype=np.float64))


def shift_cache(cache: Any, delta: int, ropes: list[tuple[float, int] | None]) -> Any:
    """``cache`` (float32) with every key rotated by ``delta`` positions; ``rope_offset`` = -delta in its meta."""
    from kvcodec.core.kvcache import KVCache

    keys = [rotate(k, delta, r) for k, r in zip(cache.keys, ropes)]
    values = [v.to(torch.float32) for v in cache.values]
    return KVCache(keys, values, cache.token_ids, cache.fingerprint, None, {**cache.meta, "rope_offset": -delta})
