"""Token pruning before the codec: H2O (per KV head) and LLMLingua-style (text level).

Specs (see :mod:`kvcodec.prune.budget`): ``"h2o:0.25"``,
``"h2o:heavy=0.1,recent=0.1,window=all"``, ``"lingua:0.5"``,
``"lingua:keep=0.3,segment=200"``.

* :func:`apply_prune` prunes an exact capture by a spec string; this is what
  ``kvc encode --prune`` / ``kvc prune`` call. H2O keeps original positions
  (stored per head); lingua re-captures a shorter text (positions renumbered).
* :func:`capture_with_scores` captures and collects H2O scores in one prefill.
* :func:`capture_lingua` prunes text and captures the pruned text.
* :func:`evaluate_pruned` compares a pruned cache with the exact one on the
  original continuation (works for both methods).

``cache.meta["prune"]`` (JSON) describes what was done; ``kept_fraction``
is the number to show in ``kvc info``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache
from kvcodec.prune.budget import H2OBudget, LinguaBudget, PruneBudget, parse_prune
from kvcodec.prune.h2o import (
    attention_scores,
    capture_with_scores,
    h2o_prune,
    masked_prefill_logits,
    scores_from_meta,
    scores_to_meta,
    select_h2o,
)
from kvcodec.prune.lingua import capture_lingua, lingua_select, original_indices, self_information
from kvcodec.accounting import PruneRecord

__all__ = [
    "H2OBudget", "LinguaBudget", "PruneBudget", "parse_prune", "apply_prune", "capture_with_scores",
    "capture_lingua", "h2o_prune", "lingua_select", "select_h2o", "attention_scores", "self_information",
    "evaluate_pruned", "kept_fraction", "masked_prefill_logits", "original_indices", "scores_to_meta",
    "scores_from_meta", "SCORES_META_KEY",
]

SCORES_META_KEY = "h2o_scores"


def _model_for(cache: KVCache, lm: Any) -> Any:
    if lm is None:
        from kvcodec.models.load import DEFAULT_MODEL, load_model

        lm = load_model(str(cache.meta.get("model") or DEFAULT_MODEL))
    lm.fingerprint.check_compatible(cache.fingerprint)
    return lm


def apply_prune(
    cache: KVCache,
    spec: str | PruneBudget,
    lm: Any = None,
    scores: np.ndarray | None = None,
    question: str | None = None,
) -> KVCache:
    """Prune an exact (unpruned) capture according to ``spec``.

    H2O uses ``scores`` ([layers, kv_heads, T]) if given, else scores stored
    in ``cache.meta["h2o_scores"]`` (when their window matches), else one
    scoring prefill of ``cache.token_ids`` on ``lm`` (loaded from
    ``cache.meta["model"]`` when ``lm`` is None). Lingua always needs the
    model: it scores the text and captures the pruned text again (in the
    cache's dtype). ``question`` enables question-aware lingua ranking.
    """
    budget = parse_prune(spec) if isinstance(spec, str) else spec
    if cache.positions is not None or "prune" in cache.meta or cache.num_tokens != cache.num_context_tokens:
        raise KvcInputError("this cache is already pruned; prune the exact capture instead")
    if isinstance(budget, H2OBudget):
        budget.resolve(cache.num_tokens)  # refuse impossible budgets before any model work
        if scores is None and SCORES_META_KEY in cache.meta:
            stored = cache.meta[SCORES_META_KEY]
            want_w = "all" if budget.window is None else budget.window
            if isinstance(stored, dict) and stored.get("window") == want_w:
                scores = scores_from_meta(stored)
        if scores is None:
            lm = _model_for(cache, lm)
            _, scores = attention_scores(lm, cache.token_ids, budget.window)
        out = h2o_prune(cache, scores, budget)
        out.meta.pop(SCORES_META_KEY, None)
        return out
    if isinstance(budget, LinguaBudget):
        if question is not None and not question.strip():
            raise KvcInputError("the question is empty")
        budget.resolve(cache.num_tokens)
        lm = _model_for(cache, lm)
        kept, rec = lingua_select(lm, cache.token_ids, budget, question)
        from kvcodec.models.capture import capture

        new = capture(lm, token_ids=cache.token_ids[kept])
        if new.dtype != cache.dtype:
            new = new.to(cache.dtype)
        meta = {k: v for k, v in cache.meta.items() if k != SCORES_META_KEY}
        meta["prune"] = rec
        return KVCache(new.keys, new.values, new.token_ids, new.fingerprint, None, meta)
    raise KvcInputError(f"unsupported prune budget {budget!r}")


def kept_fraction(cache: KVCache) -> float:
    """Fraction of the original context a (possibly pruned) cache keeps (its prune record's, :mod:`kvcodec.accounting`)."""
    rec = PruneRecord.from_meta(cache.meta)
    if rec is not None and rec.kept_fraction is not None:
        return rec.kept_fraction
    return cache.num_tokens / cache.num_context_tokens


def _check_same_context(exact: KVCache, pruned: KVCache) -> None:
    rec = pruned.meta.get("prune") or {}
    if rec.get("method") == "lingua":
        if int(rec.get("context_tokens", -1)) != exact.num_context_tokens:
            raise KvcInputError("the lingua-pruned cache was made from a context of another length")
        idx = original_indices(pruned)
        if not np.array_equal(exact.token_ids[idx], pruned.token_ids):
            raise KvcInputError("the lingua-pruned cache's tokens are not a subsequence of the exact context")
    elif not np.array_equal(exact.token_ids, pruned.token_ids):
        raise KvcInputError("the pruned cache encodes different tokens than the exact cache")


def evaluate_pruned(
    lm: Any,
    exact: KVCache,
    pruned: KVCache,
    continuation: np.ndarray,
    greedy_tokens: int = 16,
    exact_logits: torch.Tensor | None = None,
    exact_greedy: list[int] | None = None,
) -> Any:
    """:class:`kvcodec.models.quality.Quality` of ``pruned`` (H2O, lingua, or decoded) vs the exact cache.

    The continuation is the original text's; each cache continues at its own
    ``next_position`` (the original context length for H2O, ``T_kept`` for
    lingua, whose text was renumbered).
    """
    from kvcodec.models.quality import compare_caches

    continuation = np.asarray(continuation, dtype=np.int64).reshape(-1)
    if continuation.size < 2:
        raise KvcInputError("the continuation needs at least 2 tokens")
    lm.fingerprint.check_compatible(pruned.fingerprint)
    _check_same_context(exact, pruned)
    return compare_caches(lm, exact, pruned, continuation, greedy_tokens, exact_logits, exact_greedy)
