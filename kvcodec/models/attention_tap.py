"""Observe a model's real attention queries and keys during one prefill.

H2O scores and the codec's token importance both need softmax(QK^T) of the
context's own queries. Rather than switching the model to eager attention
(slow, and it materialises every layer's full attention map), we register an
attention function that calls the SDPA path every prefill takes
(:func:`kvcodec.models.sdpa_schedule.attention`) and, on the side, hands
each layer's post-RoPE queries and keys to a collector. The prefill's outputs
and KV cache are exactly those of an untapped prefill.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator, Protocol

from kvcodec.errors import KvcInputError
from kvcodec.models.attention_choice import use_attention

_CHUNK = 128  # query rows per softmax block: bounds the collector's memory at any context length
_STATE = threading.local()


class AttentionNotObserved(KvcInputError):
    """The model's attention cannot be observed through the tap: it does not call transformers' attention functions
    (Falcon, Bloom, GPT-J, CodeGen, GPT-Neo in transformers 5.19), or its forward fails on one it did not name (MPT).
    :mod:`kvcodec.models.importance` then reads the attention weights the model itself returns (:func:`tap_sees`)."""


class Collector(Protocol):
    def add(self, layer: int, query: Any, key: Any, scale: float) -> None: ...


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> Any:
    from kvcodec.models.sdpa_schedule import attention

    # the prefill's own output: the same scheduled SDPA as an untapped prefill's, so the K/V are the same bits
    out = attention(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    col = getattr(_STATE, "collector", None)
    if col is not None:
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        col.add(int(module.layer_idx), query, key, float(s))
    return out


@contextlib.contextmanager
def tapped(lm: Any, collector: Collector) -> Iterator[Collector]:
    """Within this block, every attention call of ``lm`` in this thread also feeds ``collector``.

    A forward that fails inside it on the model's own code (MPT builds no attention mask for a function it did not
    name, and then calls a method on the missing mask) is one :class:`KvcInputError` line: that model's attention
    cannot be observed, as for a family that never calls transformers' attention functions
    (:meth:`ImportanceCollector.stacked`)."""
    outer = getattr(_STATE, "collector", None)  # a block inside another one's (tap_sees' probe) gives it back
    _STATE.collector = collector
    try:
        with use_attention(lm, _attention):
            try:
                yield collector
            except (AttributeError, TypeError, ValueError, RuntimeError) as exc:
                raise AttentionNotObserved(f"cannot observe {lm.layout.family}'s attention ({type(exc).__name__}: "
                                           f"{str(exc)[:120]})") from None
    finally:
        _STATE.collector = outer


_SEES: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
_SEES_LOCK = threading.Lock()


def tap_sees(lm: Any) -> bool:
    """Whether :func:`tapped` observes every layer of ``lm``: a two-token forward under the tap, once per model."""
    import torch

    with _SEES_LOCK:
        seen = _SEES.get(lm.model)
    if seen is None:
        col = ImportanceCollector(None, 2, list(lm.layout.windows or ()))
        try:
            with torch.inference_mode(), tapped(lm, col):
                lm.model(input_ids=torch.tensor([[0, 1]]), use_cache=False, logits_to_keep=1)
            col.stacked(lm.fingerprint.num_layers)
            seen = True
        except AttentionNotObserved:
            seen = False
        with _SEES_LOCK:
            _SEES[lm.model] = seen
    return seen


def window_start(first_query: int, total: int, window: int | None) -> int:
    """The absolute position of the first scored query: the last ``window`` of the context's ``total`` tokens (all of
    them for None), but none before ``first_query``, the first one run. The one rule of the collector, the eager
    weights and their normalisation (:func:`kvcodec.models.importance._eager_scores`)."""
    return first_query if window is None else max(first_query, total - window)


class ImportanceCollector:
    """Per layer, the mean ``a`` and ``a^2`` of the context's last ``window`` queries over every key position.

    Queries and keys are placed by absolute position: both end at the context's
    last token ``total - 1`` (a causal layer's last key is its last query's own),
    so the same collector serves a full prefill (queries = keys = the context)
    and a forward of only the last queries over the cached prefix (keys = past
    + those queries; a sliding-window cache layer may hand over fewer keys).
    """

    def __init__(self, window: int | None, total: int, attention_windows: list[int | None] | None = None,
                 squared: bool = True) -> None:
        self.window = window
        self.total = total
        self.attention_windows = attention_windows or []
        self.squared = squared  # collect mean a^2 (tokenscale, rate control) or mean a (H2O)
        self.scores: dict[int, Any] = {}

    def add(self, layer: int, query: Any, key: Any, scaling: float) -> None:
        import torch

        q, k = query[0].float(), key[0].float()
        hq, tq, _ = q.shape
        hkv, tk, _ = k.shape
        T = self.total
        if not tq <= tk <= T:
            raise KvcInputError(f"importance scoring got {tq} queries over {tk} keys of a {T}-token context")
        q0, k0 = T - tq, T - tk  # absolute positions of the first query and the first key
        k_rep = k.repeat_interleave(hq // hkv, dim=0).transpose(1, 2)
        start = window_start(q0, T, self.window)
        acc = torch.zeros(tk, dtype=torch.float64)
        kpos = torch.arange(k0, T)
        sw = self.attention_windows[layer] if layer < len(self.attention_windows) else None
        for a in range(start, T, _CHUNK):
            b = min(T, a + _CHUNK)
            logits = torch.matmul(q[:, a - q0:b - q0], k_rep)
            logits.mul_(scaling)
            qpos = torch.arange(a, b)[:, None]
            if sw is None:  # causal: only keys after the block's first query can be hidden (masking the rest is a no-op)
                c0 = a + 1 - k0
                tail = logits[:, :, c0:]
                tail.masked_fill_(kpos[None, c0:] > qpos, float("-inf"))
            else:  # the layer's own mask: a sliding layer's query sees only its last `sw` keys
                logits.masked_fill_((kpos[None, :] > qpos) | (kpos[None, :] <= qpos - sw), float("-inf"))
            p = torch.softmax(logits, dim=-1)
            if self.squared:
                p.mul_(p)
            acc += p.sum((0, 1)).double()
        scores = torch.zeros(T, dtype=torch.float64)
        scores[k0:] = acc
        if sw is not None:  # no future query (position >= T) can see keys k <= T - sw: no importance at all
            scores[: max(0, T - sw + 1)] = 0.0
        self.scores[layer] = (scores / ((T - start) * hq)).numpy()

    def stacked(self, num_layers: int) -> Any:
        """The scores of every layer, [num_layers, total] float64; one line if a layer never reached the tap."""
        import numpy as np

        missing = [i for i in range(num_layers) if i not in self.scores]
        if missing:
            raise AttentionNotObserved(f"no attention scores for layers {missing[:5]}: this model's attention does not "
                                       "go through transformers' attention functions")
        return np.stack([self.scores[i] for i in range(num_layers)])


EAGER_BYTES = 1 << 28  # attention weights one eager chunk of queries may return, all layers together


def eager_attention_sums(lm: Any, ids: Any, window: int | None, total: int, squared: bool, past: Any = None) -> Any:
    """Per layer, query head and key: the sum over the last ``window`` queries of their attention weight (``a``, or
    ``a^2``), [L, heads, total] float64, read from the weights the model's eager attention returns
    (``output_attentions``): what the tap's collectors compute, for a model the tap cannot observe (:func:`tap_sees`).

    ``ids`` [1, n] are the last ``n`` of ``total`` tokens, run over ``past`` (the cache of the ones before; None: none,
    then a fresh cache, which this extends). Queries before the window are run once, on the model's own attention,
    for their keys only (eager would hold every layer's whole [T, T] map of them); the window's run in chunks whose
    weights, every layer's together, stay under :data:`EAGER_BYTES`.
    """
    import torch
    from transformers import DynamicCache

    from kvcodec.models.attention_choice import whole_model_attention

    T, tq = int(total), int(ids.shape[1])
    q0 = T - tq
    start = window_start(q0, T, window)
    L, hq = lm.fingerprint.num_layers, lm.layout.num_heads
    acc = torch.zeros((L, hq, T), dtype=torch.float64)
    chunk = max(1, EAGER_BYTES // (4 * L * hq * T))
    with torch.inference_mode():
        past = DynamicCache() if past is None else past
        if start > q0:
            lm.model(input_ids=ids[:, : start - q0], past_key_values=past, use_cache=True, logits_to_keep=1,
                     position_ids=torch.arange(q0, start).reshape(1, -1))
    try:
        with whole_model_attention(lm, "eager"), torch.inference_mode():
            for a in range(start, T, chunk):
                b = min(T, a + chunk)
                out = lm.model(input_ids=ids[:, a - q0 : b - q0], past_key_values=past, use_cache=True,
                               logits_to_keep=1, position_ids=torch.arange(a, b).reshape(1, -1), output_attentions=True)
                weights = getattr(out, "attentions", None)
                if weights is None or len(weights) != L or any(w is None or w.dim() != 4 for w in weights):
                    raise KvcInputError(f"{lm.layout.family} returns no attention weights in eager mode: its attention "
                                        "cannot be measured")
                for layer, p in enumerate(weights):
                    p = p[0].double()  # [heads, queries, keys]; the keys end at the chunk's last query
                    acc[layer, :, b - p.shape[-1] : b] += (p * p if squared else p).sum(1)
    except (AttributeError, TypeError, ValueError, RuntimeError) as exc:  # a model without an eager implementation
        raise KvcInputError(f"cannot read {lm.layout.family}'s attention weights in eager mode ({type(exc).__name__}: "
                            f"{str(exc)[:120]})") from None
    return acc
