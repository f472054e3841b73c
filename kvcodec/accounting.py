"""Rates: the ONE definition of bits per element, of the elements a file is charged against, and of
the pruning record (:class:`PruneRecord`, written by :func:`prune_record`) that says what a pruned cache
was cut from: the accounting every encode, report and pruner goes through.

Why one: the CLI, the curve, the store paths and the benchmarks each divided bytes by an element
count of their own, and a pruned cache must be charged against its *unpruned* context (the
prune record's ``context_tokens`` for lingua, which re-captures a shorter text), so the rules
live here once.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


def bits_per_element(nbytes: int, elements: int) -> float:
    """Stored bits per K/V element (``nbytes * 8 / elements``)."""
    return nbytes * 8.0 / elements


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


@dataclass(frozen=True)
class PruneRecord:
    """``meta["prune"]`` of a pruned cache or file, read leniently: a field of the wrong type is None.

    ``context_tokens`` is the original context (lingua files hold the pruned text's ids, so only
    the record knows it); ``kept_fraction`` the stored share of it; ``positions`` how stored tokens
    map to original positions ("per-token", "per-layer-head", "renumbered", ...).
    """

    method: str | None = None
    spec: str | None = None
    context_tokens: int | None = None
    kept_tokens: int | None = None
    kept_fraction: float | None = None
    positions: str | None = None

    @classmethod
    def from_meta(cls, meta: Any) -> PruneRecord | None:
        rec = meta.get("prune") if isinstance(meta, dict) else None
        if not isinstance(rec, dict):
            return None
        kf = rec.get("kept_fraction")

        def text(k: str) -> str | None:
            v = rec.get(k)
            return v if isinstance(v, str) else None

        return cls(text("method"), text("spec"), _int(rec.get("context_tokens")), _int(rec.get("kept_tokens")),
                   float(kf) if isinstance(kf, (int, float)) and not isinstance(kf, bool) else None, text("positions"))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def prune_record(method: str, spec: str, context_tokens: int, kept_tokens: int, positions: str,
                 **extra: Any) -> dict[str, Any]:
    """The ``meta["prune"]`` record a pruner writes (``kvcodec.prune``): the fields :class:`PruneRecord` reads,
    with ``kept_fraction`` derived here so a record cannot disagree with itself, then the method's own
    (``extra``: H2O's heavy/recent split, lingua's kept mask, ...). ``context_tokens`` is the original context,
    which every rate of the pruned cache is charged against (:func:`context_elements`)."""
    clash = sorted(set(extra) & {"method", "spec", "context_tokens", "kept_tokens", "kept_fraction", "positions"})
    if clash:
        raise ValueError(f"prune_record: {clash} are the record's own fields")
    return {"method": method, "spec": spec, "context_tokens": context_tokens, "kept_tokens": kept_tokens,
            "kept_fraction": kept_tokens / context_tokens, "positions": positions, **extra}


def context_tokens(num_context_tokens: int, meta: Any) -> int:
    """Tokens of the original context: the prune record's ``context_tokens`` when it has a valid one."""
    rec = PruneRecord.from_meta(meta)
    return rec.context_tokens if rec is not None and rec.context_tokens is not None else num_context_tokens


def context_elements(cache: Any) -> int:
    """K+V elements of a cache's *original* context: what a (pruned) cache's file is charged against."""
    fp = cache.fingerprint
    return 2 * fp.num_kv_heads * sum(fp.head_dims) * context_tokens(cache.num_context_tokens, cache.meta)
