"""Families whose attention the tap cannot observe get their token importance from their eager attention weights.

Falcon, Bloom, GPT-J, CodeGen and GPT-Neo run their own attention code (not transformers' attention functions), and
MPT's forward fails on a function it did not name: the tap sees none of them (``tap_sees``), so a capture that
observes importance must read the weights the model's eager attention returns. Tiny random models: the checks are
structural (every window query's weights are a distribution over the keys it sees, the K/V are a plain prefill's),
and tests/plan/test_importance.py checks the scores against the tap's on a model both can read.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.model

BLIND = {
    "falcon": dict(model_type="falcon", num_attention_heads=4, new_decoder_architecture=False, multi_query=True),
    "bloom": dict(model_type="bloom", n_head=4),
    "gptj": dict(model_type="gptj", n_head=4, rotary_dim=16),
    "gpt_neo": dict(model_type="gpt_neo", num_heads=4, attention_types=[[["global", "local"], 1]], window_size=48,
                    num_layers=2),
    "mpt": dict(model_type="mpt", num_attention_heads=4),
}


@pytest.mark.parametrize("family", list(BLIND))
def test_importance_of_a_family_the_tap_cannot_observe(family, tmp_path):
    from kvcodec.models.attention_tap import eager_attention_sums, tap_sees
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text
    from tests._support.tiny_models import save_family_model

    lm = load_model(str(save_family_model(tmp_path / family, BLIND[family])))
    assert not tap_sees(lm)
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:100]
    plain = capture(lm, token_ids=ids)
    scored = capture(lm, token_ids=ids, score_window=32)
    assert all(torch.equal(a, b) for a, b in zip(plain.keys + plain.values, scored.keys + scored.values))
    L, H = lm.fingerprint.num_layers, lm.layout.num_heads
    assert scored.attention.window == 32 and scored.attention.scores.shape == (L, 100)
    sums = eager_attention_sums(lm, torch.as_tensor(np.asarray(ids, np.int64))[None], 32, 100, squared=False)
    np.testing.assert_allclose(sums.sum(-1).numpy(), np.full((L, H), 32.0), rtol=1e-6)  # 32 rows, each summing to 1
    assert (sums[:, :, :68] > 0).any()  # keys before the window are scored too
