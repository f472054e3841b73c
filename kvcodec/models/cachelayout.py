"""Which tokens each layer of a model's KV cache keeps, and the transformers cache that holds them.

Why one module: capture, the HF loader, evaluation and token importance must
agree exactly on each layer's attention pattern, or a loaded `.kvc` would not
continue like a fresh prefill. The pattern is the model layout's attention
windows (:func:`kvcodec.models.layout.attention_windows`, read the way
transformers itself builds a cache for the model): a layer whose cache class is
transformers' ``DynamicSlidingWindowLayer`` (sliding-window and chunked
attention) keeps only its last ``window - 1`` tokens, every other attention
layer keeps all of them. Cache layer types that hold no per-token K/V (linear
attention, convolution states, ...) cannot be stored in a `.kvc` and are
refused with an error naming the type.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from kvcodec.errors import KvcModelMismatchError
from kvcodec.models.hfimport import cache_utils
from kvcodec.models.layout import attention_windows

cache_utils()  # first, so transformers' cache classes import without hqq's cost (kvcodec/models/hfimport.py)
from transformers import DynamicCache  # noqa: E402
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer  # noqa: E402


def cache_windows(config: Any) -> list[int | None]:
    """Per layer: the window of its sliding-window cache layer (it keeps the last ``window - 1`` tokens;
    a query at position q sees keys at q - window < k <= q), or None for a layer that keeps every token.
    Read from the model's config by :func:`kvcodec.models.layout.attention_windows` (a loaded model has
    them as ``lm.layout.windows``)."""
    return attention_windows(config)


def kept_tokens(window: int | None, n: int) -> int:
    """Tokens of an ``n``-token context a layer with ``window`` keeps (what the next query can attend to)."""
    return n if window is None else min(n, window - 1)


def check_layer_tokens(windows: list[int | None], layer_tokens: tuple[int, ...] | list[int], n: int, what: str) -> None:
    """Refuse a cache whose layer ``i`` holds fewer tokens than the model attends to after ``n`` tokens."""
    for i, (w, got) in enumerate(zip(windows, layer_tokens)):
        need = kept_tokens(w, n)
        if got < need:
            kind = "full-attention layer" if w is None else f"sliding-window layer (window {w})"
            raise KvcModelMismatchError(f"{what}: layer {i} holds {got} tokens, but the model's {kind} attends to the last "
                                        f"{need} of its {n} tokens")


Fetch = Callable[[], "tuple[torch.Tensor, torch.Tensor]"]


class _Lazy:
    """Decodes a layer's K/V on first use and knows its token count before (masks are built first).

    ``fetch`` returns batch-1 tensors [1, H, t, D]: the layer's last t tokens, t >= what the layer keeps.
    """

    keys: Any  # set by the transformers layer class this is mixed into
    values: Any

    def _setup(self, fetch: Fetch, n: int, keep: int) -> None:
        self._fetch: Fetch | None = fetch
        self._n, self._keep = n, keep

    def materialize(self) -> None:
        if self._fetch is None:
            return
        k, v = self._fetch()
        self._fetch = None
        t, keep = k.shape[-2], self._keep
        if t < keep:
            raise KvcModelMismatchError(f"a cache layer holds {t} tokens; the model attends to {keep}")
        k, v = k[..., t - keep:, :], v[..., t - keep:, :]
        self.dtype, self.device = k.dtype, k.device
        self.keys, self.values = k, v
        self._on_device(k.device)
        self.is_initialized = True

    def _on_device(self, device: torch.device) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        self.materialize()
        if self.keys.dtype != key_states.dtype or self.keys.device != key_states.device:
            self.keys = self.keys.to(key_states.device, key_states.dtype)
            self.values = self.values.to(value_states.device, value_states.dtype)
        return super().update(key_states, value_states, *args, **kwargs)  # type: ignore[misc]


class LazyKvcLayer(_Lazy, DynamicLayer):
    """A full-attention ``DynamicLayer`` decoded on first use."""

    def __init__(self, fetch: Fetch, n: int) -> None:
        DynamicLayer.__init__(self)
        self._setup(fetch, n, n)

    def get_seq_length(self) -> int:
        return self._n if self._fetch is not None else DynamicLayer.get_seq_length(self)


class LazyKvcSlidingLayer(_Lazy, DynamicSlidingWindowLayer):
    """transformers' ``DynamicSlidingWindowLayer`` as a fresh prefill of ``n`` tokens leaves it (its last
    ``window - 1`` tokens, ``cumulative_length`` n), decoded on first use: masks and later updates behave
    exactly as after that prefill."""

    def __init__(self, fetch: Fetch, n: int, window: int) -> None:
        DynamicSlidingWindowLayer.__init__(self, sliding_window=window)
        self.cumulative_length = n
        self._setup(fetch, n, kept_tokens(window, n))

    def _on_device(self, device: torch.device) -> None:
        self._sliding_window_tensor = self._sliding_window_tensor.to(device)


def hf_cache(windows: list[int | None], fetchers: list[Fetch], n: int) -> Any:
    """A transformers ``DynamicCache`` for ``n`` context tokens whose layers decode lazily, each of the
    class a fresh prefill would give it (:func:`cache_windows`)."""
    cache = DynamicCache()
    cache.layers = [LazyKvcLayer(f, n) if w is None else LazyKvcSlidingLayer(f, n, w) for w, f in zip(windows, fetchers)]
    cache.layer_class_to_replicate = None
    return cache


def cache_for(lm: Any, cache: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """The transformers cache of ``cache`` (a KVCache) for ``lm``, holding ``pairs``: each layer's K/V as
    [1, H, t, D] tensors (e.g. cast to the model's dtype, or autograd leaves), used as given."""
    windows = list(lm.layout.windows)
    check_layer_tokens(windows, cache.layer_tokens, cache.num_tokens, "the cache")
    return hf_cache(windows, [_given(k, v) for k, v in pairs], cache.num_tokens)


def _given(k: torch.Tensor, v: torch.Tensor) -> Fetch:
    return lambda: (k, v)


@torch.inference_mode()
def prefill_kv(model: Any, token_ids: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the K/V [H, t, D] (batch 1) a fresh prefill of ``token_ids`` leaves in the model's own cache."""
    cache_windows(model.config)  # refuses layer types without per-token K/V
    cache = DynamicCache(config=model.config)
    ids = torch.as_tensor(token_ids, dtype=torch.long).reshape(1, -1)
    model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    layers: list[Any] = list(cache.layers)  # attention layers only (cache_windows refuses the others)
    return [(layer.keys[0].detach().clone(), layer.values[0].detach().clone()) for layer in layers]


def cache_for_model(lm: Any, cache: Any) -> Any:
    """A DynamicCache for ``lm`` (a LoadedModel) of the layer classes a fresh prefill would give it
    (sliding-window layers included); refuses a cache (a KVCache) of another model."""
    lm.fingerprint.check_compatible(cache.fingerprint)
    dtype = next(lm.model.parameters()).dtype
    return cache_for(lm, cache, [(k.to(dtype).unsqueeze(0).clone(), v.to(dtype).unsqueeze(0).clone())
                                 for k, v in zip(cache.keys, cache.values)])


def cache_prefix(cache: Any, n: int, lm: Any) -> Any:
    """The KVCache of the first ``n`` context tokens of the unpruned ``cache``.

    Full layers are sliced (a causal model's KV prefix is the prefix's KV). A sliding-window layer
    dropped the tokens the prefix's own window would keep, so a ragged cache's prefix is prefilled
    again on ``lm``.
    """
    if not cache.ragged or cache.positions is not None or not 1 <= n <= cache.num_tokens:
        return cache.prefix(n)
    from kvcodec.core.kvcache import KVCache

    lm.fingerprint.check_compatible(cache.fingerprint)
    kv = prefill_kv(lm.model, cache.token_ids[:n])
    dt = cache.dtype  # built in the cache's own dtype (the model may compute in another), not built and then converted
    return KVCache([k.to(dt) for k, _ in kv], [v.to(dt) for _, v in kv], cache.token_ids[:n], cache.fingerprint, None,
                   dict(cache.meta))
