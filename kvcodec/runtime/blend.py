"""CacheBlend: answer over several independently cached chunks (issue 9).

Each chunk's KV cache is captured on its own, at positions ``0..n-1`` (a
normal :func:`kvcodec.models.capture.capture`), so one cache serves the chunk
wherever it lands in a later prompt. To place a chunk at offset ``o`` its
post-RoPE keys are re-rotated by ``o`` (rotations compose:
``R(p + o) = R(o) R(p)``), each layer with its own RoPE from the model layout
(:meth:`kvcodec.models.layout.ModelLayout.layer_rope`: Gemma 3's local and
global layers rotate with different thetas, SmolLM3's NoPE layers not at all;
cos/sin in float64, applied in fp32). Values carry no position and are reused as they are. A
sliding-window layer of a chunk holds only the chunk's last ``window - 1``
tokens (the ragged layout, :mod:`kvcodec.models.cachelayout`); its earlier tokens
are missing from the blend's store and masked out, which only rows of that
same chunk could have attended to.

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
   their positions and they attend over the full, mixed K/V with each
   layer's own mask (causal; for a sliding-window layer also within the
   window).

Both passes are the model's OWN forward (embedding scale, q/k norms, biases,
extra norms, per-layer-type RoPE: whatever the family does), driven through
a transformers cache whose layers (:class:`_BlendLayer`) hold the whole
position-indexed K/V store, scatter the rows being computed into it and
return all of it, and an explicit 4D mask per layer type. Step 1 is one
forward of every token that stops inside ``select_layer``'s cache update
(where the fresh keys arrive); step 3 is one forward of the selected tokens
whose hidden state entering ``select_layer`` is replaced by step 1's.

The last query token's logits come out of the model's head, and the repaired
cache (context + query, positions ``0..T-1``; sliding-window layers keep
their last ``window - 1`` tokens, as after a prefill) is ready for
generation at ``next_position = T``.

``recompute_ratio = 1`` recomputes everything and equals a full prefill of
the concatenated tokens (fp32 rounding apart); ``recompute_ratio = 0``
recomputes nothing of the context (not even the early layers) and equals
feeding the query onto the naive concatenation of the re-rotated caches.
Refused with one :class:`KvcInputError` line: RoPE whose frequencies depend on
the sequence length (dynamic NTK, LongRoPE: no rotation re-positions it), cache layers
without per-token K/V, and attention implementations that take no explicit
mask (flash attention).

Python API (used by ``kvc ask``)::

    from kvcodec.runtime.blend import blend, generate_blended
    res = blend(lm, [cache_a, cache_b], question_ids)          # BlendResult
    res.logits_last, res.cache.next_position, res.selected
    out = generate_blended(lm, [cache_a, cache_b], question_ids, max_new_tokens=64)
    out.text, out.token_ids
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcodec.integrations.hf import check_answer_length, land, model_device, target_device
from kvcodec.models.attention_choice import own_attention
from kvcodec.models.cachelayout import cache_for_model
from kvcodec.models.cachelayout import DynamicCache, DynamicLayer, check_layer_tokens, kept_tokens
from kvcodec.models.layout import DYNAMIC, NOPE, PLAIN, SCALED, STATIC_SCALED_ROPE
from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache, as_token_ids
from kvcodec.models.capture import check_fits
from kvcodec.codecs.rope_tables import inv_freq, rope_angles
from kvcodec.models.rope_probe import AdjacentPairs, check_rotation, from_half_pairs, to_half_pairs

DEFAULT_RATIO = 0.15
DEFAULT_SELECT_LAYER = 1


# -- RoPE re-rotation --------------------------------------------------------
def layer_inv_freqs(lm: Any) -> list[np.ndarray]:
    """Per layer, the float64 [rotary_dim/2] inverse frequencies its keys were rotated with (none for NoPE).

    Each layer's RoPE is the model layout's (:meth:`kvcodec.models.layout.ModelLayout.layer_rope`).
    Plain RoPE: from the fingerprint's canonical parameters (flat or nested per layer type) read
    exactly as the codec's rope stage reads them, with the stage's own :func:`inv_freq`, so blend
    and codec agree on every layer's rotation. Statically rescaled RoPE (linear, llama3, YaRN),
    which the rope stage does not model, is still a rotation by ``position * inv_freq`` (YaRN's
    attention factor scales cos and sin alike, so it rides along with the stored keys): its
    frequencies are transformers' own for the variant. Variants whose frequencies depend on the
    sequence length (dynamic NTK, LongRoPE) cannot be re-positioned by a rotation and are refused
    naming the layer and type. The model's own forward confirms each layer's reading once
    (:mod:`kvcodec.models.rope_probe`), marking layers that rotate adjacent pairs (Cohere, Llama 4).
    """
    layout = lm.layout
    out: list[np.ndarray] = []
    for i in range(layout.num_layers):
        r = layout.layer_rope(i)
        if r.kind == NOPE:  # a NoPE layer: its keys carry no position, nothing to re-rotate
            out.append(np.zeros(0, np.float64))
        elif r.kind == PLAIN:
            out.append(inv_freq(r.theta, r.dim))
        elif r.kind == SCALED:
            out.append(np.array(r.inv_freq, np.float64))
        elif r.kind == DYNAMIC:
            raise KvcInputError(f"blend re-positions chunk keys by a RoPE rotation; layer {i} uses RoPE type {r.rope_type!r}, "
                                "whose frequencies depend on the sequence length (supported: default, "
                                f"{', '.join(STATIC_SCALED_ROPE)})")
        else:  # the rope stage found no plain RoPE parameters either
            raise KvcInputError(f"blend re-positions chunk keys by a RoPE rotation; layer {i}'s config names no "
                                "RoPE parameters (positions from learned or absolute embeddings cannot be re-positioned)")
    return check_rotation(lm, out, rerotate_keys)  # confirmed by the model's forward, adjacent pairs marked


def rotation_tables(offset: int, freqs: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin fp32 [rotary_dim] of a rotation by ``offset`` positions (computed in float64, HF half layout)."""
    ang = rope_angles(offset, freqs)  # the codec's RoPE construction
    return torch.from_numpy(np.cos(ang).astype(np.float32)), torch.from_numpy(np.sin(ang).astype(np.float32))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rerotate_keys(keys: torch.Tensor, offset: int, freqs: np.ndarray) -> torch.Tensor:
    """Post-RoPE keys ``[..., tokens, head_dim]`` at positions p -> at positions p + offset.

    Applied in fp32 and returned in fp32; offset 0 returns an fp32 copy.
    Channels beyond the rotary dim (partial rotary) are left untouched.
    """
    k = keys.to(torch.float32)
    if offset == 0 or len(freqs) == 0:  # len 0: a NoPE layer (layer_inv_freqs)
        return k.clone()
    if isinstance(freqs, AdjacentPairs):  # Cohere, Llama 4, ...: the same rotation, channels gathered into HF's pairing
        d = 2 * len(freqs)
        return from_half_pairs(rerotate_keys(to_half_pairs(k, d), offset, np.asarray(freqs)), d)
    cos, sin = rotation_tables(offset, freqs)
    cos, sin = cos.to(k.device), sin.to(k.device)  # the tables are built on the host; the keys may be on a GPU
    d = cos.shape[0]
    if d == k.shape[-1]:
        return k * cos + _rotate_half(k) * sin
    out = k.clone()
    out[..., :d] = k[..., :d] * cos + _rotate_half(k[..., :d]) * sin
    return out


def _check_chunk(i: int, c: Any, fp: Any, windows: list[int | None]) -> None:
    if not isinstance(c, KVCache):
        raise KvcInputError(f"chunk {i} is a {type(c).__name__}, expected a KVCache")
    fp.check_compatible(c.fingerprint, what=f"chunk {i}")
    if c.positions is not None:
        p = np.asarray(c.positions)
        want = np.arange(c.num_tokens)
        if c.num_tokens != c.num_context_tokens or not np.all(p == want if p.ndim == 1 else p == want[None, None, :]):
            raise KvcInputError(f"chunk {i} is a pruned cache (stored positions are not 0..n-1); blend needs full chunk caches")
    check_layer_tokens(windows, c.layer_tokens, c.num_tokens, f"chunk {i}")


@dataclass
class _Placed:
    """The chunks at their offsets: per layer fp32 K/V [H, T, D] over ``T = context + extra`` positions and
    which positions hold a cached token (a sliding-window layer lacks each chunk's tokens before its last
    ``window - 1``; the ``extra`` query positions are empty)."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    stored: list[torch.Tensor]  # bool [T] per layer
    token_ids: np.ndarray  # the context's
    lengths: list[int]
    windows: list[int | None]


def _place(lm: Any, chunks: Sequence[KVCache], extra: int, device: torch.device) -> _Placed:
    """The chunks placed on ``device`` (chunks already there, e.g. decoded on the GPU, are never copied
    through the host)."""
    if not chunks:
        raise KvcInputError("blend needs at least one chunk cache")
    fp = lm.fingerprint
    windows = list(lm.layout.windows)
    for i, c in enumerate(chunks):
        _check_chunk(i, c, fp, windows)
    lengths = [c.num_tokens for c in chunks]
    # before any allocation: chunks + query past the model's window were placed and run (memory growing with them)
    check_fits(lm, sum(lengths) + extra, "the blended chunks + query")
    freqs = layer_inv_freqs(lm)
    offsets = [int(o) for o in np.cumsum([0] + lengths[:-1])]
    T = sum(lengths) + extra
    keys, values, stored = [], [], []
    for li in range(fp.num_layers):
        ks = [land(c.keys[li], device) for c in chunks]
        # allocated like the chunks' own tensors: on the device, of their tensor type
        K = ks[0].new_zeros((fp.num_kv_heads, T, fp.head_dims[li]), dtype=torch.float32)
        V = torch.zeros_like(K)
        ok = torch.zeros(T, dtype=torch.bool, device=device)
        for c, k, o in zip(chunks, ks, offsets):
            a, b = o + c.layer_offset(li), o + c.num_tokens
            K[:, a:b] = rerotate_keys(k, o, freqs[li])
            V[:, a:b] = land(c.values[li], device, torch.float32)
            ok[a:b] = True
        keys.append(K)
        values.append(V)
        stored.append(ok)
    return _Placed(keys, values, stored, np.concatenate([c.token_ids for c in chunks]), lengths, windows)


def _ragged(placed_keys: list[torch.Tensor], windows: list[int | None], n: int) -> list[torch.Tensor]:
    """Each layer's K or V [H, n, D] cut to what its cache class keeps after ``n`` tokens (:func:`kept_tokens`)."""
    return [k[:, n - kept_tokens(w, n):].contiguous() for k, w in zip(placed_keys, windows)]


def concat_chunks(lm: Any, chunks: Sequence[KVCache], device: torch.device | str | None = None) -> KVCache:
    """Naive concatenation: each chunk's keys re-rotated to its offset, values as they are (fp32), on ``device``
    (default: the model's).

    A sliding-window layer keeps the concatenation's last ``window - 1`` tokens, which its chunks always
    hold (a token that close to the end is at least that close to its own chunk's end).
    """
    p = _place(lm, chunks, 0, target_device(device, lm))
    n = len(p.token_ids)
    meta = {"blend": {"chunk_lengths": p.lengths, "recompute_ratio": 0.0}}
    return KVCache(_ragged(p.keys, p.windows, n), _ragged(p.values, p.windows, n), p.token_ids, lm.fingerprint, meta=meta)


# -- the model's own forward over a position-indexed K/V store ----------------
class _Stop(Exception):
    """Ends the early forward inside ``select_layer``'s cache update, once its fresh keys are in hand."""


class _BlendLayer(DynamicLayer):
    """A cache layer holding K/V [1, H, T, D] for every position of the blend.

    ``update`` writes the incoming rows' K/V at positions ``rows`` (None:
    writes nothing; the layer was already recomputed) and returns the whole
    store, so the model's attention sees every position; the mask decides
    which it may attend to. ``tap`` sees the fresh keys first (selection).
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.store_k, self.store_v = keys, values  # typed handles on the same tensors transformers reads
        self.keys, self.values = keys, values
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.rows: torch.Tensor | None = None
        self.tap: Callable[[torch.Tensor], None] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.tap is not None:
            self.tap(key_states)
        if self.rows is not None:
            self.store_k[:, :, self.rows] = key_states.to(self.store_k.dtype)
            self.store_v[:, :, self.rows] = value_states.to(self.store_v.dtype)
        return self.store_k, self.store_v


class _Forward:
    """The model's own forward of chosen rows (positions) over the blend's K/V store."""

    def __init__(self, lm: Any, K: list[torch.Tensor], V: list[torch.Tensor], windows: list[int | None]) -> None:
        self.model = lm.model
        cfg = self.model.config.get_text_config(decoder=True)
        impl = own_attention(lm, cfg)  # its own, even while another thread runs a kvcodec variant of it
        if impl not in ("sdpa", "eager"):
            raise KvcInputError(f"blend needs an attention implementation that takes an explicit mask (sdpa or eager), "
                                f"the model uses {impl!r}")
        self.additive = impl == "eager"
        layers = lm.layout.decoder_layers(self.model)
        if layers is None or len(layers) != len(K):
            raise KvcInputError(f"blend cannot find the {len(K)} decoder layers of {type(self.model).__name__}")
        self.layers = layers
        self.windows = windows
        types = lm.layout.layer_types
        if len(set(windows)) > 1:
            if not isinstance(types, (list, tuple)) or len(types) != len(windows):
                raise KvcInputError("blend: the model mixes attention windows across layers but its config names no "
                                    "layer_types to key the masks by")
            by_type: dict[str, int | None] = {}
            for t, w in zip(types, windows):
                if by_type.setdefault(t, w) != w:
                    raise KvcInputError(f"blend: layers of type {t!r} have different attention windows")
            self.types: dict[str, int | None] | None = by_type
        else:
            self.types = None
        self.dtype = next(self.model.parameters()).dtype
        self.layers_kv = [_BlendLayer(k.to(self.dtype).unsqueeze(0), v.to(self.dtype).unsqueeze(0)) for k, v in zip(K, V)]
        self.cache = DynamicCache()
        self.cache.layers = list(self.layers_kv)
        self.cache.layer_class_to_replicate = None

    def mask(self, rows: torch.Tensor, T: int, visible: dict[int | None, torch.Tensor]) -> Any:
        """The 4D mask [1, 1, rows, T] per attention window: key k is seen by row r iff k <= r, k is within
        the window (r - window < k) and ``visible[window][k]``; keyed by layer type where windows differ."""
        keys = torch.arange(T, device=rows.device)

        def one(w: int | None) -> torch.Tensor:
            m = (keys[None, :] <= rows[:, None]) & visible[w][None, :]
            if w is not None:
                m &= keys[None, :] > rows[:, None] - w
            if self.additive:
                return torch.zeros(m.shape, dtype=self.dtype, device=m.device).masked_fill(
                    ~m, torch.finfo(self.dtype).min)[None, None]
            return m[None, None]

        if self.types is None:
            return one(self.windows[0])
        built = {w: one(w) for w in set(self.windows)}
        return {t: built[w] for t, w in self.types.items()}

    def run(self, ids: torch.Tensor, rows: torch.Tensor, mask: Any, keep: int,
            hidden_at: tuple[int, torch.Tensor] | None = None,
            capture_at: int | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Forward ``ids`` at positions ``rows``; returns (logits of the last ``keep`` rows or None if stopped,
        hidden state entering layer ``capture_at``). ``hidden_at = (layer, h)`` replaces the hidden state
        entering ``layer`` by ``h`` (the earlier layers' outputs are discarded)."""
        got: dict[str, torch.Tensor] = {}

        def swap(_m: Any, args: tuple, kwargs: dict) -> Any:
            assert hidden_at is not None
            if args:
                return (hidden_at[1],) + tuple(args[1:]), kwargs
            return args, dict(kwargs, hidden_states=hidden_at[1])

        def grab(_m: Any, args: tuple, kwargs: dict) -> None:
            got["h"] = args[0] if args else kwargs["hidden_states"]

        handles = []
        if hidden_at is not None:
            handles.append(self.layers[hidden_at[0]].register_forward_pre_hook(swap, with_kwargs=True))
        if capture_at is not None:
            handles.append(self.layers[capture_at].register_forward_pre_hook(grab, with_kwargs=True))
        try:
            out = self.model(input_ids=ids[None], position_ids=rows[None], past_key_values=self.cache,
                             attention_mask=mask, use_cache=True, logits_to_keep=keep)
            logits = out.logits[0].float()
        except _Stop:
            logits = None
        finally:
            for hd in handles:
                hd.remove()
        return logits, got.get("h")


# -- blend ------------------------------------------------------------------
@dataclass
class BlendResult:
    """A blended cache ready for generation.

    ``cache`` holds K/V (the model dtype) for every context and query token
    at positions ``0..T-1`` (sliding-window layers: their last ``window - 1``)
    and their token ids (chunks then query); continue at
    ``cache.next_position``. ``selected`` are the positions whose hidden
    states were recomputed from ``select_layer`` on (sorted; always ends with
    every query position); ``deviation`` is the per-context-token squared key
    deviation at ``select_layer`` (None at ratio 0; 0 where that layer holds
    no cached key: a sliding-window layer's tokens outside the chunk's window).
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
        """A fresh transformers cache of the blended K/V for ``lm`` (sliding-window layer classes included)."""
        return cache_for_model(lm, self.cache)


def _validate_ratio(recompute_ratio: Any) -> float:
    try:
        r = float(recompute_ratio)
    except (TypeError, ValueError):
        raise KvcInputError(f"recompute ratio must be a number in [0, 1], got {recompute_ratio!r}") from None
    if not math.isfinite(r) or r < 0.0 or r > 1.0:
        raise KvcInputError(f"recompute ratio must lie in [0, 1], got {recompute_ratio!r}")
    return r


def _query_tensor(lm: Any, query_ids: Any) -> torch.Tensor:
    q = as_token_ids(query_ids, "query token ids")
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
    device: torch.device | str | None = None,
) -> BlendResult:
    """Blend independently captured chunk caches, in the given order, under ``query_ids``.

    ``chunks`` are full (unpruned) caches of ``lm``, each captured from
    position 0 (any dtype, e.g. decoded from a `.kvc` of any preset);
    ``recompute_ratio`` in [0, 1] is the fraction of context tokens whose
    hidden states are recomputed from ``select_layer`` on (rounded to the
    nearest token count); ``select_layer`` in [1, layers-1] is where tokens
    are selected by key deviation (layer 0's keys depend on the token alone,
    so they cannot show a deviation). Returns a :class:`BlendResult`.

    Everything runs on ``device`` (default: the model's, :func:`kvcodec.integrations.hf.model_device`):
    chunks decoded there stay there, the blended cache is left there, and only per-token results
    (the selected positions, the deviations) are copied to the host.
    """
    t0 = time.perf_counter()
    r = _validate_ratio(recompute_ratio)
    dev = target_device(device, lm)
    q_host = _query_tensor(lm, query_ids)
    q_ids = q_host.to(dev)
    L = lm.fingerprint.num_layers
    if isinstance(select_layer, bool) or not isinstance(select_layer, (int, np.integer)) or not 1 <= select_layer < L:
        raise KvcInputError(f"select_layer must be an integer in [1, {L - 1}], got {select_layer!r}")
    sel = int(select_layer)
    n_q = int(q_ids.numel())
    placed = _place(lm, chunks, n_q, dev)  # fp32, re-rotated, query positions empty
    n_ctx = len(placed.token_ids)
    T = n_ctx + n_q
    fwd = _Forward(lm, placed.keys, placed.values, placed.windows)
    t_rot = time.perf_counter()

    all_ids = torch.cat([torch.as_tensor(placed.token_ids, device=dev), q_ids])
    all_pos = torch.arange(T, device=dev)
    q_pos = torch.arange(n_ctx, T, device=dev)
    stored = {w: s for w, s in zip(placed.windows, placed.stored)}  # one stored set per window (same chunk layout)
    timings: dict[str, float] = {"rerotate_s": t_rot - t0}
    deviation = None
    hidden_at = None

    if r == 0.0:
        # Nothing of the context is recomputed: the query runs over the naive concatenation.
        rows = q_pos
        timings["early_s"] = timings["select_s"] = 0.0
    else:
        # Layers 0..sel-1: every token, fresh K/V for all; stop at sel's cache update with its fresh keys.
        fresh: dict[str, torch.Tensor] = {}

        def tap(k: torch.Tensor) -> None:
            fresh["k"] = k
            raise _Stop

        for li, layer in enumerate(fwd.layers_kv):
            layer.rows = all_pos if li < sel else None
        fwd.layers_kv[sel].tap = tap
        everything = {w: torch.ones(T, dtype=torch.bool, device=dev) for w in stored}
        _, h = fwd.run(all_ids, all_pos, fwd.mask(all_pos, T, everything), 1, capture_at=sel)
        fwd.layers_kv[sel].tap = None
        t_early = time.perf_counter()
        timings["early_s"] = t_early - t_rot
        if h is None or "k" not in fresh or h.dim() != 3 or h.shape[1] != T:  # Gemma 3n: [altup, 1, T, D]
            raise KvcInputError(f"blend could not tap layer {sel} of {type(lm.model).__name__} (its decoder layers "
                                "take no [1, tokens, hidden] hidden_states or use no cache update)")
        # Select at sel: squared deviation of fresh vs cached keys of the context tokens (where cached).
        cached = fwd.layers_kv[sel].store_k[0, :, :n_ctx].float()
        dev_sq = (fresh["k"][0, :, :n_ctx].float() - cached).pow(2).sum(dim=(0, 2))
        dev_sq = torch.where(placed.stored[sel][:n_ctx], dev_sq, torch.zeros_like(dev_sq))
        deviation = dev_sq.cpu().numpy().astype(np.float64)  # one score per context token
        n_sel_ctx = int(round(r * n_ctx))
        if n_sel_ctx >= n_ctx:
            ctx_sel = torch.arange(n_ctx, device=dev)
        elif n_sel_ctx > 0:
            ctx_sel = torch.sort(torch.topk(dev_sq, n_sel_ctx).indices).values
        else:
            ctx_sel = torch.zeros(0, dtype=torch.long, device=dev)
        rows = torch.cat([ctx_sel, q_pos])
        hidden_at = (sel, h[:, rows])
        timings["select_s"] = time.perf_counter() - t_early
    t_sel = time.perf_counter()
    # Layers sel.. (all layers at ratio 0): the selected rows only, over the mixed K/V store.
    for li, layer in enumerate(fwd.layers_kv):
        layer.rows = None if hidden_at is not None and li < sel else rows
    is_row = torch.zeros(T, dtype=torch.bool, device=dev)
    is_row[rows] = True
    visible = {w: s | is_row for w, s in stored.items()}
    logits, _ = fwd.run(all_ids[rows], rows, fwd.mask(rows, T, visible), n_q if return_query_logits else 1,
                        hidden_at=hidden_at)
    assert logits is not None
    t_end = time.perf_counter()
    timings["recompute_s"] = t_end - t_sel  # with the model's head: one forward
    timings["total_s"] = t_end - t0

    K = [layer.store_k[0] for layer in fwd.layers_kv]
    V = [layer.store_v[0] for layer in fwd.layers_kv]
    meta = {"blend": {"chunk_lengths": placed.lengths, "recompute_ratio": r, "select_layer": sel, "query_tokens": n_q}}
    token_ids = np.concatenate([placed.token_ids, q_host.numpy()])  # the ids as given, not read back from the device
    cache = KVCache(_ragged(K, placed.windows, T), _ragged(V, placed.windows, T), token_ids, lm.fingerprint,
                    meta=meta)
    return BlendResult(
        cache=cache,
        logits_last=logits[-1],
        selected=rows.cpu().numpy().astype(np.int64),
        num_context_tokens=n_ctx,
        num_query_tokens=n_q,
        recompute_ratio=r,
        select_layer=sel,
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
    check_answer_length(max_new_tokens, lo=0)
    check_fits(lm, result.next_position + max_new_tokens, "the blended context + answer", ("max_new_tokens",))
    stop = set(int(s) for s in (stop_ids or []))
    out: list[int] = []
    if max_new_tokens == 0:
        return out
    past = result.dynamic_cache(lm)
    pos = result.next_position
    dev = model_device(lm)
    tok = int(result.logits_last.argmax())
    while True:
        out.append(tok)
        if tok in stop or len(out) >= max_new_tokens:
            return out
        logits = lm.model(
            input_ids=torch.tensor([[tok]], device=dev), past_key_values=past, position_ids=torch.tensor([[pos]], device=dev),
            use_cache=True).logits[0, -1]
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
    device: torch.device | str | None = None,
) -> BlendGeneration:
    """Blend ``chunks`` under ``query_ids`` on ``device`` (default: the model's) and greedily generate up to
    ``max_new_tokens`` tokens."""
    check_answer_length(max_new_tokens, lo=0)  # before the blend: a bad answer length never costs its work
    t0 = time.perf_counter()
    if all(isinstance(c, KVCache) for c in chunks):
        n = sum(c.num_tokens for c in chunks) + len(as_token_ids(query_ids, "query token ids")) + max_new_tokens
        check_fits(lm, n, "the blended chunks + query + answer", ("max_new_tokens",))
    res = blend(lm, chunks, query_ids, recompute_ratio=recompute_ratio, select_layer=select_layer, device=device)
    t1 = time.perf_counter()
    toks = continue_from(lm, res, max_new_tokens, _stop_ids(lm) if stop_at_eos else None)
    t2 = time.perf_counter()
    text = lm.tokenizer.decode(toks, skip_special_tokens=True)
    return BlendGeneration(toks, text, res, {"ttft_s": t1 - t0, "decode_s": t2 - t1, "total_s": t2 - t0})


__all__ = [
    "BlendGeneration", "BlendResult", "DEFAULT_RATIO", "DEFAULT_SELECT_LAYER", "blend", "concat_chunks",
    "continue_from", "generate_blended", "layer_inv_freqs", "rerotate_keys", "rotation_tables",
]
