"""The calibration's attention metric reads each family's own modules (kvcodec.models.layout.FAMILIES).

The key metric weighs each channel pair by the energy of the queries that meet the keys. Where a family keeps its
queries in a fused projection (GPT-NeoX: per head ``[q | k | v]``), behind a per-head norm (Phi's ``q_layernorm``)
or names its output projection otherwise (``dense``, ``out_proj``), reading the wrong slice would weigh the keys by
the keys' (or the values') own energy and still produce a calibration. So the moments the calibration's hook
collects are compared with the queries the model's attention actually receives (the importance tap's post-RoPE
queries: RoPE rotates within channel pairs, so each pair's energy is the same before and after it).
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.model

FAMILIES = {
    # one fused query_key_value, per head [q | k | v]; full rotary so that every pair is rotated whole
    "gpt_neox": dict(model_type="gpt_neox", num_attention_heads=4, rotary_pct=1.0),
    # separate q_proj, a per-head q_layernorm, `dense` output
    "phi": dict(model_type="phi", num_attention_heads=4, partial_rotary_factor=1.0, qk_layernorm=True),
    # learned positions (no RoPE), `out_proj` output
    "opt": dict(model_type="opt", num_attention_heads=4, ffn_dim=256, word_embed_proj_dim=128),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from kvcodec.models.load import load_model
    from tests._support.tiny_models import save_family_model

    root = tmp_path_factory.mktemp("attention-layouts")
    return {name: load_model(str(save_family_model(root / name, kw))) for name, kw in FAMILIES.items()}


class _Queries:
    """The importance tap's collector, keeping each layer's post-RoPE queries [H, T, D]."""

    def __init__(self):
        self.q = {}

    def add(self, layer, query, key, scale):
        self.q[layer] = query[0].double().clone()


def _pair_energy(m):
    """Per row, the energy of each channel pair (i, i + D/2), normalised to sum 1 (the metric is normalised too)."""
    h = m.shape[-1] // 2
    e = m[..., :h] + m[..., h:]
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_query_moments_are_the_attention_queries(family, models):
    from kvcodec.calibration.build import _QueryMoments
    from kvcodec.models.attention_tap import tapped
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    lm = models[family]
    lay = lm.layout
    for i in range(lay.num_layers):
        proj, _, _, _ = lay.query(lm.model, i)
        out = lay.output_projection(lm.model, i)
        assert proj is not None and out is not None, f"layer {i}: the calibration would weigh it evenly"
        assert out.weight.shape[1] == lay.num_heads * lay.head_dim
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:96]
    sink = 4
    with _QueryMoments(lm, sink) as qm:
        capture(lm, token_ids=ids)
    assert qm.even == []
    col = _Queries()
    with tapped(lm, col):
        capture(lm, token_ids=ids)
    assert sorted(col.q) == list(range(lay.num_layers))
    for i in range(lay.num_layers):
        want = (col.q[i][:, sink:] ** 2).mean(1).numpy()  # [H, D], one KV head per query head here
        np.testing.assert_allclose(_pair_energy(qm.moments[i]), _pair_energy(want), rtol=1e-6, atol=1e-9)


def test_a_model_without_readable_attention_is_weighed_evenly(models, monkeypatch):
    """Where the layout finds no query or output projection, the metric is the identity for those layers and the
    calibration says which (``even_weights``), never a refusal."""
    from kvcodec.calibration.build import _QueryMoments, attention_metrics
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.layout import LEADING
    from kvcodec.texts import load_text

    lm = models["phi"]
    lay = lm.layout
    class Blind(type(lay)):
        def query(self, model, layer):
            return (None, None, None, LEADING) if layer == 1 else super().query(model, layer)

        def output_projection(self, model, layer):
            return None if layer == 0 else super().output_projection(model, layer)

    blind = Blind(**{f: getattr(lay, f) for f in lay.__dataclass_fields__})
    monkeypatch.setattr(lm, "layout", blind)
    ids = tokenize(lm.tokenizer, load_text("c-stdio"))[:64]
    with _QueryMoments(lm, 4) as qm:
        capture(lm, token_ids=ids)
    assert qm.even == [1] and np.all(qm.moments[1] == 1.0) and not np.all(qm.moments[0] == 1.0)
    even_v: list[int] = []
    m = attention_metrics(lm, qm.moments, even=even_v)
    assert even_v == [0]
    D = lay.head_dim
    np.testing.assert_allclose(m[0, 1, 0], np.eye(D) * (1 + 0.01))  # identity, normalised to trace D, + reg
    assert not np.allclose(m[1, 1, 0], np.eye(D) * (1 + 0.01))
