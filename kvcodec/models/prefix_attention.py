"""Attention for new tokens over a stored prefix: the prefix part unmasked, the new part causal, merged exactly.

Why: a KV-cache request prefills ``L`` new tokens (history + question) over
``P`` stored ones. transformers hands SDPA one boolean mask of ``L x (P + L)``
for that, and the CPU kernel then reads the mask for every score and skips
no block, so 1,600 queries over 8,000 keys cost about half what a full
8,000-token causal prefill (``is_causal``: masked blocks skipped) costs,
where the arithmetic says a third (SmolLM2, one thread). Split in two, each
part takes the kernel's fast path:

* the prefix: every new token sees all ``P`` keys, so no mask; with grouped
  query heads, the ``n_rep`` query heads of one KV head are stacked along the
  sequence axis, so the shared keys are read once and never repeated;
* the new tokens: plain causal attention among themselves (``is_causal``).

The two partial results are merged with their log-sum-exps, which is the
same softmax over all ``P + L`` keys (exact up to float rounding: the
outputs agree with the one-mask path to ~1e-6).

Anything else -- a sliding-window layer (its mask hides part of the prefix),
padding, soft-capping, attention sinks, dropout, one new token, value heads
of another width, a device other than the CPU, a kernel the torch build
lacks -- goes to transformers' own SDPA function unchanged, so this is never
a different attention, only a faster schedule of the same one.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import torch

from kvcodec.models.hfimport import register_sdpa_variant

ATTN_NAME = "kvc_prefix_sdpa"
_STATE = threading.local()


def _causal_after_prefix(mask: Any, n_prefix: int, n_new: int) -> bool:
    """True when ``mask`` (boolean or additive, broadcast over heads) lets every new token see the whole prefix
    and the new tokens up to itself, and nothing else. Checked once per mask object (one per forward)."""
    if mask is None:
        return False  # transformers passes a mask whenever there is a prefix; None would mean something else
    if getattr(_STATE, "checked", None) is mask:
        return True
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[-2:] != (n_new, n_prefix + n_new):
        return False
    allowed = mask if mask.dtype == torch.bool else mask == 0
    tril = torch.ones(n_new, n_new, dtype=torch.bool, device=mask.device).tril()
    ok = bool(allowed[..., :n_prefix].all()) and bool((allowed[..., n_prefix:] == tril).all())
    if ok:
        _STATE.checked = mask
    return ok


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
    return o1 * torch.exp(l1 - lse).unsqueeze(-1) + o2 * torch.exp(l2 - lse).unsqueeze(-1)


def _attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
               scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    n_new, n_keys = query.shape[2], key.shape[2]
    n_prefix = n_keys - n_new
    plain = (n_new > 1 and n_prefix > 0 and dropout == 0.0 and query.device.type == "cpu"
             and query.dtype in (torch.float32, torch.bfloat16, torch.float16)
             and not kwargs.get("softcap") and kwargs.get("s_aux") is None and kwargs.get("sliding_window") is None
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
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


@contextlib.contextmanager
def prefix_attention(lm: Any) -> Iterator[None]:
    """Within this block, ``lm``'s SDPA attention runs new tokens over a prefix split in two (see the module).

    A model on another attention implementation (eager, flash) is left as it
    is, and so is one already switched (a nested or concurrent block): the
    outermost block restores ``sdpa``, after which an inner one runs on
    transformers' path, which is the same attention.
    """
    cfg = lm.model.config
    old = cfg._attn_implementation
    if old != "sdpa":
        yield
        return
    register_sdpa_variant(ATTN_NAME, _attention)
    cfg._attn_implementation = ATTN_NAME
    try:
        yield
    finally:
        cfg._attn_implementation = old
        _STATE.checked = None
