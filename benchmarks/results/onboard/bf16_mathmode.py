"""oneDNN's float32 math mode (``torch.backends.mkldnn.matmul.fp32_precision = "bf16"``) for onboarding's scored
continuations (issue 54, item 6): a probe, not a shipped path. Float32 activations, each matmul's inputs rounded to
bfloat16 inside oneDNN. One fit job (gpl3, 1,024 tokens, 256-token continuation), three presets at their table steps:
the decoded continuation's KL in each mode, the CPU-s of each mode's five continuations, and the floor (the exact
cache's continuation in the math mode against float32).

Usage: ``KVCODEC_CACHE=<a cache with MODEL's calibration> python bf16_mathmode.py MODEL [OUT.json]``.
"""

import json
import sys
import time

import numpy as np
import torch

from kvcodec.models.load import load_model
from kvcodec.calibration.store import load_calibration
from kvcodec.onboard import ratefit as rf
from kvcodec.plan.presets import lossy_settings
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.quality import ExactSide, continue_logits
from kvcodec.core.roundtrip import roundtrip
from kvcodec.plan.pipelines import transform_plan
from kvcodec.texts import load_text

torch.set_num_threads(1)
lm = load_model(sys.argv[1])
cal = load_calibration(lm.fingerprint.id)
presets = lossy_settings()
ids = tokenize(lm.tokenizer, load_text("gpl3"))
T = 1024
cont = np.asarray(ids[T:T + 256], np.int64)
out = {}
with torch.inference_mode():
    c32 = capture(lm, token_ids=ids[:T])
    decs = {}
    for preset in ("balanced", "faithful", "near-lossless"):
        settings, step0 = rf._table(presets[preset])
        decs[preset], _ = roundtrip(c32, transform_plan(c32, step0, cal=cal, lm=lm, preset=preset, importance=None, **settings))
    for mode in ("none", "bf16", "none"):
        torch.backends.mkldnn.matmul.fp32_precision = mode
        t = time.process_time()
        ex = continue_logits(lm, c32, cont)
        side = ExactSide(ex, cont)
        for p, d in decs.items():
            out.setdefault(p, {})[mode] = side.compare(continue_logits(lm, d, cont))["kl"]
        out.setdefault("cpu", {})[mode] = round(time.process_time() - t, 1)
        if mode == "bf16":
            ref = ex
        else:
            exact32 = ex
    torch.backends.mkldnn.matmul.fp32_precision = "none"
    out["floor"] = ExactSide(exact32, cont).compare(ref)["kl"]
text = json.dumps(out, indent=1)
print(text)
if len(sys.argv) > 2:
    with open(sys.argv[2], "w") as f:
        f.write(text + "\n")
