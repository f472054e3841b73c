"""LLMLingua-style text-level pruning: drop the tokens the model finds predictable.

1. One prefill of the context scores every token's self-information
   ``-log p(x_i | x_<i)`` (the first token has no prefix; it is always kept,
   it is also the attention sink of the pruned text).
2. The context is cut into segments of ``segment`` (~200) tokens; each
   segment keeps its highest-self-information tokens. Quotas are split so the
   whole text keeps exactly the target number of tokens (largest remainder).
3. Optional question-aware ranking (a simplified LongLLMLingua "coarse"
   step): each segment is scored by the mean log-likelihood of the question
   given that segment alone, ``log p(question | segment)``; segments are
   ranked and get keep ratios spread linearly from ``ratio * (1 + spread)``
   (most relevant) to ``ratio * (1 - spread)`` (least), capped at 1 and
   re-normalised to the same total. The token-level step stays plain
   self-information (LongLLMLingua's contrastive perplexity is not done).

Semantics: the pruned token sequence is a *new, shorter document*. It is
prefilled from scratch, so positions are renumbered ``0..T_kept-1``,
``token_ids`` are the pruned ids and the cache continues at ``T_kept`` (this
is what LLMLingua does: the compressed prompt replaces the original). Quality
is therefore measured against the *unpruned* exact cache on the original
continuation (:func:`kvcodec.prune.evaluate_pruned`). ``cache.meta["prune"]``
records the method, the ratio, the original length, a hash of the original
ids and a packed bitmask of the kept original indices.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcInputError
from kvcodec.digest import token_ids_sha256
from kvcodec.core.kvcache import KVCache
from kvcodec.prune.budget import LinguaBudget
from kvcodec.accounting import prune_record


@torch.inference_mode()
def self_information(lm: Any, token_ids: np.ndarray) -> np.ndarray:
    """``-log p(x_i | x_<i)`` in nats for every token (``inf`` for the first)."""
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1)
    logits = lm.model(input_ids=ids, use_cache=False, logits_to_keep=0).logits[0, :-1].float()
    nll = torch.logsumexp(logits, -1) - logits.gather(1, ids[0, 1:, None]).squeeze(1)
    return np.concatenate([[np.inf], nll.double().numpy()])


@torch.inference_mode()
def segment_relevance(lm: Any, token_ids: np.ndarray, bounds: list[tuple[int, int]], question_ids: np.ndarray) -> np.ndarray:
    """Mean ``log p(question | segment)`` per segment (each segment alone, then the question)."""
    q = torch.as_tensor(np.asarray(question_ids, dtype=np.int64))
    out = []
    for a, b in bounds:
        seg = torch.as_tensor(np.asarray(token_ids[a:b], dtype=np.int64))
        x = torch.cat([seg, q])[None]
        logits = lm.model(input_ids=x, use_cache=False, logits_to_keep=len(q) + 1).logits[0, :-1].float()
        lp = (logits.gather(1, q[:, None]).squeeze(1) - torch.logsumexp(logits, -1)).mean()
        out.append(float(lp))
    return np.asarray(out)


def _apportion(weights: np.ndarray, caps: np.ndarray, total: int) -> np.ndarray:
    """Integer quotas proportional to ``weights``, each <= its cap, summing to ``total``."""
    caps = caps.astype(np.int64)
    quota = np.zeros_like(caps)
    free = np.ones(len(caps), dtype=bool)
    remaining = total
    # water-filling: give proportional shares, saturate the capped ones, repeat
    for _ in range(len(caps) + 1):
        if remaining <= 0 or not free.any():
            break
        w = np.where(free, weights, 0.0)
        share = remaining * w / w.sum() if w.sum() > 0 else np.where(free, remaining / free.sum(), 0.0)
        room = caps - quota
        over = free & (share >= room)
        if over.any():
            remaining -= int(room[over].sum())
            quota[over] = caps[over]
            free &= ~over
            continue
        base = np.floor(share).astype(np.int64)
        quota += base
        rest = remaining - int(base.sum())
        order = np.argsort(-(share - base), kind="stable")
        for i in order:
            if rest <= 0:
                break
            if free[i] and quota[i] < caps[i]:
                quota[i] += 1
                rest -= 1
        remaining = 0
    if int(quota.sum()) != total:  # cannot happen when total <= caps.sum(); guard anyway
        raise KvcInputError(f"cannot apportion {total} tokens over segments of {caps.tolist()}")
    return quota


def select_lingua(
    info: np.ndarray,
    keep: int,
    segment: int,
    relevance: np.ndarray | None = None,
    spread: float = 0.5,
) -> np.ndarray:
    """Sorted original indices to keep, given per-token self-information ``info``.

    Token 0 (the attention sink: no prefix, so no self-information to rank it by)
    is always kept; ``keep`` is apportioned over the segments (by length, or by
    length and question relevance) and taken by rank within each.
    """
    n = len(info)
    if not 1 <= keep <= n:
        raise KvcInputError(f"cannot keep {keep} of {n} tokens")
    bounds = [(a, min(n, a + segment)) for a in range(0, n, segment)]
    lens = np.array([b - a for a, b in bounds])
    if relevance is None or len(bounds) == 1:
        weights = lens.astype(np.float64)
    else:
        rank = np.argsort(np.argsort(-np.asarray(relevance), kind="stable"), kind="stable")  # 0 = most relevant
        k = len(bounds)
        ramp = 1.0 + spread * (1.0 - 2.0 * rank / (k - 1))
        weights = lens * np.maximum(ramp, 1e-6)
    quota = _apportion(weights, lens, keep)
    if quota[0] == 0:  # token 0 needs a place: take it from the segment rounded up the most
        donor = int(np.argmax(quota - keep * weights / weights.sum()))
        quota[donor] -= 1
        quota[0] = 1
    kept = []
    for (a, b), q in zip(bounds, quota):
        if q <= 0:
            continue
        order = np.argsort(-info[a:b], kind="stable")  # ties: earlier tokens first
        if a == 0:
            order = np.concatenate([[0], order[order != 0]])
        kept.append(a + np.sort(order[:q]))
    return np.concatenate(kept).astype(np.int64)


def pack_mask(kept: np.ndarray, n: int) -> str:
    m = np.zeros(n, dtype=bool)
    m[kept] = True
    return base64.b64encode(np.packbits(m).tobytes()).decode("ascii")


def unpack_mask(b64: str, n: int) -> np.ndarray:
    """Kept original indices from :func:`pack_mask`'s string."""
    try:
        bits = np.unpackbits(np.frombuffer(base64.b64decode(b64), dtype=np.uint8))[:n]
    except (ValueError, TypeError) as exc:
        raise KvcInputError(f"malformed kept-token mask ({exc})") from None
    if bits.size != n:
        raise KvcInputError("kept-token mask is shorter than the original context")
    return np.flatnonzero(bits).astype(np.int64)


def lingua_select(
    lm: Any, token_ids: np.ndarray, budget: LinguaBudget, question: str | None = None
) -> tuple[np.ndarray, dict[str, Any]]:
    """(kept original indices, meta record) for ``token_ids`` under ``budget``."""
    from kvcodec.models.capture import tokenize

    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    n = len(ids)
    keep = budget.resolve(n)
    info = self_information(lm, ids)
    relevance = None
    if question is not None:
        q_ids = tokenize(lm.tokenizer, question if question.startswith(("\n", " ")) else "\n" + question)
        bounds = [(a, min(n, a + budget.segment)) for a in range(0, n, budget.segment)]
        relevance = segment_relevance(lm, ids, bounds, q_ids)
    kept = select_lingua(info, keep, budget.segment, relevance, budget.spread)
    dropped = np.setdiff1d(np.arange(n), kept)
    finite = np.isfinite(info)
    rec = prune_record(
        "lingua", budget.spec(), n, int(len(kept)), "renumbered",
        segment=budget.segment, question_aware=question is not None, original_ids_sha256=token_ids_sha256(ids),
        kept_mask_b64=pack_mask(kept, n),
        kept_mean_nll=float(info[kept][finite[kept]].mean()) if finite[kept].any() else None,
        dropped_mean_nll=float(info[dropped].mean()) if len(dropped) else None,
        reason=f"lowest self-information -log p(token | prefix) within each {budget.segment}-token segment",
    )
    if relevance is not None:
        rec["segment_relevance"] = [round(float(r), 4) for r in relevance]
        rec["spread"] = budget.spread
    return kept, rec


def capture_lingua(
    lm: Any,
    text: str | None = None,
    token_ids: np.ndarray | None = None,
    budget: LinguaBudget | str = "lingua:0.5",
    max_tokens: int | None = None,
    question: str | None = None,
) -> KVCache:
    """Prune the text, then capture the pruned token sequence (positions renumbered)."""
    from kvcodec.models.capture import capture, select_context, tokenize
    from kvcodec.prune.budget import parse_prune

    if isinstance(budget, str):
        budget = parse_prune(budget)
    if not isinstance(budget, LinguaBudget):
        raise KvcInputError("capture_lingua needs a lingua budget")
    if (text is None) == (token_ids is None):
        raise KvcInputError("give exactly one of text or token_ids")
    ids = tokenize(lm.tokenizer, text) if text is not None else np.asarray(token_ids, dtype=np.int64).reshape(-1)
    ids = select_context(ids, max_tokens)
    kept, rec = lingua_select(lm, ids, budget, question)
    cache = capture(lm, token_ids=ids[kept])
    cache.meta["prune"] = rec
    return cache


def original_indices(cache: KVCache) -> np.ndarray:
    """Original indices kept by a lingua-pruned cache (from its meta)."""
    rec = cache.meta.get("prune") or {}
    if rec.get("method") != "lingua":
        raise KvcInputError("the cache is not lingua-pruned")
    return unpack_mask(rec["kept_mask_b64"], int(rec["context_tokens"]))
