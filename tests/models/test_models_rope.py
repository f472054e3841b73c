"""RoPE parameters read generically (issue 19): flat, nested per layer type (Gemma 3), partial rotary,
scaled variants (no rope stage: that layer's keys are coded post-RoPE, never a crash or a wrong rotation)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.models.fingerprint import canonical_rope
from kvcodec.codecs.rope_tables import layer_rope_config, rope_config_from_fingerprint

GEMMA3 = {
    "model_type": "gemma3_text", "head_dim": 256,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2,
    "rope_parameters": {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
}


def _fp(cfg: dict) -> SimpleNamespace:
    return SimpleNamespace(rope=json.dumps(canonical_rope(cfg), sort_keys=True))


def test_nested_per_layer_type_rope_picks_each_layers_parameters():
    fp = _fp(GEMMA3)
    assert json.loads(fp.rope)["layer_types"] == GEMMA3["layer_types"]
    thetas = [layer_rope_config(fp, l, 256)["theta"] for l in range(8)]
    assert thetas == [1e4] * 5 + [1e6] + [1e4] * 2
    assert all(layer_rope_config(fp, l, 256)["dim"] == 256 for l in range(8))
    with pytest.raises(KvcCodecError, match="needs the layer"):
        rope_config_from_fingerprint(fp.rope, 256)
    with pytest.raises(KvcCodecError, match="layer 8"):
        rope_config_from_fingerprint(fp.rope, 256, 8)


def test_scaled_rope_per_layer_type_falls_back_for_that_layer_only():
    cfg = json.loads(json.dumps(GEMMA3))
    cfg["rope_parameters"]["full_attention"] = {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}
    fp = _fp(cfg)
    assert layer_rope_config(fp, 5, 256) is None  # linear scaling: no rope stage, post-RoPE keys
    assert layer_rope_config(fp, 0, 256) == {"theta": 1e4, "dim": 256}
    with pytest.raises(KvcCodecError, match="'linear'"):
        rope_config_from_fingerprint(fp.rope, 256, 5)


def test_flat_partial_rotary_and_legacy_configs():
    flat = _fp({"rope_theta": 5e5, "partial_rotary_factor": 0.5})
    assert layer_rope_config(flat, 3, 80) == {"theta": 5e5, "dim": 40}
    assert rope_config_from_fingerprint(flat.rope, 80) == {"theta": 5e5, "dim": 40}  # flat: no layer needed
    nested_partial = _fp({**GEMMA3, "rope_parameters": {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}})
    assert layer_rope_config(nested_partial, 5, 256) == {"theta": 1e6, "dim": 64}
    assert layer_rope_config(nested_partial, 0, 256) == {"theta": 1e4, "dim": 256}
    llama3 = _fp({"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert layer_rope_config(llama3, 0, 128) is None
    odd = _fp({"rope_theta": 1e4, "partial_rotary_factor": 0.3})
    assert layer_rope_config(odd, 0, 64) is None  # 19.2 -> 19 channels: not a rotation the stage can express
    with pytest.raises(KvcFormatError):
        rope_config_from_fingerprint("[1, 2]", 64)


def test_nope_layers_have_no_rope_stage_and_no_rerotation():
    """SmolLM3-style no_rope_layers (1 = RoPE, 0 = none) are part of the canonical RoPE; a NoPE layer gets no
    rope stage (its keys are coded as they are) and CacheBlend does not re-rotate it."""
    import numpy as np
    import torch

    from kvcodec.runtime.blend import rerotate_keys
    from kvcodec.core.fingerprint import layer_applies_rope

    rope = canonical_rope({"rope_parameters": {"rope_theta": 2e6, "rope_type": "default"}, "no_rope_layers": [1, 0, 1]})
    assert rope["no_rope_layers"] == [1, 0, 1]
    fp = SimpleNamespace(rope=json.dumps(rope))
    assert [layer_applies_rope(fp.rope, i) for i in range(3)] == [True, False, True]
    assert layer_rope_config(fp, 0, 64) == {"theta": 2e6, "dim": 64}
    assert layer_rope_config(fp, 1, 64) is None
    with pytest.raises(KvcCodecError, match="applies no RoPE"):
        rope_config_from_fingerprint(fp.rope, 64, 1)
    with pytest.raises(KvcCodecError, match="depends on the layer"):
        rope_config_from_fingerprint(fp.rope, 64)
    with pytest.raises(KvcFormatError, match="layer 3"):  # a list that does not name the layer is not guessed
        layer_applies_rope(fp.rope, 3)
    with pytest.raises(KvcFormatError, match="layer 0"):
        layer_applies_rope({"no_rope_layers": ["yes"]}, 0)
    k = torch.randn(2, 5, 64)
    assert torch.equal(rerotate_keys(k, 7, np.zeros(0)), k)
    # models without the field are unchanged (their fingerprints too)
    assert "no_rope_layers" not in canonical_rope({"rope_theta": 1e4})
    assert layer_applies_rope(json.dumps(canonical_rope({"rope_theta": 1e4})), None)
