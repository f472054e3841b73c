"""`benchmarks/bench_speed.py --lm PATH` on a local HF model directory works (issue 57: it crashed, twice).

The script runs in a subprocess, as a user runs it (tests import nothing from benchmarks/), on a tiny model directory
this machine has never seen: first a path's slashes made the capture's file name a missing folder (captures are now
keyed by the model's fingerprint), then the lossy presets crashed on the model's missing calibration (get_plan only
loads one; the script now builds it on first use, as `kvc encode` does).

The model is a 2-layer LLaMA over a byte-level tokenizer (256 tokens) with a 384-token window, so its calibration
(three texts cut to the 256-token floor, 24 Fisher samples over the vocabulary) stays at a few seconds: SmolLM2's
49,152-token vocabulary made the same build twice as long. The call takes about 10 s on the loaded 2-core box,
most of it the subprocess importing torch and transformers and that build.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("tiny") / "nested" / "model"
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(d)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=384)).save_pretrained(d)
    return d


def test_bench_speed_codes_a_model_directory_it_has_never_calibrated(tiny_dir, tmp_path):
    home, captures = tmp_path / "kvcodec", tmp_path / "captures"
    env = dict(os.environ, KVCODEC_CACHE=str(home), KVC_BENCH_CACHE=str(captures), OMP_NUM_THREADS="1",
               NUMBA_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "benchmarks/bench_speed.py", "--lm", str(tiny_dir), "--tokens", "64",
                        "--presets", "lossless,balanced", "--repeat", "1", "--json"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout[r.stdout.index("{\n"):])
    assert res["lm"] == str(tiny_dir) and res["tokens"] == 64
    # balanced really coded lossy, with the calibration: fewer bits than lossless on the same fp16 cache
    assert 0 < res["presets"]["balanced"]["bits_per_element"] < res["presets"]["lossless"]["bits_per_element"]
    (fid,) = [p.name for p in (home / "calibration").iterdir() if len(p.name) == 32]  # built once, saved, by fingerprint
    assert "calibrat" in r.stderr  # and the build was announced, not silent
    assert sorted(p.name for p in captures.iterdir()) == [f"speed-{fid}-gpl3-64.h5"]  # captures keyed by the model
