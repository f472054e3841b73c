"""redact's re-positioning is exact where it must be, on both shipped models (issue 37's Gemma suspicion).

At layer 0 a token's key depends only on the token and its position, so after a span is removed the
re-rotated layer-0 keys of the tokens after it must equal a re-prefill's to float rounding. At every layer,
re-rotating a whole cache by ``o`` must equal prefilling the same ids at positions ``o..``: RoPE attention
depends on relative positions only, so this checks each layer's own RoPE (Gemma 3: theta 10,000 on its
sliding-window layers, 1,000,000 on its global layers 5, 11, 17). A wrong theta or scaling on any layer fails
one of the two.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.edit.redact import redact_cache
from kvcodec.models.capture import capture, tokenize
from kvcodec.runtime.blend import layer_inv_freqs, rerotate_keys
from kvcodec.texts import load_text

pytestmark = pytest.mark.model


@pytest.fixture(scope="module", params=["smollm2", "gemma3-270m"])
def model(request, lm):
    if request.param == "smollm2":
        return lm
    from kvcodec.models.load import load_model

    return load_model(request.param)


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return float((got.float() - want.float()).abs().max()) <= 1e-5 * float(want.abs().max()) + 1e-5


def test_layer0_keys_after_the_span_match_a_reprefill(model):
    ids = tokenize(model.tokenizer, load_text("gpl3"))[:200]
    a, b = 60, 90
    child, _ = redact_cache(model, capture(model, token_ids=ids), [(a, b)], recompute_ratio=0.0)
    fresh = capture(model, token_ids=np.concatenate([ids[:a], ids[b:]]))
    assert _close(child.keys[0][:, a:], fresh.keys[0][:, a:])
    # and re-positioning is what makes them match: the stale keys, un-rotated, do not
    parent = capture(model, token_ids=ids)
    assert not _close(parent.keys[0][:, b:], fresh.keys[0][:, a:])


@torch.inference_mode()
def test_every_layers_rerotation_equals_a_prefill_at_the_shifted_positions(model):
    ids = torch.as_tensor(tokenize(model.tokenizer, load_text("gpl3"))[:100])[None]
    o = 37
    at0 = model.model(input_ids=ids, position_ids=torch.arange(100)[None], use_cache=True).past_key_values
    ato = model.model(input_ids=ids, position_ids=torch.arange(o, o + 100)[None], use_cache=True).past_key_values
    bad = [li for li, f in enumerate(layer_inv_freqs(model))
           if not _close(rerotate_keys(at0.layers[li].keys[0], o, f), ato.layers[li].keys[0])]
    assert bad == []
