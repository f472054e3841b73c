"""Check kvcodec's reading of a model's RoPE against the model's own forward before anything is re-positioned.

Why: CacheBlend, redact and the naive concatenation move stored keys to other positions by a rotation built
from the config (:meth:`kvcodec.models.layout.ModelLayout.layer_rope`: rotary channels, theta, scaled
frequencies) in transformers' default pairing (channel ``j`` with ``j + dim/2``). A family that pairs its
channels otherwise (Cohere, Cohere 2 and Helium rotate adjacent pairs ``2j, 2j + 1``) or rotates a share of the
head the config does not say reads as plain RoPE, and every re-positioned key was then silently wrong (layer-0
keys off by 1.5x their size on a tiny Cohere), not refused.

The probe runs the model on single tokens (a batch of one-token sequences) at position 0 and at position
``shift``: a lone token attends only to itself, so with RoPE every layer's hidden state is the same at both
positions and each layer's keys at ``shift`` are its keys at 0 rotated by ``shift``. kvcodec's rotation must
reproduce them, layer by layer, to the float rounding of the model's dtype; the first layer it does not is
refused in one line, once per model (two forwards of a few tokens).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable

import numpy as np

from kvcodec.errors import KvcInputError

_CHECKED: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
#: the probe's tokens: a few ids spread over the vocabulary (any token works: the model's own keys are the reference)
_PROBE_TOKENS = 4
#: how far the probe moves its tokens: far enough that a wrong low frequency (theta, scaling) turns by a visible
#: angle, within every model's window
_SHIFT = 1000


def probe_shift(max_positions: Any) -> int:
    """The probe's shift for a model with ``max_positions`` positions (None or unusable: the default shift)."""
    if isinstance(max_positions, int) and not isinstance(max_positions, bool) and max_positions > 2:
        return min(_SHIFT, max_positions - 1)
    return _SHIFT


def check_rotation(lm: Any, freqs: list[np.ndarray],
                   rotate: Callable[[Any, int, np.ndarray], Any]) -> None:
    """Refuse ``lm`` (a LoadedModel) where rotating its keys by ``rotate(keys, shift, freqs[layer])`` does not give
    the keys its own forward computes at the shifted position (see the module doc). Checked once per model."""
    import torch

    model = lm.model
    try:
        if _CHECKED.get(model):
            return
    except TypeError:  # not weak-referenceable (a stand-in): checked every time
        pass
    tc = model.config.get_text_config(decoder=True)
    vocab = int(getattr(tc, "vocab_size", 0) or 0)
    if vocab < 2:
        return
    shift = probe_shift(getattr(tc, "max_position_embeddings", None))
    param = next(model.parameters())
    ids = (torch.arange(1, _PROBE_TOKENS + 1) * 7919 % vocab).reshape(-1, 1).to(param.device)
    with torch.inference_mode():
        at = [model(input_ids=ids, position_ids=torch.full_like(ids, p), use_cache=True,
                    logits_to_keep=1).past_key_values for p in (0, shift)]
    layers0, layers1 = list(at[0].layers), list(at[1].layers)
    if len(layers0) != len(freqs):
        return  # not the layer-per-layer cache kvcodec reads (refused elsewhere)
    eps = float(torch.finfo(param.dtype).eps) if param.is_floating_point() else 1e-6
    for i, (l0, l1, f) in enumerate(zip(layers0, layers1, freqs)):
        k0, k1 = l0.keys.float(), l1.keys.float()
        if k0.shape != k1.shape or k0.numel() == 0:
            continue
        got = rotate(k0, shift, f)
        scale = float(k1.abs().max())
        err = float((got - k1).abs().max())
        if err > max(1e-3, 16 * eps) * scale + 1e-6:
            raise KvcInputError(
                f"kvcodec cannot re-position this model's keys: its layer {i} rotates them other than the RoPE its "
                f"config reads as ({len(f) * 2} rotary channels in transformers' default pairing; off by "
                f"{err / max(scale, 1e-30):.0%} of their size after {shift} positions), e.g. a family pairing "
                "adjacent channels (Cohere); blend and redact are not supported for it")
    try:
        _CHECKED[model] = True
    except TypeError:
        pass
