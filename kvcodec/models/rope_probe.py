"""Check kvcodec's reading of a model's RoPE against the model's own forward before anything is re-positioned.

Why: CacheBlend, redact and the naive concatenation move stored keys to other positions by a rotation built
from the config (:meth:`kvcodec.models.layout.ModelLayout.layer_rope`: rotary channels, theta, scaled
frequencies). Configs do not say how a family pairs the channels it rotates: transformers' default pairs
channel ``j`` with ``j + dim/2``, while Cohere, Cohere 2, Helium, GLM and Llama 4 rotate adjacent pairs
``2j, 2j + 1`` (same frequencies). Read as the default, every re-positioned key of those families was silently
wrong (layer-0 keys off by about 1.5x their size on a tiny Cohere).

The probe runs the model on single tokens (a batch of one-token sequences) at position 0 and at position
``shift``: a lone token attends only to itself, so with RoPE every layer's hidden state is the same at both
positions and each layer's keys at ``shift`` are its keys at 0 rotated by ``shift``. Each layer is tried in the
default pairing, then in adjacent pairs (its frequencies marked :class:`AdjacentPairs`, which
:func:`kvcodec.runtime.blend.rerotate_keys` rotates that way), then as a layer without RoPE (Cohere 2's global
layers apply none, which its config does not say); one must reproduce the model's keys to the float rounding of
its dtype, or the layer is refused in one line. Once per model: two forwards of a few tokens.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from kvcodec.errors import KvcInputError

#: per model and layer: "adjacent" (adjacent pairs), "none" (no RoPE) or "" (as read), checked once
_CHECKED: "weakref.WeakKeyDictionary[Any, tuple[str, ...]]" = weakref.WeakKeyDictionary()
#: the probe's tokens: a few ids spread over the vocabulary (any token works: the model's own keys are the reference)
_PROBE_TOKENS = 4
#: how far the probe moves its tokens: far enough that a wrong low frequency (theta, scaling) turns by a visible
#: angle, within every model's window
_SHIFT = 1000


class AdjacentPairs(np.ndarray):
    """A layer's float64 inverse frequencies, for a layer that rotates channels ``2j`` and ``2j + 1`` by frequency
    ``j`` (where transformers' default rotates ``j`` and ``j + dim/2``)."""


def to_half_pairs(k: Any, dim: int) -> Any:
    """``k`` [..., D] with its first ``dim`` channels gathered from adjacent pairs into the default pairing
    (``2j`` -> ``j``, ``2j + 1`` -> ``j + dim/2``); a rotation there is the adjacent rotation here."""
    import torch

    idx = torch.cat([torch.arange(0, dim, 2), torch.arange(1, dim, 2), torch.arange(dim, k.shape[-1])]).to(k.device)
    return k[..., idx]


def from_half_pairs(k: Any, dim: int) -> Any:
    """The inverse of :func:`to_half_pairs`."""
    import torch

    h = dim // 2
    idx = torch.stack([torch.arange(h), torch.arange(h, dim)], dim=-1).reshape(-1)
    return k[..., torch.cat([idx, torch.arange(dim, k.shape[-1])]).to(k.device)]


def probe_shift(max_positions: Any) -> int:
    """The probe's shift for a model with ``max_positions`` positions (None or unusable: the default shift)."""
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and max_positions > 2:
        return min(_SHIFT, max_positions - 1)
    return _SHIFT


def _adjacent(f: np.ndarray) -> np.ndarray:
    return np.asarray(f, np.float64).view(AdjacentPairs)


def check_rotation(lm: Any, freqs: list[np.ndarray],
                   rotate: Callable[[Any, int, np.ndarray], Any]) -> list[np.ndarray]:
    """``freqs`` (per layer), each marked :class:`AdjacentPairs` where ``lm``'s layer rotates adjacent pairs and empty
    where it rotates nothing; raises
    KvcInputError where ``rotate(keys, shift, f)`` reproduces the model's own keys in neither pairing (module doc)."""
    import torch

    model = lm.model
    try:
        known = _CHECKED.get(model)
    except TypeError:  # not weak-referenceable (a stand-in): checked every time
        known = None
    if known is not None and len(known) == len(freqs):
        return [_adjacent(f) if a == "adjacent" else np.zeros(0, np.float64) if a == "none" else f
                for f, a in zip(freqs, known)]
    tc = model.config.get_text_config(decoder=True)
    vocab = int(getattr(tc, "vocab_size", 0) or 0)
    if vocab < 2:
        return freqs
    shift = probe_shift(getattr(tc, "max_position_embeddings", None))
    param = next(model.parameters())
    ids = (torch.arange(1, _PROBE_TOKENS + 1) * 7919 % vocab).reshape(-1, 1).to(param.device)
    with torch.inference_mode():
        at = [model(input_ids=ids, position_ids=torch.full_like(ids, p), use_cache=True,
                    logits_to_keep=1).past_key_values for p in (0, shift)]
    layers0, layers1 = list(at[0].layers), list(at[1].layers)
    if len(layers0) != len(freqs):
        return freqs  # not the layer-per-layer cache kvcodec reads (refused elsewhere)
    eps = float(torch.finfo(param.dtype).eps) if param.is_floating_point() else 1e-6
    out: list[np.ndarray] = []
    for i, (l0, l1, f) in enumerate(zip(layers0, layers1, freqs)):
        k0, k1 = l0.keys.float(), l1.keys.float()
        if k0.shape != k1.shape or k0.numel() == 0:
            out.append(f)
            continue
        scale = float(k1.abs().max())
        tol = max(1e-3, 16 * eps) * scale + 1e-6
        errs = []
        for g in (f, _adjacent(f), np.zeros(0, np.float64)) if len(f) else (f,):
            errs.append(float((rotate(k0, shift, g) - k1).abs().max()))
            if errs[-1] <= tol:
                out.append(g)
                break
        else:
            raise KvcInputError(
                f"kvcodec cannot re-position this model's keys: its layer {i} rotates them other than the RoPE its "
                f"config reads as ({len(f) * 2} rotary channels, paired j with j + {len(f)} or adjacent; off by "
                f"{min(errs) / max(scale, 1e-30):.0%} of their size after {shift} positions); blend and redact are not "
                "supported for it")
    try:
        _CHECKED[model] = tuple("adjacent" if isinstance(f, AdjacentPairs) else "none" if len(f) == 0 else ""
                                for f in out)
    except TypeError:
        pass
    return out
