"""kvcodec.plan.presets: one preset table, one override validator for the CLI, the library and the vLLM config."""

from __future__ import annotations

import json

import pytest

from kvcodec.errors import KvcInputError
from kvcodec.plan.presets import PRESETS, available_presets, check_overrides, get_plan, parse_config, preset_info


@pytest.mark.parametrize("preset, over", [
    ("lossless", {"level": 22}),        # zstd's stage refuses > 19: the CLI used to accept it
    ("balanced", {"deadzone": 0.7}),    # QuantizeStage refuses >= 0.5: the CLI used to accept it
    ("balanced", {"step0": 0}),
    ("balanced", {"step0": float("nan")}),
    ("balanced", {"sink": -1}),
    ("balanced", {"basis": "dct"}),
    ("balanced", {"tokenscale": {"nope": 1}}),
    ("raw", {"level": 3}),              # raw has no zstd
    ("balanced", {"level": 3}),
    ("lossless", {"step0": 0.3}),
])
def test_library_and_cli_refuse_the_same_overrides(preset, over, small_cache):
    with pytest.raises(KvcInputError):
        check_overrides(preset, over)
    with pytest.raises(KvcInputError):
        parse_config({"preset": preset, **over}, "--config")
    with pytest.raises(KvcInputError):
        get_plan(preset, small_cache, **over)


def test_negative_zstd_level_is_accepted_everywhere(small_cache):
    """zstd's fast levels (< 0) are valid for the stage, so the CLI accepts them too (it used to refuse them)."""
    assert parse_config({"preset": "zstd", "level": -5}) == ("zstd", {"level": -5})
    plan = get_plan("zstd", small_cache, level=-5)
    assert plan.pipelines.to_json()[-1]["config"] == {"level": -5}


def test_every_stage_limit_the_validator_accepts_builds(small_cache):
    """The validator's bounds are the stages' own: the edge values it accepts build real pipelines."""
    for preset, over in [("lossless", {"level": 19}), ("lossless", {"level": -7}),
                         ("balanced", {"deadzone": 0.49, "basis": "hadamard", "step0": 0.5, "sink": 0, "tokenscale": None})]:
        plan = get_plan(preset, small_cache, **check_overrides(preset, over))
        p = plan.pipelines if not callable(plan.pipelines) or hasattr(plan.pipelines, "stages") else plan.pipelines(0, "k")
        assert p.to_json()


def test_cli_config_uses_the_plans_validator(tmp_path):
    from kvcodec.cli.codec_cmd import parse_codec_config

    with pytest.raises(KvcInputError, match="level"):
        parse_codec_config(json.dumps({"preset": "lossless", "level": 22}))
    assert parse_codec_config(json.dumps({"preset": "zstd", "level": -3})) == ("zstd", {"level": -3})
    f = tmp_path / "c.json"
    f.write_text(json.dumps({"preset": "balanced", "deadzone": 0.25}))
    assert parse_codec_config(str(f)) == ("balanced", {"deadzone": 0.25})


def test_vllm_config_uses_the_one_preset_table():
    from kvcodec.integrations.vllm.config import ConnectorConfig

    with pytest.raises(KvcInputError, match="unknown preset"):
        ConnectorConfig.from_extra({"store_url": "/tmp/x", "preset": "turbo"})
    assert ConnectorConfig.from_extra({"store_url": "/tmp/x", "preset": "balanced"}).preset == "balanced"


def test_the_table_declares_which_presets_use_the_model():
    assert available_presets() == list(PRESETS)
    assert {n for n, p in PRESETS.items() if p.uses_model} == {"near-lossless", "faithful", "balanced", "small"}
    assert not preset_info("lossless").uses_model
    with pytest.raises(KvcInputError, match="unknown preset"):
        preset_info("turbo")


def test_baselines_come_from_the_same_get_plan(small_cache):
    plan = get_plan("baseline:int8", small_cache)
    assert plan.preset == "baseline:int8" and plan.chunk_tokens == small_cache.num_tokens
    with pytest.raises(KvcInputError):
        get_plan("baseline:kivi3", small_cache)
