"""Observe a model's real attention queries and keys during one prefill.

H2O scores and the codec's token importance both need softmax(QK^T) of the
context's own queries. Rather than switching the model to eager attention
(slow, and it materialises every layer's full attention map), we register an
attention function that calls the normal SDPA kernel and, on the side, hands
each layer's post-RoPE queries and keys to a collector. The prefill's outputs
and KV cache are exactly those of the SDPA path.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, Protocol

ATTN_NAME = "kvc_tap_sdpa"
_STATE = threading.local()


class Collector(Protocol):
    def add(self, layer: int, query: Any, key: Any, scale: float) -> None: ...


def _attention(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, scaling: float | None = None,
               dropout: float = 0.0, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    col = getattr(_STATE, "collector", None)
    if col is not None:
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        col.add(int(module.layer_idx), query, key, float(s))
    return out


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if ATTN_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTN_NAME, _attention)
    if ATTN_NAME not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


@contextlib.contextmanager
def tapped(lm: Any, collector: Collector) -> Iterator[Collector]:
    """Within this block, every attention call of ``lm`` also feeds ``collector``."""
    _register()
    cfg = lm.model.config
    old = cfg._attn_implementation
    _STATE.collector = collector
    cfg._attn_implementation = ATTN_NAME
    try:
        yield collector
    finally:
        cfg._attn_implementation = old
        _STATE.collector = None
