"""benchmarks/common.py's helpers on a local HF model directory (issue 57: `bench_speed.py --lm PATH` crashed).

A path is no file name: the capture cache used to be named after the model string, so a directory's
slashes made the file's folder missing. Its captures are now keyed by the model's fingerprint."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcodec.models.load import shipped_model_dir

    d = tmp_path_factory.mktemp("tiny") / "nested" / "model"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)).save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(shipped_model_dir("smollm2") / f, d / f)
    return d


def test_get_cache_of_a_model_directory(tiny_dir, tmp_path, monkeypatch):
    import common

    from kvcodec.models.load import load_model

    monkeypatch.setattr(common, "CACHE_DIR", tmp_path / "captures")
    cache = common.get_cache("gpl3", 32, str(tiny_dir))
    assert cache.num_tokens == 32 and cache.num_layers == 2
    fid = load_model(str(tiny_dir)).fingerprint.id
    files = sorted(p.name for p in (tmp_path / "captures").iterdir())
    assert files == [f"speed-{fid}-gpl3-32.h5"]  # keyed by what the model is, inside the cache folder
    again = common.get_cache("gpl3", 32, str(tiny_dir))  # read back, not captured again
    assert all(torch.equal(a, b) for a, b in zip(cache.keys, again.keys))
