"""The model layout read from a config dict alone (kvcodec/models/layout.py): config names per family, GQA,
RoPE per layer, and the fingerprint bytes that depend on this reading (pinned: every fingerprint id, calibration
and store key depends on them). The layout of loaded tiny models is checked in test_model_families.py."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from kvcodec.codecs.rope_tables import layer_rope_config
from kvcodec.core.fingerprint import layer_applies_rope
from kvcodec.errors import KvcFormatError, KvcModelNotFoundError
from kvcodec.models import fingerprint as F
from kvcodec.models.layout import ABSENT, NOPE, PLAIN, ModelLayout, canonical_rope

GEMMA3_ROPE = {"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
               "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}
CONFIGS = {
    "gpt_bigcode": {"model_type": "gpt_bigcode", "n_layer": 2, "n_head": 4, "n_embd": 128, "multi_query": True},
    "falcon-new": {"model_type": "falcon", "num_hidden_layers": 2, "num_attention_heads": 8, "num_kv_heads": 2,
                   "hidden_size": 256, "new_decoder_architecture": True, "multi_query": True},
    "falcon-rw": {"model_type": "RefinedWeb", "n_layer": 2, "n_head": 8, "n_head_kv": 1, "hidden_size": 256},
    "chatglm": {"model_type": "chatglm", "num_layers": 2, "num_attention_heads": 8, "multi_query_group_num": 2,
                "hidden_size": 256},
    "t5ish": {"model_type": "x", "num_layers": 3, "num_heads": 4, "d_model": 64},
    "legacy": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 0,
               "hidden_size": 64, "rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}},
    "vlm": {"model_type": "llava", "text_config": {"model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
            "hidden_size": 64, "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
    "gemma3": {"model_type": "gemma3_text", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
               "head_dim": 256, "hidden_size": 64, "layer_types": ["sliding_attention", "full_attention"],
               "rope_parameters": GEMMA3_ROPE},
    "nope": {"model_type": "smollm3", "num_hidden_layers": 3, "num_attention_heads": 4, "hidden_size": 64,
             "no_rope_layers": [1, 0, 1], "rope_parameters": {"rope_theta": 2e6, "rope_type": "default"}},
}
# fingerprint ids of CONFIGS (tokenizer "0"*64, weights "1"*64), computed before the layout existed: its reading of a
# config must never change one
PINNED_IDS = {
    "gpt_bigcode": "e0fd912afca7a3451283bf80be422370", "falcon-new": "94c8ac77c82fc0c45351d816b1687247",
    "falcon-rw": "17cbf139c861339686ae74a58a3277cc", "chatglm": "711aa887f333622d501cde62255e098c",
    "t5ish": "1c21381df8e9ec4c61a1743e989876d3", "legacy": "3103e44232b0da9680355c220430a837",
    "vlm": "fb0fad8630e46ccd07fdc1726d90f42f", "gemma3": "843f68366b4e90f64255b47b7c0001c1",
    "nope": "25385f48d2315eaacc89a6a399afdd72",
}
# (layers, heads, kv heads, head_dim) as the layout reads each config's names
HEADS = {
    "gpt_bigcode": (2, 4, 1, 32),  # multi_query: one KV head
    "falcon-new": (2, 8, 2, 32),  # the new decoder architecture's num_kv_heads, not multi_query
    "falcon-rw": (2, 8, 1, 32), "chatglm": (2, 8, 2, 32), "t5ish": (3, 4, 4, 16),
    "legacy": (2, 4, 4, 16),  # num_key_value_heads 0: as many as the query heads
    "vlm": (2, 4, 4, 16), "gemma3": (2, 4, 1, 256), "nope": (3, 4, 4, 16),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fingerprint_bytes_of_the_layout_reading_are_pinned(name):
    cfg = CONFIGS[name]
    fp = F._make(cfg, "0" * 64, "1" * 64, "float32")
    assert fp.id == PINNED_IDS[name]
    lay = ModelLayout.from_config(cfg)
    assert (lay.num_layers, lay.num_heads, lay.num_kv_heads, lay.head_dim) == HEADS[name]
    assert (fp.num_layers, fp.num_kv_heads, fp.head_dims, fp.rope) == \
        (lay.num_layers, lay.num_kv_heads, (lay.head_dim,) * lay.num_layers, lay.rope)
    assert lay.group * lay.num_kv_heads == lay.num_heads


def test_family_config_names_apply_to_that_family_only():
    """MPT says n_layers / n_heads (its FAMILIES entry); the same names under another model_type are not guessed
    (DBRX, say, keeps its KV-head count elsewhere, so reading n_heads as MHA would be wrong)."""
    mpt = {"model_type": "mpt", "n_layers": 2, "n_heads": 4, "d_model": 128}
    lay = ModelLayout.from_config(mpt)
    assert (lay.family, lay.num_layers, lay.num_heads, lay.num_kv_heads, lay.head_dim) == ("mpt", 2, 4, 4, 32)
    with pytest.raises(KvcModelNotFoundError, match="lacks a usable head layout"):
        ModelLayout.from_config({**mpt, "model_type": "dbrx"})
    with pytest.raises(KvcModelNotFoundError, match="invalid head layout"):
        ModelLayout.from_config({**mpt, "n_heads": 0, "head_dim": 8})


ROPES = {
    "flat": {"rope_theta": 5e5},
    "flat-partial": {"rope_theta": 5e5, "partial_rotary_factor": 0.5},
    "odd-partial": {"rope_theta": 1e4, "partial_rotary_factor": 0.3},
    "llama3": {"rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
    "none": {},
    "gemma3": {"layer_types": ["sliding_attention"] * 2 + ["full_attention"], "rope_parameters": GEMMA3_ROPE},
    "gemma3-scaled-global": {"layer_types": ["sliding_attention"] * 2 + ["full_attention"], "rope_parameters": {
        **GEMMA3_ROPE, "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0}}},
    "nested-partial": {"layer_types": ["sliding_attention"] * 2 + ["full_attention"], "rope_parameters": {
        "full_attention": {"rope_theta": 1e6, "rope_type": "default", "partial_rotary_factor": 0.25},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}},
    "nope": {"rope_parameters": {"rope_theta": 2e6, "rope_type": "default"}, "no_rope_layers": [1, 0, 1]},
}


@pytest.mark.parametrize("name", list(ROPES))
def test_layer_rope_reads_the_canonical_rope_as_the_codec_does(name):
    """The layout's RoPE per layer (what CacheBlend re-rotates with) and the codec's rope stage config (what the
    stage un-rotates with) are two readers of the fingerprint's RoPE JSON: they must agree on every layer."""
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "num_attention_heads": 2, "head_dim": 64, **ROPES[name]}
    lay = ModelLayout.from_config(cfg)
    fp = SimpleNamespace(rope=json.dumps(canonical_rope(cfg), sort_keys=True))
    assert lay.rope == json.dumps(canonical_rope(cfg), sort_keys=True, default=str)
    for i in range(3):
        r, stage = lay.layer_rope(i), layer_rope_config(fp, i, 64)
        assert (r.kind == NOPE) == (not layer_applies_rope(fp.rope, i))
        if r.kind == PLAIN:
            assert stage == {"theta": r.theta, "dim": r.dim}
        else:
            assert stage is None and r.kind in (NOPE, ABSENT)  # a config dict alone knows no scaled frequencies


def test_layer_rope_refuses_what_the_codec_refuses():
    lay = ModelLayout.from_config({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 64,
                                   "no_rope_layers": [1]})
    assert lay.layer_rope(0).kind == ABSENT  # rotates (flag 1), but the config names no theta
    with pytest.raises(KvcFormatError, match="layer 1"):  # a list that does not name the layer is not guessed
        lay.layer_rope(1)
