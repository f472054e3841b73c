"""Rates: the ONE definition of bits per element and of the elements a file is charged against.

Why one: the CLI, the curve, the store paths and the benchmarks each divided bytes by an element
count of their own, and a pruned cache must be charged against its *unpruned* context (the
prune record's ``context_tokens`` for lingua, which re-captures a shorter text), so the rules
live here once.
"""

from __future__ import annotations

from typing import Any


def bits_per_element(nbytes: int, elements: int) -> float:
    """Stored bits per K/V element (``nbytes * 8 / elements``)."""
    return nbytes * 8.0 / elements


def context_tokens(num_context_tokens: int, meta: Any) -> int:
    """Tokens of the original context: the prune record's ``context_tokens`` when it has a valid one."""
    rec = meta.get("prune") if isinstance(meta, dict) else None
    n = rec.get("context_tokens") if isinstance(rec, dict) else None
    if isinstance(n, int) and not isinstance(n, bool) and n > 0:
        return n
    return num_context_tokens


def context_elements(cache: Any) -> int:
    """K+V elements of a cache's *original* context: what a (pruned) cache's file is charged against."""
    fp = cache.fingerprint
    return 2 * fp.num_kv_heads * sum(fp.head_dims) * context_tokens(cache.num_context_tokens, cache.meta)
