"""``redact``: remove token spans (a paragraph, every match of a regex such as an e-mail address) from a
stored context.

Two repairs (``repair=``). **``"prefill"``, the default**, prefills the kept token ids afresh: the child then
depends on what was removed only through the removed tokens' count and positions, which its edit log records
(spec/kvc-v1.md §4.5; tests/edit/test_redact_privacy.py checks it). That is the only repair that may be used to
remove a secret. **``"blend"``** repairs the parent's cache without a full re-prefill, as below; it is faster,
but the kept tokens after the first span that it does not recompute keep K/V computed attending to the removed
tokens, so a holder of the child and the model can test guesses of what was removed (issue 55).

What the child promises (issue 57, :mod:`kvcodec.edit.entry`): after ``"prefill"`` its K/V are a fresh prefill of
its ids, so its preset's promise holds as for any encode; after ``"blend"`` they are not (the repair is
approximate, and on a lossy parent it also carries the parent's decode error), so its log says it promises
nothing, except for a pure truncation of an exact parent (the exact prefix). The promise is a function of the
preset, the repair and the parent's codec, never of what was removed, so it tells nothing about the secret.

Removing tokens from a cache is more than deleting rows: every later token was computed (1) at a position
that is now wrong and (2) attending to the removed tokens. kvcodec repairs both the way CacheBlend repairs
independently cached chunks, by reusing :func:`kvcodec.runtime.blend.blend` itself:

1. the kept tokens form pieces (before the first span, between spans, after the last); each piece's post-RoPE
   keys are rotated back to positions ``0..len-1`` (:func:`kvcodec.runtime.blend.rerotate_keys`, each layer
   with its own RoPE); values carry no position and are kept;
2. ``blend`` places the pieces one after another (rotating each to its new offset), recomputes layers
   ``0..select_layer-1`` for every token, picks at ``select_layer`` the ``recompute_ratio`` fraction of
   tokens whose fresh keys deviate most from the stored ones (the tokens that leaned hardest on what was
   removed), and recomputes those tokens' later layers over the mixed K/V;
3. the last kept token is blend's "query": it is always recomputed in full, so the child ends with an
   exactly positioned, fully repaired token.

Tokens before the first span are untouched by a causal model's edit: their K/V are kept as they are (their
deviation at ``select_layer`` is rounding only, so the selection spends its budget after the span). A span
that ends the context is a truncation: the child is the parent's prefix, exact, with nothing recomputed.

The result is compared with a fresh prefill of the edited token ids (tests/edit/test_redact.py,
benchmarks/bench_edit.py): KL of the next-token distributions over a continuation, and time. Refused:
caches whose sliding-window layers dropped tokens (a context longer than a layer's window: the pieces' early
tokens are gone and no rotation brings them back) and pruned caches.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcodec.core.kvcache import KVCache
from kvcodec.edit.entry import EditResult, breaks, check_child_preset, check_dest, keeps, open_parent, write_child
from kvcodec.edit.log import check_params
from kvcodec.edit.spans import redaction_spans
from kvcodec.errors import KvcInputError
from kvcodec.runtime.blend import blend, layer_inv_freqs, rerotate_keys

__all__ = ["DEFAULT_REDACT_RATIO", "REPAIRS", "redact", "redact_cache"]

#: Fraction of the kept tokens recomputed from ``select_layer`` on. benchmarks/bench_edit.py measures a grid
#: (BENCHMARKS.md, "Offline editing"; 448-token held-out contexts, a 48-token span): on SmolLM2 re-positioning
#: alone (ratio 0) already keeps the KL against a re-prefill at 0.004-0.007 nats, inside the balanced preset's
#: 0.01; 0.05 roughly halves it (0.0025-0.004) at 7-26 % of the re-prefill's time, while 0.1 and 0.2 gain
#: little more and cost more. On Gemma 3 270M no ratio up to 0.2 reliably reaches 0.01 (2 of 3 texts miss), and
#: no selection rule can: the re-positioning is exact (tests/edit/test_redact_rope.py), but the removal's damage
#: spreads over the whole suffix, so even the re-prefill's exact K/V for the 20 % most affected tokens leaves
#: 0.015-0.025 nats on a tuning text (benchmarks/results/edit/redact-ceiling/README.md).
DEFAULT_REDACT_RATIO = 0.05


def _pieces(cache: KVCache, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    n = cache.num_context_tokens
    kept, at = [], 0
    for a, b in spans:
        if a > at:
            kept.append((at, a))
        at = b
    if at < n:
        kept.append((at, n))
    if not kept:
        raise KvcInputError("the spans cover the whole context: nothing would be left")
    return kept


def _piece(cache: KVCache, a: int, b: int, freqs: list[np.ndarray]) -> KVCache:
    """Tokens ``[a, b)`` of ``cache`` as a chunk captured from position 0 (keys rotated back by ``a``)."""
    keys = [rerotate_keys(k[:, a:b], -a, f) if a else k[:, a:b].float() for k, f in zip(cache.keys, freqs)]
    values = [v[:, a:b].float() for v in cache.values]
    return KVCache(keys, values, cache.token_ids[a:b], cache.fingerprint)


@torch.inference_mode()
def redact_cache(lm: Any, cache: KVCache, spans: Sequence[tuple[int, int]], recompute_ratio: float = DEFAULT_REDACT_RATIO,
                 select_layer: int = 1) -> tuple[KVCache, dict[str, Any]]:
    """``cache`` without the token ranges ``spans`` (sorted, disjoint, within the context), repaired.

    Returns the child cache (model dtype, on the model's device) and what was done (spans, pieces,
    recomputed token count, blend's timings).
    """
    if cache.positions is not None:
        raise KvcInputError("the entry is a pruned cache; redact needs a full cache")
    if cache.ragged:
        raise KvcInputError("the context is longer than a sliding-window layer's window, whose earlier tokens are not "
                            "stored; redact needs every token of every layer (re-prefill the edited text instead)")
    kept = _pieces(cache, spans)
    info: dict[str, Any] = {"spans": [list(s) for s in spans], "removed_tokens": int(sum(b - a for a, b in spans))}
    if len(kept) == 1 and kept[0][0] == 0:  # only a tail was removed: the prefix is exact
        n = kept[0][1]
        info.update(recomputed_tokens=0, truncation=True)
        return KVCache([k[:, :n].contiguous() for k in cache.keys], [v[:, :n].contiguous() for v in cache.values],
                       cache.token_ids[:n], cache.fingerprint, None, dict(cache.meta)), info
    freqs = layer_inv_freqs(lm)
    last_a, last_b = kept[-1]
    query = cache.token_ids[last_b - 1:last_b]  # the last kept token: recomputed in full by blend
    chunks = [_piece(cache, a, b, freqs) for a, b in kept[:-1]]
    if last_b - 1 > last_a:
        chunks.append(_piece(cache, last_a, last_b - 1, freqs))
    res = blend(lm, chunks, query, recompute_ratio=recompute_ratio, select_layer=select_layer)
    info.update(recomputed_tokens=int(len(res.selected)), recompute_ratio=float(recompute_ratio),
                select_layer=int(select_layer), truncation=False,
                blend_timings={k: round(v, 6) for k, v in res.timings.items()})
    out = res.cache
    return KVCache(out.keys, out.values, out.token_ids, out.fingerprint, None, dict(cache.meta)), info


#: how a redaction computes the kept tokens' K/V: ``"prefill"`` (the default) prefills the edited token ids
#: afresh, so the child is a function of the kept text alone; ``"blend"`` repairs the parent's K/V
#: CacheBlend-style (faster, but the K/V of the tokens after the first span that are not recomputed were
#: computed attending to the removed tokens: see the module doc and spec/kvc-v1.md §4.5)
REPAIRS = ("prefill", "blend")


def _check_ratio(recompute_ratio: Any, select_layer: Any, lm: Any) -> tuple[float, int]:
    """blend's two knobs as a number in [0, 1] and a layer index (refused in one line, never coerced)."""
    if isinstance(recompute_ratio, bool) or not isinstance(recompute_ratio, (int, float, np.integer, np.floating)) \
            or not 0.0 <= float(recompute_ratio) <= 1.0:
        raise KvcInputError(f"recompute_ratio must be a number in [0, 1], got {recompute_ratio!r:.40}")
    L = lm.fingerprint.num_layers
    if isinstance(select_layer, bool) or not isinstance(select_layer, (int, np.integer)) or not 0 <= select_layer < L:
        raise KvcInputError(f"select_layer must be an integer in [0, {L}), got {select_layer!r:.40}")
    return float(recompute_ratio), int(select_layer)


def _prefill(lm: Any, ids: np.ndarray, removed: int, spans: Sequence[tuple[int, int]]) -> tuple[KVCache, dict[str, Any]]:
    """The kept ids prefilled afresh: K/V that depend on the kept text only."""
    from kvcodec.models.capture import capture

    child = capture(lm, token_ids=ids)
    return child, {"spans": [list(s) for s in spans], "removed_tokens": removed, "recomputed_tokens": int(len(ids)),
                   "truncation": False}


def redact(lm: Any, source: Any, *, pattern: str | None = None, text: str | None = None,
           char_spans: Sequence[tuple[int, int]] | None = None, token_spans: Sequence[tuple[int, int]] | None = None,
           repair: str = "prefill", recompute_ratio: float | None = None, select_layer: int | None = None,
           dest: Any = None, preset: str | None = None, progress: Callable[[str], None] | None = None,
           lineage_key: bytes | None = None) -> EditResult:
    """Remove from the stored entry ``source`` (a `.kvc` path or bytes) the spans named by exactly one of
    ``pattern`` (a regex over the decoded context), ``text`` (every occurrence), ``char_spans`` or
    ``token_spans``, into a new entry at ``dest`` (None: bytes in the result; never the parent's file).

    ``repair`` (:data:`REPAIRS`): ``"prefill"`` re-prefills the kept ids, so nothing in the child depends on
    what was removed beyond the spans' positions (spec/kvc-v1.md §4.5); ``"blend"`` takes
    ``recompute_ratio`` (default :data:`DEFAULT_REDACT_RATIO`) and ``select_layer`` (default 1) and is faster,
    without that guarantee. ``lineage_key`` (bytes): the child's log names its parent by an HMAC under it,
    checkable by whoever holds the parent and the key; without it, the child does not name its parent.
    """
    if repair not in REPAIRS:
        raise KvcInputError(f"repair must be one of {', '.join(REPAIRS)}, got {repair!r:.40}")
    if repair == "prefill" and (recompute_ratio is not None or select_layer is not None):
        raise KvcInputError("recompute_ratio and select_layer tune repair='blend'; repair='prefill' recomputes every token")
    ratio, layer = (DEFAULT_REDACT_RATIO if recompute_ratio is None else recompute_ratio,
                    1 if select_layer is None else select_layer)
    if repair == "blend":
        ratio, layer = _check_ratio(ratio, layer, lm)
    if lineage_key is not None and (not isinstance(lineage_key, (bytes, bytearray)) or len(lineage_key) < 16):
        raise KvcInputError("a lineage key must be bytes, at least 16 of them")
    check_dest(source, dest)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    parent = open_parent(source)
    check_child_preset(parent, preset)
    if repair == "prefill":
        ids = parent.token_ids(lm, "redact")
        if parent.reader.header.attention_bias is not None:  # a prefill of the ids alone would drop the steering
            raise KvcInputError("the entry is steered (it carries an attention bias); redact its unsteered parent, "
                                "then steer the result")
        if parent.reader.header.pruned:
            raise KvcInputError("the entry is a pruned cache (its tokens are not all stored); edits need a full cache")
    else:
        cache = parent.decode(lm)
        ids = cache.token_ids
    spans = redaction_spans(lm.tokenizer, ids, pattern=pattern, text=text, char_spans=char_spans,
                            token_spans=token_spans)
    removed = int(sum(b - a for a, b in spans))
    t1 = time.perf_counter()
    say(f"removing {removed} tokens in {len(spans)} span(s), {'prefilling the rest' if repair == 'prefill' else 'repairing the rest'}")
    params: dict[str, Any] = {"token_spans": [list(s) for s in spans], "removed_tokens": removed, "repair": repair}
    if repair == "blend":
        params.update(recompute_ratio=ratio, select_layer=layer)
    check_params(params)
    if repair == "prefill":
        keep = np.ones(len(ids), bool)
        for a, b in _check_spans(spans, len(ids)):
            keep[a:b] = False
        child, info = _prefill(lm, ids[keep], removed, spans)
        promise = keeps("fresh prefill of the child's ids")
    else:
        child, info = redact_cache(lm, cache, spans, recompute_ratio=ratio, select_layer=layer)
        carried = parent.carried
        if carried:
            promise = breaks(f"{carried} (repair=blend)")
        elif info["truncation"]:
            promise = keeps("the exact parent's prefix (the span ended the context)")
        else:
            promise = breaks("blend's repair is approximate: its K/V are not a prefill of the child's ids (repair=blend)")
    info["repair"] = repair
    t2 = time.perf_counter()
    return write_child(lm, parent, child, "redact", params, dest=dest, preset=preset, progress=progress,
                       timings={"decode_s": t1 - t0, "repair_s": t2 - t1}, info=info, lineage_key=lineage_key,
                       promise=promise)


def _check_spans(spans: Sequence[tuple[int, int]], n: int) -> Sequence[tuple[int, int]]:
    if sum(b - a for a, b in spans) >= n:
        raise KvcInputError("the spans cover the whole context: nothing would be left")
    return spans
