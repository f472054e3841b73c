"""CacheBlend: answer over several independently cached chunks (issue 9).

Each chunk's KV cache is captured on its own, at positions ``0..n-1`` (a
normal :func:`kvcodec.capture.capture`), so one cache serves the chunk
wherever it lands in a later prompt. To place a chunk at offset ``o`` its
post-RoPE keys are re-rotated by ``o`` (rotations compose:
``R(p + o) = R(o) R(p)``; cos/sin in float64, applied in fp32). Values carry
no position and are reused as they are.

Naively concatenating re-rotated chunk caches is still wrong: each chunk was
computed without seeing the chunks before it (no cross-attention), and every
chunk's first token was an attention sink. :func:`blend` repairs the cache
the way CacheBlend does (Yao et al., 2024; LMCache's blender):

1. layers ``0 .. select_layer-1`` are recomputed for every token (cheap: a
   few layers of the full prefill);
2. at ``select_layer`` the fresh keys of every context token are compared
   with the cached (re-rotated) ones; the ``recompute_ratio`` fraction of
   context tokens with the largest squared key deviation, plus every query
   token, is selected;
3. in ``select_layer`` and every later layer only the selected tokens'
   hidden states are recomputed; their new K/V overwrite the cached ones at
   their positions and they attend over the full, mixed K/V with a causal
   mask (a token sees every key at or before its position).

The last query token's logits come out of the final layer, and the repaired
cache (context + query, positions ``0..T-1``) is ready for generation at
``next_position = T``.

``recompute_ratio = 1`` recomputes everything and equals a full prefill of
the concatenated tokens (fp32 rounding apart); ``recompute_ratio = 0``
recomputes nothing of the context (not even the early layers) and equals
feeding the query onto the naive concatenation of the re-rotated caches.

The forward pass drives the decoder layers' submodules directly
(``input_layernorm``, ``self_attn.{q,k,v,o}_proj``, rotary tables,
``post_attention_layernorm``, ``mlp``, the final ``norm`` and ``lm_head``),
which covers LLaMA-family models (LLaMA, Mistral without sliding window,
Qwen2); anything else is refused with :class:`KvcInputError`.

Python API (used by ``kvc ask``)::

    from kvcodec.blend import blend, generate_blended
    res = blend(lm, [cache_a, cache_b], question_ids)          # BlendResult
    res.logits_last, res.cache.next_position, res.selected
    out = generate_blended(lm, [cache_a, cache_b], question_ids, max_new_tokens=64)
    out.text, out.token_ids
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from .errors import KvcInputError
from .kvcache import KVCache
from .quant.rope import rope_angles

DEFAULT_RATIO = 0.15
DEFAULT_SELECT_LAYER = 1


# -- RoPE re-rotation --------------------------------------------------------
def rope_inv_freq(lm: Any) -> np.ndarray:
    """float64 [dim/2] inverse frequencies of ``lm``'s rotary embedding.

    Taken from the model's own ``rotary_emb.inv_freq`` buffer (the values the
    model rotates its keys with), so re-rotated keys agree with keys the
    model computes at the new positions as closely as fp32 allows. Only plain
    RoPE (``rope_type == "default"``, attention scaling 1) is supported.
    """
    rot = _model_parts(lm)["rotary"]
    if getattr(rot, "rope_type", "default") != "default" or float(getattr(rot, "attention_scaling", 1.0)) != 1.0:
        raise KvcInputError(f"blend supports plain RoPE only, the model uses {getattr(rot, 'rope_type', '?')!r}")
    return rot.inv_freq.detach().cpu().double().numpy()


def rotation_tables(offset: int, inv_freq: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [dim] of a rotation by ``offset`` positions (computed in float64, HF half layout)."""
    ang = rope_angles(offset, inv_freq)  # the codec's RoPE construction, with the model's own frequencies
    return torch.from_numpy(np.cos(ang).astype(np.float32)), torch.from_numpy(np.sin(ang).astype(np.float32))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rerotate_keys(keys: torch.Tensor, offset: int, inv_freq: np.ndarray) -> torch.Tensor:
    """Post-RoPE keys ``[..., tokens, head_dim]`` at positions p -> at positions p + offset.

    Applied in fp32 and returned in fp32; offset 0 returns an fp32 copy.
    Channels beyond the rotary dim (partial rotary) are left untouched.
    """
    k = keys.to(torch.float32)
    if offset == 0:
        return k.clone()
    cos, sin = rotation_tables(offset, inv_freq)
    d = cos.shape[0]
    if d == k.shape[-1]:
        return k * cos + _rotate_half(k) * sin
    out = k.clone()
    out[..., :d] = k[..., :d] * cos + _rotate_half(k[..., :d]) * sin
    return out


def _check_chunk(i: int, c: Any, fp: Any) -> None:
    if not isinstance(c, KVCache):
        raise KvcInputError(f"chunk {i} is a {type(c).__name__}, expected a KVCache")
    fp.check_compatible(c.fingerprint, what=f"chunk {i}")
    if c.positions is not None:
        p = np.asarray(c.positions)
        want = np.arange(c.num_tokens)
        if c.num_tokens != c.num_context_tokens or not np.all(p == want if p.ndim == 1 else p == want[None, None, :]):
            raise KvcInputError(f"chunk {i} is a pruned cache (stored positions are not 0..n-1); blend needs full chunk caches")


def concat_chunks(lm: Any, chunks: Sequence[KVCache]) -> KVCache:
    """Naive concatenation: each chunk's keys re-rotated to its offset, values as they are (fp32)."""
    if not chunks:
        raise KvcInputError("blend needs at least one chunk cache")
    fp = lm.fingerprint
    for i, c in enumerate(chunks):
        _check_chunk(i, c, fp)
    inv = rope_inv_freq(lm)
    offsets = np.cumsum([0] + [c.num_tokens for c in chunks[:-1]])
    # One rotation per chunk over all layers at once (the layers share head_dim and RoPE).
    if len(set(fp.head_dims)) != 1:
        raise KvcInputError("blend needs every layer to share one head_dim")
    rotated = [rerotate_keys(torch.stack(c.keys), int(o), inv) for c, o in zip(chunks, offsets)]
    keys = list(torch.cat(rotated, dim=2).unbind(0))
    values = list(torch.cat([torch.stack(c.values).to(torch.float32) for c in chunks], dim=2).unbind(0))
    ids = np.concatenate([c.token_ids for c in chunks])
    meta = {"blend": {"chunk_lengths": [c.num_tokens for c in chunks], "recompute_ratio": 0.0}}
    return KVCache(keys, values, ids, lm.fingerprint, meta=meta)


# -- the model, taken apart --------------------------------------------------
def _model_parts(lm: Any) -> dict[str, Any]:
    model = lm.model
    base = getattr(model, "model", None)
    need = ("embed_tokens", "layers", "norm", "rotary_emb")
    if base is None or not all(hasattr(base, n) for n in need) or not hasattr(model, "lm_head"):
        raise KvcInputError(f"blend supports LLaMA-family causal LMs, not {type(model).__name__}")
    for i, layer in enumerate(base.layers):
        att = getattr(layer, "self_attn", None)
        ok = att is not None and all(hasattr(att, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
        ok = ok and all(hasattr(layer, n) for n in ("input_layernorm", "post_attention_layernorm", "mlp"))
        if not ok or hasattr(att, "q_norm") or hasattr(att, "k_norm"):
            raise KvcInputError(f"blend cannot drive layer {i} of {type(model).__name__} (not a LLaMA-style decoder layer)")
    from .cachelayout import cache_windows

    cfg = model.config.get_text_config()
    if any(w is not None for w in cache_windows(model.config)):
        raise KvcInputError("blend (CacheBlend) does not support sliding-window attention layers")
    return {"model": model, "base": base, "layers": base.layers, "rotary": base.rotary_emb, "config": cfg}


class _Runner:
    """Row-subset forward passes of a LLaMA-style decoder over an explicit K/V store."""

    def __init__(self, lm: Any) -> None:
        p = _model_parts(lm)
        self.model, self.base, self.layers, self.rotary = p["model"], p["base"], p["layers"], p["rotary"]
        self.cfg = p["config"]
        self.dtype = next(self.model.parameters()).dtype
        att = self.layers[0].self_attn
        self.head_dim = int(att.head_dim)
        self.n_rep = int(att.num_key_value_groups)
        self.scaling = float(att.scaling)

    def rope(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.rotary(x, positions.unsqueeze(0))  # [1, n, d], exactly the model's tables
        return cos[0], sin[0]

    def qkv(self, layer: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, with_q: bool = True):
        """Normed hidden rows x [n, hidden] -> rotated q [H, n, d] (or None), k [Hkv, n, d], v [Hkv, n, d]."""
        att = layer.self_attn
        n = x.shape[0]

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(n, -1, self.head_dim).transpose(0, 1)

        def rot(t: torch.Tensor) -> torch.Tensor:
            return t * cos + _rotate_half(t) * sin

        k = rot(heads(att.k_proj(x)))
        v = heads(att.v_proj(x))
        q = rot(heads(att.q_proj(x))) if with_q else None
        return q, k, v

    def attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, rows: torch.Tensor, contiguous_from_zero: bool):
        """Attention of query rows at (sorted) positions ``rows`` over the keys at or before each (causal).

        Scattered rows are attended in groups by position block, each group
        over keys up to its last row only, so masked-out keys are mostly not
        computed (a masked SDPA cannot skip them). The group holding the last
        row always spans keys 0..rows[-1], exactly as one HF forward of the
        query on top of a cache would.
        """
        if contiguous_from_zero or rows.numel() <= 1:
            return self._attend(q, K, V, rows, contiguous_from_zero)
        block = self.ATTN_BLOCK
        bucket = torch.div(rows, block, rounding_mode="floor")
        cut = (torch.nonzero(bucket[1:] != bucket[:-1]).flatten() + 1).tolist()
        if not cut:
            return self._attend(q, K, V, rows, False)
        bounds = [0] + cut + [rows.numel()]
        parts = [self._attend(q[:, a:b], K, V, rows[a:b], False) for a, b in zip(bounds[:-1], bounds[1:])]
        return torch.cat(parts, dim=0)

    ATTN_BLOCK = 256

    def _attend(self, q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, rows: torch.Tensor, contiguous_from_zero: bool):
        n_keys = int(rows[-1]) + 1
        k = K[:, :n_keys].unsqueeze(0)
        v = V[:, :n_keys].unsqueeze(0)
        if self.n_rep > 1:
            k = k.repeat_interleave(self.n_rep, dim=1)
            v = v.repeat_interleave(self.n_rep, dim=1)
        if contiguous_from_zero and q.shape[1] > 1:
            out = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(0), k, v, is_causal=True, scale=self.scaling)
        else:
            mask = torch.arange(n_keys)[None, :] <= rows[:, None]
            out = torch.nn.functional.scaled_dot_product_attention(
                q.unsqueeze(0), k, v, attn_mask=mask[None, None], scale=self.scaling
            )
        return out[0].transpose(0, 1).reshape(q.shape[1], -1)  # [n, H*d]

    def layer_rows(self, li: int, h: torch.Tensor, rows: torch.Tensor, cos, sin, K, V, contiguous_from_zero: bool):
        """Recompute layer ``li`` for hidden rows h at positions ``rows``; their K/V overwrite K/V[:, rows]."""
        layer = self.layers[li]
        x = layer.input_layernorm(h)
        q, k, v = self.qkv(layer, x, cos, sin)
        K[:, rows] = k.to(K.dtype)
        V[:, rows] = v.to(V.dtype)
        a = self.attend(q, K, V, rows, contiguous_from_zero)
        h = h + layer.self_attn.o_proj(a)
        return h + layer.mlp(layer.post_attention_layernorm(h))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return self.model.lm_head(self.base.norm(h)).float()


# -- blend ------------------------------------------------------------------
@dataclass
class BlendResult:
    """A blended cache ready for generation.

    ``cache`` holds K/V (fp32 or the model dtype) for every context and query
    token at positions ``0..T-1`` and their token ids (chunks then query);
    continue at ``cache.next_position``. ``selected`` are the positions whose
    hidden states were recomputed from ``select_layer`` on (sorted; always
    ends with every query position); ``deviation`` is the per-context-token
    squared key deviation at ``select_layer`` (None at ratio 0).
    """

    cache: KVCache
    logits_last: torch.Tensor
    selected: np.ndarray
    num_context_tokens: int
    num_query_tokens: int
    recompute_ratio: float
    select_layer: int
    timings: dict[str, float] = field(default_factory=dict)
    deviation: np.ndarray | None = None
    query_logits: torch.Tensor | None = None

    @property
    def next_position(self) -> int:
        return self.cache.next_position

    def dynamic_cache(self, lm: Any) -> Any:
        """A fresh transformers DynamicCache of the blended K/V for ``lm``."""
        return self.cache.for_model(lm)


def _validate_ratio(recompute_ratio: Any) -> float:
    try:
        r = float(recompute_ratio)
    except (TypeError, ValueError):
        raise KvcInputError(f"recompute ratio must be a number in [0, 1], got {recompute_ratio!r}") from None
    if not math.isfinite(r) or r < 0.0 or r > 1.0:
        raise KvcInputError(f"recompute ratio must lie in [0, 1], got {recompute_ratio!r}")
    return r


def _query_tensor(lm: Any, query_ids: Any) -> torch.Tensor:
    q = np.asarray(query_ids, dtype=np.int64).reshape(-1)
    if q.size == 0:
        raise KvcInputError("blend needs at least one query token")
    vocab = int(lm.model.config.get_text_config().vocab_size)
    if q.min() < 0 or q.max() >= vocab:
        raise KvcInputError(f"query token ids must lie in [0, {vocab})")
    return torch.as_tensor(q)


@torch.inference_mode()
def blend(
    lm: Any,
    chunks: Sequence[KVCache],
    query_ids: Any,
    recompute_ratio: float = DEFAULT_RATIO,
    select_layer: int = DEFAULT_SELECT_LAYER,
    return_query_logits: bool = False,
) -> BlendResult:
    """Blend independently captured chunk caches, in the given order, under ``query_ids``.

    ``chunks`` are full (unpruned) caches of ``lm``, each captured from
    position 0 (any dtype, e.g. decoded from a `.kvc` of any preset);
    ``recompute_ratio`` in [0, 1] is the fraction of context tokens whose
    hidden states are recomputed from ``select_layer`` on (rounded to the
    nearest token count); ``select_layer`` in [1, layers-1] is where tokens
    are selected by key deviation (layer 0's keys depend on the token alone,
    so they cannot show a deviation). Returns a :class:`BlendResult`.
    """
    t0 = time.perf_counter()
    r = _validate_ratio(recompute_ratio)
    q_ids = _query_tensor(lm, query_ids)
    run = _Runner(lm)
    L = len(run.layers)
    if isinstance(select_layer, bool) or not isinstance(select_layer, (int, np.integer)) or not 1 <= select_layer < L:
        raise KvcInputError(f"select_layer must be an integer in [1, {L - 1}], got {select_layer!r}")
    select_layer = int(select_layer)

    base = concat_chunks(lm, chunks)  # fp32, re-rotated
    n_ctx, n_q = base.num_tokens, int(q_ids.numel())
    T = n_ctx + n_q
    K = [torch.cat([k, torch.zeros(k.shape[0], n_q, k.shape[2])], dim=1).to(run.dtype) for k in base.keys]
    V = [torch.cat([v, torch.zeros(v.shape[0], n_q, v.shape[2])], dim=1).to(run.dtype) for v in base.values]
    t_rot = time.perf_counter()

    all_ids = torch.cat([torch.as_tensor(base.token_ids), q_ids])
    all_pos = torch.arange(T)
    q_pos = torch.arange(n_ctx, T)
    n_sel_ctx = int(round(r * n_ctx))
    timings: dict[str, float] = {"rerotate_s": t_rot - t0}
    deviation = None

    if r == 0.0:
        # Nothing of the context is recomputed: the query runs over the naive concatenation.
        rows = q_pos
        timings["early_s"] = 0.0
        timings["select_s"] = 0.0
        t_sel = time.perf_counter()
        h = run.base.embed_tokens(q_ids)
        cos, sin = run.rope(h, rows)
        for li in range(L):
            h = run.layer_rows(li, h, rows, cos, sin, K[li], V[li], contiguous_from_zero=False)
    else:
        # Layers 0..select_layer-1: every token, fresh K/V for all.
        h = run.base.embed_tokens(all_ids)
        cos_all, sin_all = run.rope(h, all_pos)
        for li in range(select_layer):
            h = run.layer_rows(li, h, all_pos, cos_all, sin_all, K[li], V[li], contiguous_from_zero=True)
        t_early = time.perf_counter()
        timings["early_s"] = t_early - t_rot
        # Select at select_layer: squared deviation of fresh vs cached keys of the context tokens.
        layer = run.layers[select_layer]
        x = layer.input_layernorm(h[:n_ctx])
        _, k_fresh, _ = run.qkv(layer, x, cos_all[:n_ctx], sin_all[:n_ctx], with_q=False)
        dev = (k_fresh.float() - K[select_layer][:, :n_ctx].float()).pow(2).sum(dim=(0, 2))
        deviation = dev.numpy().astype(np.float64)
        if n_sel_ctx >= n_ctx:
            ctx_sel = torch.arange(n_ctx)
        else:
            ctx_sel = torch.sort(torch.topk(dev, n_sel_ctx).indices).values if n_sel_ctx > 0 else torch.zeros(0, dtype=torch.long)
        rows = torch.cat([ctx_sel, q_pos])
        h = h[rows]
        cos, sin = cos_all[rows], sin_all[rows]
        t_sel = time.perf_counter()
        timings["select_s"] = t_sel - t_early
        full = rows.numel() == T
        for li in range(select_layer, L):
            h = run.layer_rows(li, h, rows, cos, sin, K[li], V[li], contiguous_from_zero=full)
    t_rec = time.perf_counter()
    timings["recompute_s"] = t_rec - t_sel
    logits = run.head(h[-n_q:] if return_query_logits else h[-1:])
    t_end = time.perf_counter()
    timings["head_s"] = t_end - t_rec
    timings["total_s"] = t_end - t0

    meta = dict(base.meta)
    meta["blend"] = dict(meta["blend"], recompute_ratio=r, select_layer=select_layer, query_tokens=n_q)
    cache = KVCache(K, V, all_ids.numpy(), lm.fingerprint, meta=meta)
    return BlendResult(
        cache=cache,
        logits_last=logits[-1],
        selected=rows.numpy().astype(np.int64),
        num_context_tokens=n_ctx,
        num_query_tokens=n_q,
        recompute_ratio=r,
        select_layer=select_layer,
        timings=timings,
        deviation=deviation,
        query_logits=logits if return_query_logits else None,
    )


# -- generation ---------------------------------------------------------------
@dataclass
class BlendGeneration:
    token_ids: list[int]
    text: str
    blend: BlendResult
    timings: dict[str, float] = field(default_factory=dict)


@torch.inference_mode()
def continue_from(lm: Any, result: BlendResult, max_new_tokens: int, stop_ids: Sequence[int] | None = None) -> list[int]:
    """Greedy tokens after a blended cache (the first comes from ``logits_last``)."""
    if max_new_tokens < 0:
        raise KvcInputError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    stop = set(int(s) for s in (stop_ids or []))
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    past = result.dynamic_cache(lm)
    pos = result.next_position
    tok = int(result.logits_last.argmax())
    while True:
        out.append(tok)
        if tok in stop or len(out) >= max_new_tokens:
            return out
        logits = lm.model(
            input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=torch.tensor([[pos]]), use_cache=True
        ).logits[0, -1]
        tok, pos = int(logits.argmax()), pos + 1


def _stop_ids(lm: Any) -> list[int]:
    eos = getattr(lm.tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(lm.model.config, "eos_token_id", None)
    if eos is None:
        return []
    return [int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])]


def generate_blended(
    lm: Any,
    chunks: Sequence[KVCache],
    query_ids: Any,
    max_new_tokens: int = 64,
    recompute_ratio: float = DEFAULT_RATIO,
    select_layer: int = DEFAULT_SELECT_LAYER,
    stop_at_eos: bool = True,
) -> BlendGeneration:
    """Blend ``chunks`` under ``query_ids`` and greedily generate up to ``max_new_tokens`` tokens."""
    t0 = time.perf_counter()
    res = blend(lm, chunks, query_ids, recompute_ratio=recompute_ratio, select_layer=select_layer)
    t1 = time.perf_counter()
    toks = continue_from(lm, res, max_new_tokens, _stop_ids(lm) if stop_at_eos else None)
    t2 = time.perf_counter()
    text = lm.tokenizer.decode(toks, skip_special_tokens=True)
    return BlendGeneration(toks, text, res, {"ttft_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0})


__all__ = [
    "BlendGeneration", "BlendResult", "DEFAULT_RATIO", "DEFAULT_SELECT_LAYER", "blend", "concat_chunks",
    "continue_from", "generate_blended", "rerotate_keys", "rope_inv_freq", "rotation_tables",
]
