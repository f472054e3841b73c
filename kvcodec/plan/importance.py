"""Per-(layer, token) importance of a context's KV entries, for token-weighted quantization.

Why: with attention output ``o = sum_t a_t v_t``, independent coding noise of
power ``s_t^2`` on value ``v_t`` adds ``sum_t a_t^2 s_t^2`` to the output error
(and noise on key ``k_t`` perturbs logit t, whose effect on ``o`` is again
proportional to ``a_t``). So the distortion a token's coding noise causes is
weighted by ``E_q[a_{q,t}^2]`` over the queries that will read it; attention is
extremely concentrated, so most tokens can be coded much more coarsely.
Minimising ``sum_t w_t step_t^2`` at a fixed rate ``-sum_t log step_t`` gives
``step_t ∝ w_t^{-1/2}`` (high-rate theory); :func:`token_multipliers` maps that
to a few log2 classes (the ``tokenscale`` stage, spec/codec-v1.md).

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

from kvcodec.models.cachelayout import cache_for_model
from kvcodec.models.attention_tap import ImportanceCollector, tapped
from kvcodec.errors import KvcInputError

DEFAULT_WINDOW = 256


def _tapped_scores(lm: Any, ids: Any, window: int | None, total: int, squared: bool, **forward: Any) -> np.ndarray:
    """One forward of ``ids`` (over ``forward``'s past, if any) with the attention tap; [L, total] scores."""
    import torch

    with torch.inference_mode(), tapped(lm, ImportanceCollector(window, total, list(lm.layout.windows or ()), squared)) as col:
        lm.model(input_ids=ids, logits_to_keep=1, **forward)
    return col.stacked(lm.fingerprint.num_layers)


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


def floored(w: np.ndarray, floor: float) -> np.ndarray:
    """``w`` normalised to sum 1, with ``floor`` of the total spread uniformly: ``(1 - floor) w / sum w + floor / n``."""
    w = np.maximum(np.asarray(w, np.float64), 0.0)
    if not 0.0 <= floor < 1.0:
        raise KvcInputError(f"tokenscale floor must be in [0, 1), got {floor!r}")
    n, total = w.size, float(w.sum())
    if n == 0:
        return w
    if total <= 0:
        return np.full(n, 1.0 / n)
    return (1.0 - floor) * w / total + floor / n


def token_multipliers(w: np.ndarray, sink: int, n_classes: int = 16, log2_step: float = 0.5,
                      min_log2: float = -2.0, power: float = 0.5, max_log2: float | None = None,
                      floor: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Step-multiplier classes of the coded tokens (tokens >= ``sink``) of one layer.

    ``w`` [T]: importance. Ideal multiplier ``m_t = (w_t / w_ref)^-power``,
    ``w_ref`` chosen so the importance-weighted noise power equals that of a
    uniform step (``sum w m^2 = sum w`` over coded tokens): the ``step0`` knob
    keeps its meaning. ``log2 m`` is rounded to multiples of ``log2_step`` and
    clamped to ``[min_log2, min(max_log2, min_log2 + (n_classes-1) log2_step)]``.
    ``floor`` > 0 first spreads that fraction of the coded tokens' importance uniformly (:func:`floored`).
    Returns (classes uint8 [T - sink], table float32 [n_classes]: 2**(min_log2 + c*log2_step)).
    """
    w = np.asarray(w, np.float64)[sink:]
    if floor:
        w = floored(w, floor)
    w = np.maximum(w, 1e-30)
    if max_log2 is not None:
        n_classes = max(1, min(n_classes, int(np.floor((max_log2 - min_log2) / log2_step + 1e-9)) + 1))
    table_l2 = min_log2 + log2_step * np.arange(n_classes)
    table = np.exp2(table_l2).astype(np.float32)
    if w.size == 0:
        return np.zeros(0, np.uint8), table
    lw = np.log2(w)

    def classes(lref: float) -> np.ndarray:
        l2 = -power * (lw - lref)
        return np.clip(np.rint((l2 - min_log2) / log2_step), 0, n_classes - 1).astype(np.int64)

    # sum w m^2 increases with lref: bisect for sum w m^2 = sum w
    lo, hi = float(lw.min()) - 40.0, float(lw.max()) + 40.0
    target = w.sum()
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        m = table[classes(mid)].astype(np.float64)
        if (w * m * m).sum() > target:
            hi = mid
        else:
            lo = mid
    return classes(lo).astype(np.uint8), table
