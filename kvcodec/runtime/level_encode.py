"""Writing a document's multi-level entry: its KV cache chunk by chunk at several presets, and the manifest.

Why a module of its own: the entry is written once (``kvc store put --levels``) by whoever owns the document, and
read many times by :class:`kvcodec.runtime.stream.AdaptiveStreamer`; the two share only the store's level layout
(:mod:`kvcodec.store.levels`, ``spec/levels-v1.md``), not code.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from kvcodec.core.kvcache import KVCache
from kvcodec.errors import KvcInputError
from kvcodec.models.load import LoadedModel
from kvcodec.accounting import bits_per_element, context_elements
from kvcodec.store import Store
from kvcodec.store.levels import (
    ChunkLevels,
    LevelManifest,
    level_keys,
    level_meta,
    manifest_key,
    parse_levels,
)


def encode_levels(
    lm: LoadedModel, store: Store, ids: np.ndarray, levels: list[str] | str, *, chunk_tokens: int = 256,
    namespace: str = "default", cache: KVCache | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Prefill ``ids`` once, encode every chunk at every level and put the multi-level entry in ``store``.

    Level chunks are put first and the manifest last, so a manifest that is
    found names chunks that were written (spec/levels-v1.md §4). ``cache``
    (the exact KV of ``ids``) skips the prefill.
    """
    from kvcodec.api import encode_cache, resolve_calibration
    from kvcodec.models.capture import capture, context_ids

    names = parse_levels(levels)
    if not isinstance(chunk_tokens, int) or chunk_tokens < 256 or chunk_tokens % 256:
        raise KvcInputError(f"chunk tokens must be a positive multiple of 256, got {chunk_tokens!r}")
    # checked like any capture's ids (integers in the vocabulary, within the window): float ids were truncated and
    # stored under the key of other tokens, "abc" escaped as ValueError
    ids = context_ids(lm, token_ids=ids)
    key = manifest_key(ids, model=lm.fingerprint.id, namespace=namespace)
    cals = {lv: resolve_calibration(lm, lv) for lv in names}  # resolved once per level (and model), for every chunk
    t0 = time.perf_counter()
    if cache is None:  # every token in every layer: a level chunk is a token range of all layers
        cache = capture(lm, token_ids=ids, full_layers=True)
    elif not np.array_equal(cache.token_ids, ids) or cache.positions is not None:
        raise KvcInputError("the given cache is not the exact cache of these tokens")
    elif cache.ragged:
        raise KvcInputError("level chunks need every token in every layer; this cache's sliding-window layers keep "
                            "only their window (capture it with full_layers=True)")
    lm.fingerprint.check_compatible(cache.fingerprint, what="cache")
    prefill_s = time.perf_counter() - t0
    chunks: list[ChunkLevels] = []
    encode_s: dict[str, float] = {n: 0.0 for n in names}
    n_chunks = -(-len(ids) // chunk_tokens)
    ends = [min((i + 1) * chunk_tokens, len(ids)) for i in range(n_chunks)]
    keys = {lv: level_keys(ids, lv, ends, model=lm.fingerprint.id, namespace=namespace) for lv in names}
    importance = None
    if any(lv in ("small", "balanced") for lv in names):  # the token-scaled presets weight tokens by attention
        from kvcodec.models.importance import cache_importance

        importance = cache_importance(lm, cache)
    for i, e in enumerate(ends):
        s = i * chunk_tokens
        part = KVCache([k[:, s:e] for k in cache.keys], [v[:, s:e] for v in cache.values], ids[:e],
                       cache.fingerprint, positions=np.arange(s, e, dtype=np.int64))
        sizes: dict[str, int] = {}
        for lv in names:
            if progress:
                progress(f"chunk {i + 1}/{n_chunks} [{s}, {e}) at {lv}")
            t1 = time.perf_counter()
            kw: dict[str, Any] = {"importance": importance[:, s:e]} if importance is not None and lv in ("small", "balanced") else {}
            data = encode_cache(part, lv, model=lm, calibration=cals[lv], **kw).data
            assert data is not None
            encode_s[lv] += time.perf_counter() - t1
            store.put(keys[lv][i], data, level_meta(lv, s, e))
            sizes[lv] = len(data)
        chunks.append(ChunkLevels(s, e, sizes))
    man = LevelManifest(key, chunk_tokens, names, chunks)
    store.put(key, man.to_bytes(), {"levels": names, "chunk_tokens": chunk_tokens})
    elems = context_elements(cache)
    return {
        "key": key.to_str(), "tokens": int(len(ids)), "chunk_tokens": chunk_tokens, "chunks": n_chunks,
        "levels": {lv: {"bytes": sum(c.bytes[lv] for c in chunks),
                        "bits_per_element": bits_per_element(sum(c.bytes[lv] for c in chunks), elems),
                        "encode_s": encode_s[lv]} for lv in names},
        "prefill_s": prefill_s, "total_s": time.perf_counter() - t0,
    }

