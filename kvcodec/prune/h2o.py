"""H2O (heavy-hitter oracle) pruning of a captured KV cache, per KV head.

Scores come from the model's *real* attention probabilities during prefill.
A custom attention function (registered with transformers'
``AttentionInterface`` and switched on only for the scoring prefill) calls the
normal SDPA kernel for the layer output and, on the side, recomputes
``softmax(Q K^T * scale + causal mask)`` for the chosen queries from the very
post-RoPE ``Q``/``K`` tensors the layer used, then sums the probability each
key receives. With GQA the query heads of a KV group are summed, so the score
is per KV head (the unit a cache stores).

* ``window=W`` (default 64): only the last ``W`` queries of the context vote
  (SnapKV/kvpress style: what the *end* of the document attends to, which is
  what the next tokens will resemble). Cost ``O(W T)`` per head.
* ``window=None`` (``window=all``): every query votes, accumulated over the
  whole prefill as in the H2O paper (biased toward early tokens, which
  receive votes from more queries). Cost ``O(T^2)``, done in query chunks.

Selection keeps, for every (layer, KV head), the ``recent`` last tokens plus
the ``heavy`` top-scoring older tokens; every head keeps the same count (HF
caches and the .kvc container need one token count), but each head may keep
different tokens, so positions are stored per head as ``(layers, kv_heads,
T_kept)`` original positions (collapsed to ``(T_kept,)`` when every head kept
the same tokens).

Why gathering is exact: keys are stored post-RoPE, i.e. already rotated at
their original positions, so a kept key is bit-identical to what the full
cache holds; RoPE attention depends only on ``pos(q) - pos(k)``, so new
queries must be rotated at ``next_position + i`` (the original continuation
positions), never at ``T_kept + i``. ``kvcodec.models.quality.continue_logits``
does that; ``tests/prune/test_prune_model.py`` checks both against a full prefill
with a per-head attention mask hiding the dropped tokens.
"""

from __future__ import annotations

import base64
import threading
from typing import Any

import numpy as np
import torch

from kvcodec.models.attention_tap import eager_attention_sums, tap_sees, tapped
from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache
from kvcodec.prune.budget import DEFAULT_WINDOW, H2OBudget
from kvcodec.accounting import prune_record

_STATE = threading.local()
_CHUNK = 256


class _Collector:
    def __init__(self, window: int | None, num_kv_heads: int):
        self.window = window
        self.kv_heads = num_kv_heads
        self.scores: dict[int, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        # query [1, Hq, Tq, d], key [1, Hkv, Tk, d]; prefill without past: Tq == Tk
        q, k = query[0].float(), key[0].float()
        hq, tq, _ = q.shape
        hkv, tk, _ = k.shape
        if tq != tk:
            raise KvcInputError("H2O scoring expects one prefill without a past cache")
        group = hq // hkv
        k_rep = k.repeat_interleave(group, dim=0)  # [Hq, Tk, d], query head h uses kv head h // group
        start = 0 if self.window is None else max(0, tq - self.window)
        acc = torch.zeros(hq, tk, dtype=torch.float64)
        kpos = torch.arange(tk)
        for a in range(start, tq, _CHUNK):
            b = min(tq, a + _CHUNK)
            logits = torch.matmul(q[:, a:b], k_rep.transpose(1, 2)) * scaling  # [Hq, b-a, Tk]
            qpos = torch.arange(a, b)
            logits = logits.masked_fill(kpos[None, :] > qpos[:, None], float("-inf"))
            acc += torch.softmax(logits, dim=-1).sum(1).double()
        self.scores[layer] = acc.view(hkv, group, tk).sum(1).float()

    def result(self, num_layers: int) -> np.ndarray:
        missing = [i for i in range(num_layers) if i not in self.scores]
        if missing:
            # tap_sees() saw every layer on its probe: a layer missing here skipped the tap on this input only
            raise KvcInputError(f"no attention scores were collected for layers {missing[:5]} of {num_layers}: this "
                                f"model's attention bypassed the tap on this input (its probe saw every layer)")
        return torch.stack([self.scores[i] for i in range(num_layers)]).numpy()


@torch.inference_mode()
def attention_scores(lm: Any, token_ids: np.ndarray, window: int | None = DEFAULT_WINDOW) -> tuple[Any, np.ndarray]:
    """One prefill of ``token_ids`` that also returns H2O scores ``[layers, kv_heads, T]`` (float32).

    Returns (HF DynamicCache, scores). The cache is the normal prefill cache
    (the SDPA path is unchanged), so it can be wrapped as the exact capture.
    """
    if window is not None and window < 1:
        raise KvcInputError(f"the H2O query window must be >= 1, got {window}")
    from transformers import DynamicCache

    windows = getattr(lm, "attention_windows", None) or []
    if any(w is not None for w in windows):
        raise KvcInputError("H2O token pruning of sliding-window models is not supported (their layers keep different "
                            "tokens; use the lossy presets, whose token importance follows each layer's window)")
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1)
    if not tap_sees(lm):  # attention the tap cannot observe: a plain prefill, and the weights its eager attention returns
        out = lm.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        L, hkv, T = lm.fingerprint.num_layers, lm.fingerprint.num_kv_heads, ids.shape[1]
        sums = eager_attention_sums(lm, ids, window, T, squared=False)
        return out.past_key_values, sums.view(L, hkv, -1, T).sum(2).float().numpy()
    with tapped(lm, _Collector(window, lm.fingerprint.num_kv_heads)) as col:
        out = lm.model(input_ids=ids, past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
    return out.past_key_values, col.result(lm.fingerprint.num_layers)


def capture_with_scores(
    lm: Any,
    text: str | None = None,
    token_ids: np.ndarray | None = None,
    max_tokens: int | None = None,
    window: int | None = DEFAULT_WINDOW,
) -> tuple[KVCache, np.ndarray]:
    """Exact KV cache of ``text`` (or ``token_ids``) plus H2O scores ``[layers, kv_heads, T]``."""
    from kvcodec.models.capture import cache_from_hf, context_ids

    ids = context_ids(lm, text, token_ids, max_tokens)
    past, scores = attention_scores(lm, ids, window)
    return cache_from_hf(past, ids, lm, meta={"model": lm.name}), scores


def select_h2o(scores: np.ndarray, heavy: int, recent: int) -> np.ndarray:
    """Kept original indices ``[layers, kv_heads, heavy + recent]`` (ascending per head)."""
    scores = np.asarray(scores)
    if scores.ndim != 3:
        raise KvcInputError(f"H2O scores must be [layers, kv_heads, tokens], got shape {scores.shape}")
    L, H, T = scores.shape
    if heavy < 0 or recent < 0 or heavy + recent > T or heavy + recent == 0:
        raise KvcInputError(f"cannot keep heavy={heavy} + recent={recent} tokens of {T}")
    rec = np.broadcast_to(np.arange(T - recent, T), (L, H, recent))
    if heavy:
        old = scores[..., : T - recent].astype(np.float64)
        # stable: ties broken toward earlier tokens
        top = np.argsort(-old, axis=-1, kind="stable")[..., :heavy]
        kept = np.concatenate([np.sort(top, axis=-1), rec], axis=-1)
    else:
        kept = np.array(rec)
    return kept.astype(np.int64)


def gather_tokens(cache: KVCache, kept: np.ndarray) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys/values of ``cache`` restricted to ``kept`` ([layers, kv_heads, T_kept] indices into its tokens)."""
    keys, values = [], []
    for li, (k, v) in enumerate(zip(cache.keys, cache.values)):
        idx = torch.as_tensor(kept[li], dtype=torch.long)[..., None].expand(-1, -1, k.shape[-1])
        keys.append(torch.gather(k, 1, idx).contiguous())
        values.append(torch.gather(v, 1, idx).contiguous())
    return keys, values


def _check_unpruned(cache: KVCache) -> None:
    if cache.positions is not None or cache.num_tokens != cache.num_context_tokens or "prune" in cache.meta:
        raise KvcInputError("this cache is already pruned; H2O needs the exact, unpruned capture")
    if cache.ragged:
        raise KvcInputError("H2O token pruning of a cache with sliding-window layers (ragged layout) is not supported")


def h2o_prune(cache: KVCache, scores: np.ndarray, budget: H2OBudget) -> KVCache:
    """Prune an exact cache with precomputed scores; positions keep the original token positions."""
    _check_unpruned(cache)
    T = cache.num_tokens
    scores = np.asarray(scores)
    want = (cache.num_layers, cache.fingerprint.num_kv_heads, T)
    if scores.shape != want:
        raise KvcInputError(f"H2O scores have shape {scores.shape}, the cache needs {want}")
    heavy, recent = budget.resolve(T)
    kept = select_h2o(scores, heavy, recent)
    keys, values = gather_tokens(cache, kept)
    same = bool((kept == kept[:1, :1]).all())
    positions = kept[0, 0].copy() if same else kept
    meta = dict(cache.meta)
    meta["prune"] = prune_record(
        "h2o", budget.spec(), T, heavy + recent, "original",
        heavy=heavy, recent=recent, window="all" if budget.window is None else budget.window, per_head=not same,
        reason="per KV head: the recent last tokens plus the heavy tokens that received the most attention",
    )
    return KVCache(keys, values, cache.token_ids, cache.fingerprint, positions, meta)


def scores_to_meta(scores: np.ndarray, window: int | None) -> dict[str, Any]:
    """JSON-serialisable form of scores (float16, base64) for in-memory or safetensors meta.

    Large (~2.7 bytes per token, layer and KV head): HDF5 attributes cap at
    64 KiB, so for .h5 captures keep scores in a sidecar or recompute them.
    """
    a = np.ascontiguousarray(np.asarray(scores, dtype=np.float16))
    return {"shape": list(a.shape), "dtype": "float16", "window": "all" if window is None else window,
            "b64": base64.b64encode(a.tobytes()).decode("ascii")}


def scores_from_meta(obj: Any) -> np.ndarray:
    try:
        shape = tuple(int(x) for x in obj["shape"])
        a = np.frombuffer(base64.b64decode(obj["b64"]), dtype=np.float16)
        return a.reshape(shape).astype(np.float32)
    except (KeyError, TypeError, ValueError) as exc:
        raise KvcInputError(f"malformed H2O scores in the cache metadata ({exc})") from None


# -- an independent reference for pruned continuation ----------------------
def _masked_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:
    """Eager attention where continuation queries cannot see the dropped context tokens of each head.

    Chosen for the thread inside :func:`masked_prefill_logits` only (:mod:`kvcodec.models.attention_choice`), which
    sets the mask; a call without one (never expected) is transformers' own SDPA, not an error."""
    state = getattr(_STATE, "masked", None)
    if state is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    ctx_len, visible = state  # int, [layers, kv_heads, ctx_len] bool
    hq, tq, d = query.shape[1:]
    hkv, tk = key.shape[1], key.shape[2]
    group = hq // hkv
    s = scaling if scaling is not None else d ** -0.5
    k = key.repeat_interleave(group, dim=1)
    v = value.repeat_interleave(group, dim=1)
    qpos = torch.arange(tk - tq, tk)
    kpos = torch.arange(tk)
    allowed = (kpos[None, :] <= qpos[:, None]).expand(hq, tq, tk).clone()
    vis = torch.as_tensor(visible[int(module.layer_idx)]).repeat_interleave(group, dim=0)  # [Hq, ctx_len]
    rows = qpos >= ctx_len
    allowed[:, rows, :ctx_len] &= vis[:, None, :]
    logits = torch.matmul(query, k.transpose(2, 3)) * s
    logits = logits.masked_fill(~allowed[None], float("-inf"))
    w = torch.softmax(logits, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(w, v).transpose(1, 2).contiguous(), w


@torch.inference_mode()
def masked_prefill_logits(lm: Any, token_ids: np.ndarray, context_len: int, kept: np.ndarray) -> torch.Tensor:
    """Reference logits of ``token_ids[context_len:]`` from ONE full prefill of ``token_ids``.

    The context is processed normally (so its K/V equal the exact capture);
    the continuation tokens are at their natural positions and, in every
    layer and head, attend only to the kept context tokens (``kept``:
    ``[layers, kv_heads, T_kept]`` or ``[T_kept]`` original indices) plus the
    continuation so far. This is what a correctly loaded pruned cache must
    reproduce; it involves no cache gather and no explicit position ids.
    """
    from kvcodec.models.attention_choice import use_attention

    L, H = lm.fingerprint.num_layers, lm.fingerprint.num_kv_heads
    kept = np.asarray(kept)
    if kept.ndim == 1:
        kept = np.broadcast_to(kept, (L, H, kept.shape[0]))
    visible = np.zeros((L, H, context_len), dtype=bool)
    np.put_along_axis(visible, kept, True, axis=-1)
    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).reshape(1, -1)
    _STATE.masked = (context_len, visible)
    try:
        with use_attention(lm, _masked_attention):  # this thread's forwards only
            out = lm.model(input_ids=ids, use_cache=False, logits_to_keep=torch.arange(context_len, ids.shape[1]))
    finally:
        _STATE.masked = None
    return out.logits[0].float()
