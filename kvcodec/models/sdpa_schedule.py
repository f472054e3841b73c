"""SDPA on the CPU, scheduled so that masked-out scores are never computed: the same attention, faster.

transformers hands SDPA one boolean mask whenever attention is not plain
causal from position 0, and the CPU kernel reads that mask for every score
and skips no block. Two shapes of mask are common on kvcodec's paths and are
scheduled here instead; every other call goes to transformers' own SDPA
function unchanged, so this is never a different attention, only a faster
schedule of the same one (outputs agree to float rounding, ~1e-5 of logits).

**New tokens over a stored prefix** (a KV-cache request: ``L`` new tokens,
history + question, over ``P`` stored ones; the mask is ``L x (P + L)``).
1,600 queries over 8,000 keys cost about half what a full 8,000-token causal
prefill costs, where the arithmetic says a third (SmolLM2, one thread). Split
in two, each part takes the kernel's fast path:

* the prefix: every new token sees all ``P`` keys, so no mask; with grouped
  query heads, the ``n_rep`` query heads of one KV head are stacked along the
  sequence axis, so the shared keys are read once and never repeated;
* the new tokens: plain causal attention among themselves (``is_causal``).

The two partial results are merged with their log-sum-exps, which is the
same softmax over all ``P + L`` keys.

**A band** (a sliding-window layer: Gemma 3 keeps a 512-token window in 15 of
its 18 layers). Each query sees only its last ``W`` keys, yet the kernel
computed all of them before masking, so an 8,000-token prefill paid for
8,000 keys per query where the window holds 512 (78 -> 32 CPU-s for Gemma 3 in benchmarks/bench_attention.py,
one thread). Blocks of query rows each run over just the key columns some
row of the block may see, with the mask sliced to match, through
transformers' SDPA function. The keys a block leaves out are exactly those its
mask hides from all its rows.

Not scheduled: padding rows that see nothing, soft-capping, attention sinks,
position biases, paged caches, dropout, a single new token, value heads of
another width, a device other than the CPU, a kernel the torch build lacks.

:func:`fast_sdpa` runs a model's attention through this for a block of code, in the calling thread: the prefills
(:func:`kvcodec.models.capture.prefill`, the importance tap, whose output is
this function's) and every answer over a cache (``greedy_from``), so both
sides of a comparison run on the same engine.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from typing import Any, Iterator

import torch

from kvcodec.models.attention_choice import use_attention

_STATE = threading.local()


def _remembered(ref: Any) -> Any:
    """The mask a check was made for, if it is still alive. Why weak: a 32K-token context's mask is a gigabyte, and
    the forward that made it may have ended in a block (the importance tap's) that never resets this state."""
    return None if ref is None else ref()


def _causal_after_prefix(mask: Any, n_prefix: int, n_new: int) -> bool:
    """True when ``mask`` (boolean or additive, broadcast over heads) lets every new token see the whole prefix
    and the new tokens up to itself, and nothing else. Checked once per mask object (one per forward)."""
    if mask is None:
        return False  # transformers passes a mask whenever there is a prefix; None would mean something else
    if _remembered(getattr(_STATE, "checked", None)) is mask:
        return True
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (n_new, n_prefix + n_new):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    tril = torch.ones(n_new, n_new, dtype=torch.bool, device=mask.device).tril()
    ok = bool(allowed[..., :n_prefix].all()) and bool((allowed[..., n_prefix:] == tril).all())
    if ok:
        _STATE.checked = weakref.ref(mask)
    return ok


BAND_ROWS = 256  # query rows per block of a banded mask: 767 key columns per block for a 512-token window
BAND_MAX_FRACTION = 0.5  # run in blocks only when they compute at most this share of the mask's scores


def _band_blocks(mask: Any, n_q: int, n_k: int) -> list[tuple[int, int, int, int]] | None:
    """``(row0, row1, col0, col1)`` per block of :data:`BAND_ROWS` query rows: the key columns any row of the block may
    see, when a boolean ``mask`` is a band that blocks compute at most :data:`BAND_MAX_FRACTION` of; else None.

    None too when some query sees no key at all (SDPA's answer for such a row
    is transformers' to give). Computed once per mask object (one per forward,
    shared by every sliding-window layer).
    """
    if mask is None or mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[-2:] != (n_q, n_k):
        return None
    got = getattr(_STATE, "band", None)
    if got is not None and _remembered(got[0]) is mask:
        return got[1]
    allowed = mask.any(dim=(0, 1))  # [n_q, n_k]: what any batch row or head may see (a key column kept for one is kept)
    found: list[tuple[int, int, int, int]] = []
    area = 0
    if bool(mask.any(dim=-1).all()):
        for r0 in range(0, n_q, BAND_ROWS):
            r1 = min(n_q, r0 + BAND_ROWS)
            cols = allowed[r0:r1].any(dim=0).nonzero()
            c0, c1 = int(cols[0]), int(cols[-1]) + 1
            found.append((r0, r1, c0, c1))
            area += (r1 - r0) * (c1 - c0)
    blocks = found if found and area <= BAND_MAX_FRACTION * n_q * n_k else None
    _STATE.band = (weakref.ref(mask), blocks)
    return blocks


def banded_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor,
                     blocks: list[tuple[int, int, int, int]], **kwargs: Any) -> torch.Tensor:
    """transformers' SDPA function on each block of query rows over its own key columns; output ``[B, L, Hq, D]``.

    Columns outside a block's range are hidden by the mask from every row of
    the block, so leaving them out changes no softmax (only float rounding).
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    outs = [sdpa_attention_forward(module, query[:, :, r0:r1], key[:, :, c0:c1], value[:, :, c0:c1],
                                   mask[:, :, r0:r1, c0:c1], **kwargs)[0] for r0, r1, c0, c1 in blocks]
    return torch.cat(outs, dim=1)


def split_prefix_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, n_prefix: int,
                           scale: float) -> torch.Tensor:
    """softmax(q k^T * scale) v over [prefix | new] keys, the new part causal; shapes ``[B, H, L, D]``, output
    ``[B, Hq, L, D]``. ``key``/``value`` may have fewer heads than ``query`` (grouped query attention)."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    b, hq, n, d = query.shape
    hkv = key.shape[1]
    rep = hq // hkv
    # prefix: the rep query heads sharing a KV head stacked along the sequence, so that head's keys serve all of them
    qs = query.reshape(b, hkv, rep * n, d)
    o1, l1 = flash(qs, key[:, :, :n_prefix], value[:, :, :n_prefix], 0.0, False, scale=scale)
    o1, l1 = o1.reshape(b, hq, n, -1), l1.reshape(b, hq, n)
    k2, v2 = key[:, :, n_prefix:], value[:, :, n_prefix:]
    if rep > 1:
        k2, v2 = k2.repeat_interleave(rep, dim=1), v2.repeat_interleave(rep, dim=1)
    o2, l2 = flash(query, k2, v2, 0.0, True, scale=scale)
    lse = torch.logaddexp(l1, l2)
    # the log-sum-exps are float32 whatever the inputs: the merge is cast back, or a bf16 layer's o_proj gets float32
    return (o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)).to(query.dtype)


def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:
    """transformers' SDPA attention function (same arguments, same result), with the two schedules of the module.

    The split is tried for a plain causal-after-prefix mask, then the band
    for a boolean mask that hides most scores; anything else, and any kernel
    error of the split, is transformers' own call.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_new, n_keys = query.shape[2], key.shape[2]
    n_prefix = n_keys - n_new
    # what neither schedule models: one query, dropout, another device, soft-caps, sinks, position biases, a paged cache
    schedulable = (n_new > 1 and dropout == 0.0 and query.device.type == "cpu" and not kwargs.get("softcap")
                   and kwargs.get("s_aux") is None and kwargs.get("position_bias") is None
                   and kwargs.get("cache") is None and not kwargs.get("output_attentions"))
    plain = (schedulable and n_prefix > 0 and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
             and kwargs.get("sliding_window") is None
             and getattr(module, "is_causal", True) and query.shape[1] % key.shape[1] == 0
             and query.shape[-1] == key.shape[-1] == value.shape[-1] and value.shape[:3] == key.shape[:3]
             and _causal_after_prefix(attention_mask, n_prefix, n_new))
    if plain:
        s = scaling if scaling is not None else query.shape[-1] ** -0.5
        try:
            out = split_prefix_attention(query, key, value, n_prefix, float(s))
            return out.transpose(1, 2).contiguous(), None
        except (RuntimeError, NotImplementedError):  # a kernel this torch build lacks for these inputs: the one-mask path
            pass
    elif schedulable:
        blocks = _band_blocks(attention_mask, n_new, n_keys)
        if blocks is not None:
            return banded_attention(module, query, key, value, attention_mask, blocks, scaling=scaling,
                                    dropout=dropout, **kwargs), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@contextlib.contextmanager
def fast_sdpa(lm: Any) -> Iterator[None]:
    """Within this block, this thread's SDPA attention of ``lm`` runs through :func:`attention` (see the module).

    A model on another attention implementation (eager, flash) is left as it
    is, and so is one this thread already runs a variant of (a nested block, or
    the importance tap, whose own function calls :func:`attention`). Other
    threads are not affected (:mod:`kvcodec.models.attention_choice`).
    """
    with use_attention(lm, attention, outermost=True) as on:
        try:
            yield
        finally:
            if on:
                _STATE.checked = _STATE.band = None
