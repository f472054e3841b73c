"""An "unseen" copy of a shipped model: its weights with one RMSNorm weight scaled by 1.001, so its fingerprint differs
and nothing shipped (calibration, rate model) applies: what a new model of that size pays on first use (issue 54).

Usage: ``python make_unseen_copy.py MODEL DEST`` (MODEL: ``smollm2`` or ``gemma3-270m``). The copies of the earlier
runs in this folder scaled ``model.layers.{0,1}.*norm.weight``; this scales layer 0's input norm.
"""

import sys
from pathlib import Path

import torch

from kvcodec.models.load import load_model

name, dest = sys.argv[1], Path(sys.argv[2])
lm = load_model(name)
with torch.no_grad():
    lm.model.model.layers[0].input_layernorm.weight.mul_(1.001)
lm.model.save_pretrained(dest)
lm.tokenizer.save_pretrained(dest)
print(f"{dest}: fingerprint {load_model(str(dest)).fingerprint.id} (the shipped one: {lm.fingerprint.id})")
