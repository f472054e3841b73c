"""Shared fixtures: the embedded model is loaded once per test session.

Model-dependent tests are marked ``@pytest.mark.model``; they run in CI (the
model is small). Select or skip them with ``-m model`` / ``-m 'not model'``.
"""

from __future__ import annotations

import os

# The Triton tests run the kernels under the interpreter, and TRITON_INTERPRET must be set before anything
# imports triton (see test_cuda_rans.py). Collecting other test modules already imports it (kvcodec.runtime.knowledge
# -> transformers -> torch._dynamo -> triton), so it is set here, before any test module is collected.
os.environ.setdefault("TRITON_INTERPRET", "1")
# A decoder backend that applies but fails on a chunk its reference decodes raises in tests (kvcodec/decode/registry.py);
# in production it warns once and the reference's result is used.
os.environ.setdefault("KVCODEC_STRICT_BACKENDS", "1")
# Tests that compare two forward passes bit for bit need MKL to use the same number of threads in both:
# with MKL_DYNAMIC (its default) it may take fewer on a loaded machine, which changes reduction order.
os.environ.setdefault("MKL_DYNAMIC", "FALSE")

import numpy as np  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(scope="session")
def lm():
    from kvcodec.models.load import load_model

    return load_model("smollm2")


@pytest.fixture(scope="session")
def gpl3_ids(lm) -> np.ndarray:
    from kvcodec.models.capture import tokenize
    from kvcodec.texts import load_text

    return tokenize(lm.tokenizer, load_text("gpl3"))


@pytest.fixture(scope="session")
def small_cache(lm, gpl3_ids):
    """A real 64-token KV cache of the GPL-3 text."""
    from kvcodec.models.capture import capture

    return capture(lm, token_ids=gpl3_ids[:64])


@pytest.fixture(scope="session")
def real_cache(lm, gpl3_ids):
    """Factory ``real_cache(n)``: the real KV cache of the first n GPL-3 tokens, captured once per n."""
    from kvcodec.models.capture import capture

    memo: dict = {}

    def get(n: int):
        if n not in memo:
            memo[n] = capture(lm, token_ids=gpl3_ids[:n])
        return memo[n]

    return get


@pytest.fixture(scope="session")
def other_lm(lm):
    """A different LLaMA with the same KV shapes (30 layers, 3 KV heads, head_dim 64, random weights)."""
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvcodec.models.load import LoadedModel

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=lm.model.config.vocab_size, hidden_size=192, intermediate_size=256, num_hidden_layers=30,
        num_attention_heads=3, num_key_value_heads=3, head_dim=64, rope_theta=100000.0,
    )
    return LoadedModel(model=LlamaForCausalLM(cfg).eval(), tokenizer=lm.tokenizer, name="other", path=Path("."))
