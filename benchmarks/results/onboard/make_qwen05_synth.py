"""A random model shaped like Qwen2.5-0.5B, for the COST of a first ``kvc calibrate`` only (issue 54, item 6).

Usage: ``python make_qwen05_synth.py DEST [TOKENIZER_DIR]``. Qwen2 layout (24 layers, hidden 896, 14 query heads,
2 KV heads, head_dim 64, MLP 4864, q/k/v biases, rope theta 1e6, tied embeddings, vocabulary 151,936), random init
(``torch.manual_seed(0)``), saved in bfloat16 as the real one is, with SmolLM2's tokenizer (49,152 tokens: ids past it
are never fed; the output projection and softmax still cost the full 151,936). Its weights are random: what it
measures is what a 0.5B model's onboarding costs, never its quality.
"""

import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

dest = Path(sys.argv[1])
tok = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/onb/smol-x")
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                  rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, hidden_act="silu",
                  bos_token_id=1, eos_token_id=2, pad_token_id=2, use_sliding_window=False)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
model.save_pretrained(dest)
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    if (tok / f).exists():
        shutil.copy(tok / f, dest / f)
n = sum(p.numel() for p in model.parameters())
print(f"{dest}: {n / 1e6:.0f}M parameters, {model.config.num_hidden_layers} layers, dtype {next(model.parameters()).dtype}")
