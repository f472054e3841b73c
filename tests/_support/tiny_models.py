"""Tiny random models saved as local HF directories, cheap enough to calibrate from scratch in a test (issue 59).

Why not the model-family models of tests/models/test_model_families.py: those use the embedded model's
49,152-token vocabulary, and a calibration's Fisher passes and a rate model's fit are dominated by the
vocabulary (every continuation token's softmax, noise and backward pass through the output projection):
about a minute per model on a 2-core box. Here the tokenizer is a 512-token byte-level BPE trained on one
corpus text, so a calibration takes seconds and a rate-model fit a few more. Random weights say nothing
about quality; they do exercise every first-use path (capture, Fisher passes, PCA, fit, encode, decode).

The layouts are the shipped families': a dense LLaMA-like model (SmolLM2's) and one with sliding-window and
global layers (Gemma 3's). The window (``max_position_embeddings``) is short on purpose: the calibration
and the fit read at most the window, so a short one keeps them cheap.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

# ChatML, as SmolLM2's template writes it: kvc ask renders its prompt through the model's own template
CHAT_TEMPLATE = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
                 "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
WINDOW = 512
FAMILIES: dict[str, dict[str, Any]] = {
    # SmolLM2's layout: LLaMA, GQA, every layer global
    "dense": dict(model_type="llama", num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    # Gemma 3's layout: sliding-window and global layers, one KV head, per-head q/k norms
    "sliding": dict(model_type="gemma3_text", num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                    sliding_window=48, layer_types=["sliding_attention", "full_attention"]),
    # GPT-2's layout: decoder layers outside .model.layers, learned positions (calibrated with even weights)
    "gpt2": dict(model_type="gpt2", n_head=4),
}
#: the model-family tests' size (tests/models/test_model_families.py, tests/calibration/test_attention_layouts.py):
#: the embedded model's tokenizer and vocabulary, two layers
FAMILY_SIZE: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=49152,
                                   max_position_embeddings=1024)


@functools.cache
def tiny_tokenizer() -> Any:
    """A 512-token byte-level BPE (trained on gpl3, deterministic) with ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from kvcodec.texts import load_text

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([load_text("gpl3")], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(dest: Path, family: str, window: int = WINDOW, seed: int = 0) -> Path:
    """Save a random 2-layer model of ``family`` (:data:`FAMILIES`) with :func:`tiny_tokenizer` at ``dest``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = tiny_tokenizer()
    kw = dict(FAMILIES[family])
    size: dict[str, Any] = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    if family == "gpt2":
        size.update(n_embd=64, n_layer=2, n_positions=window)
    else:
        size.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, max_position_embeddings=window,
                    pad_token_id=None)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **size, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    dest = Path(dest)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    return dest


def save_family_model(dest: Path, config: dict[str, Any], bfloat16: bool = False) -> Path:
    """Save a random :data:`FAMILY_SIZE` model of ``config`` (its ``model_type`` and the family's own settings), seeded
    0, with the embedded model's tokenizer, at ``dest``."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvcodec.models.load import shipped_model_dir

    kw = dict(config)
    cfg = AutoConfig.for_model(kw.pop("model_type"), **FAMILY_SIZE, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    if bfloat16:
        model = model.to(torch.bfloat16)
    dest = Path(dest)
    model.save_pretrained(dest)
    tok = shipped_model_dir("smollm2")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok / f, dest / f)
    return dest
