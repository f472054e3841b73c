"""Apply a `.kvc`'s attention bias (spec/kvc-v1.md §4.6) to a transformers model's attention.

The bias is per (layer, query head, key position) and must reach the pre-softmax logits, which
transformers exposes only through the attention mask. So, while :func:`biased_attention` is active, the
model's attention function (``sdpa`` or ``eager``, looked up by name in transformers' attention registry
at every call) is wrapped: for the self-attention modules of the biased layers, the mask it receives is
turned into an additive float mask ``[batch, heads, queries, keys]`` (causal where transformers passed
none) and the layer's bias is added at the keys' positions; every other module's call goes through
untouched. A key's position comes from the query positions (``position_ids``): the keys a layer attends
to are contiguous and end at the last query (a full layer: all of them from 0; a sliding-window layer:
its window), so key ``j`` of ``k`` is at position ``last_query - k + 1 + j``. Keys at or after the stored
context get no bias (spec: the query and generated tokens are unbiased).

The same wrapper serves the exact steering edit (:mod:`kvcodec.edit.steer`: the context's own prefill
runs under the bias) and the loader (:func:`kvcodec.integrations.hf.generate`): one definition of what
the bias does. The registry is process-wide, so the wrapper is installed while any model in the process
is being steered and keyed by module, never affecting another model's layers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import numpy as np
import torch

from kvcodec.errors import KvcInputError, KvcModelMismatchError
from kvcodec.models.attention_choice import own_attention

__all__ = ["biased_attention", "model_attention_heads"]

_lock = threading.Lock()
_active: dict[int, tuple[torch.Tensor, int]] = {}  # id(attention module) -> (bias [heads, n_ctx], n_ctx)
_saved: dict[str, Any] = {}
_MISSING = object()


def model_attention_heads(lm: Any) -> int:
    """Query heads per layer of ``lm`` (the text config's ``num_attention_heads``)."""
    n = getattr(lm.model.config.get_text_config(decoder=True), "num_attention_heads", None)
    if not isinstance(n, int) or n < 1:
        raise KvcInputError(f"{type(lm.model).__name__}'s config names no num_attention_heads")
    return n


def _base_mask(mask: torch.Tensor | None, q: int, k: int, like: torch.Tensor) -> torch.Tensor:
    """The additive float form [b, 1 | h, q, k] of the mask transformers passed (None: bottom-right causal)."""
    lo = torch.finfo(like.dtype).min
    if mask is None:
        if q == 1:
            return torch.zeros((1, 1, 1, k), dtype=like.dtype, device=like.device)
        i = torch.arange(q, device=like.device)[:, None]
        j = torch.arange(k, device=like.device)[None, :]
        return torch.where(j <= i + (k - q), 0.0, lo).to(like.dtype)[None, None]
    mask = mask[..., :k]
    if mask.dtype == torch.bool:
        return torch.where(mask, 0.0, lo).to(like.dtype)
    return mask.to(like.dtype)


def _wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  *args: Any, **kwargs: Any) -> Any:
        got = _active.get(id(module))
        if got is None:
            return fn(module, query, key, value, attention_mask, *args, **kwargs)
        bias, n_ctx = got
        q, k = query.shape[2], key.shape[2]
        pos = kwargs.get("position_ids")
        last = int(pos.reshape(-1)[-1]) if isinstance(pos, torch.Tensor) and pos.numel() else k - 1
        start = last - k + 1  # position of key 0
        add = torch.zeros((1, bias.shape[0], 1, k), dtype=query.dtype, device=query.device)
        lo, hi = max(0, start), min(n_ctx, last + 1)
        if hi > lo:
            add[0, :, 0, lo - start:hi - start] = bias[:, lo:hi].to(device=query.device, dtype=query.dtype)
        mask = _base_mask(attention_mask if isinstance(attention_mask, torch.Tensor) else None, q, k, query) + add
        return fn(module, query, key, value, mask, *args, **kwargs)

    return attention


def _install() -> None:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    from transformers.models.llama.modeling_llama import eager_attention_forward

    for name, default in (("sdpa", sdpa_attention_forward), ("eager", eager_attention_forward)):
        _saved[name] = ALL_ATTENTION_FUNCTIONS.get(name, _MISSING)
        ALL_ATTENTION_FUNCTIONS[name] = _wrap(ALL_ATTENTION_FUNCTIONS.get(name, default))


def _uninstall() -> None:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    for name, fn in _saved.items():
        if fn is _MISSING:
            del ALL_ATTENTION_FUNCTIONS[name]
        else:
            ALL_ATTENTION_FUNCTIONS[name] = fn
    _saved.clear()


def _attention_modules(lm: Any) -> list[Any]:
    layers = lm.layout.decoder_layers(lm.model)
    mods = [getattr(layer, "self_attn", None) for layer in (layers or [])]
    if not mods or any(m is None for m in mods):
        raise KvcInputError(f"cannot find the self-attention modules of {type(lm.model).__name__}'s decoder layers")
    return mods


@contextlib.contextmanager
def biased_attention(lm: Any, bias: Any, context_tokens: int) -> Iterator[None]:
    """While active, ``lm``'s attention adds ``bias`` (a :class:`kvcodec.format.bias.AttentionBias` over the first
    ``context_tokens`` positions; None: nothing) to the logits of its layers and heads. Refused (one line): a
    bias for another head count, an attention implementation without an explicit mask (flash attention)."""
    if bias is None:
        yield
        return
    heads = model_attention_heads(lm)
    if bias.attention_heads != heads:
        raise KvcModelMismatchError(f"the attention bias is for {bias.attention_heads} heads per layer, the model has {heads}")
    cfg = lm.model.config.get_text_config(decoder=True)
    impl = own_attention(lm, cfg)  # its own, even while another thread runs a kvcodec variant of it
    if impl not in ("sdpa", "eager"):
        raise KvcInputError(f"an attention bias needs an attention implementation that takes a mask (sdpa or eager), "
                            f"the model uses {impl!r}")
    mods = _attention_modules(lm)
    dense = {layer: torch.from_numpy(np.ascontiguousarray(bias.dense(layer, context_tokens))) for layer in bias.layers()}
    with _lock:
        if any(id(mods[layer]) in _active for layer in dense):
            raise KvcInputError("this model is already being steered (nested attention biases are not supported)")
        if not _active:
            _install()
        for layer, b in dense.items():
            _active[id(mods[layer])] = (b, context_tokens)
    try:
        yield
    finally:
        with _lock:
            for layer in dense:
                _active.pop(id(mods[layer]), None)
            if not _active:
                _uninstall()
