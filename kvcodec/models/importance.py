"""Per-(layer, token) attention importance of a context's KV entries, measured on the model: what the planner's
token-weighted quantization reads (:mod:`kvcodec.plan.importance` turns it into step classes).

Why the planner weighs tokens by it, and how it maps it to step classes: :mod:`kvcodec.plan.importance`. Measuring
it is a forward pass of the model, so it lives with the model (issue 56: the planner plans from it, it runs nothing).

The future queries are unknown at encode time; the last ``window`` queries of
the context are the proxy (what the end of the document attends to is what the
next tokens resemble, as in SnapKV). Scores come from a forward of those queries
over the cache (one extra prefill where there is no cache) with an attention
function that recomputes ``softmax(QK^T)`` for those queries from the very post-RoPE tensors the layer used, summed over every query head of the layer
(the classes are shared by all heads and by K and V of a layer), under the layer's
own mask: a sliding-window layer's queries see only their last ``window`` keys, and
its keys that no future query can see (``k <= T - window``) get importance 0, so
they fall into the coarsest step class.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.errors import KvcInputError
from kvcodec.models.attention_tap import ImportanceCollector, eager_attention_sums, tap_sees, tapped, window_start
from kvcodec.models.cachelayout import cache_for_model

DEFAULT_WINDOW = 256


def _tapped_scores(lm: Any, ids: Any, window: int | None, total: int, squared: bool, **forward: Any) -> np.ndarray:
    """One forward of ``ids`` (over ``forward``'s past, if any) with the attention tap; [L, total] scores. On a model
    the tap cannot observe (:func:`~kvcodec.models.attention_tap.tap_sees`), the weights its eager attention returns
    (:func:`_eager_scores`)."""
    import torch

    if not tap_sees(lm):
        return _eager_scores(lm, ids, window, total, squared, forward.get("past_key_values"))
    with torch.inference_mode():
        col = ImportanceCollector(window, total, list(lm.layout.windows or ()), squared)
        with tapped(lm, col):
            lm.model(input_ids=ids, logits_to_keep=1, **forward)
    return col.stacked(lm.fingerprint.num_layers)


def _eager_scores(lm: Any, ids: Any, window: int | None, total: int, squared: bool, past: Any = None) -> np.ndarray:
    """:func:`_tapped_scores` from the attention weights the model returns in eager mode, for a model whose attention
    the tap cannot observe (:func:`~kvcodec.models.attention_tap.eager_attention_sums`). The same scores up to float
    rounding (a test compares them on a model both can read): mean ``a^2`` (or ``a``) over the last ``window`` queries
    and every query head, per key, with the collector's sliding-window rule."""
    T = int(total)
    start = window_start(T - int(ids.shape[1]), T, window)
    sums = eager_attention_sums(lm, ids, window, T, squared, past)
    scores = sums.sum(1) / ((T - start) * lm.layout.num_heads)
    for layer, sw in enumerate(lm.layout.windows or ()):
        if sw is not None:  # no future query can see keys k <= T - sw (ImportanceCollector.add)
            scores[layer, : max(0, T - sw + 1)] = 0.0
    return scores.numpy()


def attention_importance(lm: Any, token_ids: np.ndarray, window: int | None = DEFAULT_WINDOW,
                         squared: bool = True) -> np.ndarray:
    """Mean over the last ``window`` queries and all query heads of ``a^2`` (or ``a``) per (layer, key token) [L, T] float64.

    One prefill of the whole context (no cache at hand: see :func:`cache_importance`).
    """
    import torch

    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1)
    if ids.shape[1] == 0:
        raise KvcInputError("no tokens to score")
    return _tapped_scores(lm, ids, window, ids.shape[1], squared, use_cache=False)


def cache_importance(lm: Any, cache: Any, window: int | None = DEFAULT_WINDOW) -> np.ndarray | None:
    """:func:`attention_importance` of an unpruned cache's context, or None when it cannot apply (pruned cache).

    Free when the capture observed it (``cache.attention``, :func:`kvcodec.models.capture.capture`'s
    ``score_window``) with the same window. Otherwise, why not a prefill: the cache already holds every key, and the scores need
    only the last ``window`` queries. So the model runs just those tokens over
    the cache's own prefix (a causal model's KV prefix is the prefix's KV):
    ``window / T`` of a prefill's work (a quarter at 2K tokens), the same
    queries and keys up to float rounding.
    """
    if cache.positions is not None or cache.num_tokens != cache.num_context_tokens:
        return None
    seen = cache.attention
    if seen is not None and seen.window == window:  # observed by the capture's own prefill: no forward at all
        return seen.scores
    T = int(cache.num_tokens)
    if window is None or window >= T or cache.ragged:
        # ragged: a sliding-window layer dropped the tokens its prefix's window would hold, and rebuilding
        # them is a prefill of nearly the whole context anyway (KVCache.prefix)
        return attention_importance(lm, cache.token_ids, window)
    import torch

    start = T - window
    past = cache_for_model(lm, cache.prefix(start))
    ids = torch.as_tensor(np.asarray(cache.token_ids[start:], dtype=np.int64)).reshape(1, -1)
    return _tapped_scores(lm, ids, window, T, True, past_key_values=past,
                          position_ids=torch.arange(start, T).reshape(1, -1), use_cache=True)
