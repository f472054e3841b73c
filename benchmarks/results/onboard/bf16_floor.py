"""Where onboarding may compute in bfloat16 (issue 54, item 6): a probe, not a shipped path.

One fit job (gpl3, the first T tokens, a 256-token continuation) and each lossy preset at its table step, the KL of
the decoded cache's continuation against the exact cache's, measured four ways:

* ``A fp32``: float32 prefill, float32 continuations (what the fit measured before);
* ``B bf16``: the bfloat16 twin (:mod:`kvcodec.models.compute`) for everything;
* ``C bf16 cache, fp32 cont``: the twin's prefill, the float32 model's continuations (what onboarding does now);
* ``D bf16, fp32 head``: the twin for everything but its output layer, which computes in float32.

Also the floor: the exact cache's continuation, float32 against each bfloat16 variant.

Usage: ``KVCODEC_CACHE=<a cache with MODEL's calibration> python bf16_floor.py MODEL [T] [OUT.json]``.
"""

import copy
import json
import os
import sys
import time

import numpy as np
import torch

from kvcodec.calibration.store import load_calibration
from kvcodec.core.roundtrip import roundtrip
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.compute import onboard_model
from kvcodec.models.load import load_model
from kvcodec.models.quality import ExactSide, continue_logits
from kvcodec.onboard import ratefit as rf
from kvcodec.plan.pipelines import transform_plan
from kvcodec.plan.presets import lossy_settings
from kvcodec.texts import load_text


class F32Head(torch.nn.Module):
    """The output layer in float32 over a bfloat16 hidden state."""

    def __init__(self, lin):
        super().__init__()
        self.lin = lin

    def forward(self, x):
        return self.lin(x.float())


def main():
    os.environ["KVCODEC_ONBOARD_DTYPE"] = "bfloat16"
    torch.set_num_threads(1)
    lm = load_model(sys.argv[1])
    tw, tw2 = onboard_model(lm), onboard_model(lm)
    tw2.model.lm_head = F32Head(copy.deepcopy(lm.model.get_output_embeddings()))
    cal = load_calibration(lm.fingerprint.id)
    presets = lossy_settings()
    ids = tokenize(lm.tokenizer, load_text("gpl3"))
    T = int(sys.argv[2]) if len(sys.argv) > 2 else 1024
    cont = np.asarray(ids[T:T + 256], np.int64)
    out = {"model": sys.argv[1], "tokens": T, "continuation": len(cont), "kl": {}, "cpu_s": {}}
    with torch.inference_mode():
        c32, c16 = capture(lm, token_ids=ids[:T]), capture(tw, token_ids=ids[:T])
        for tag, cache, model in [("A fp32", c32, lm), ("B bf16", c16, tw), ("C bf16 cache, fp32 cont", c16, lm),
                                  ("D bf16, fp32 head", c16, tw2)]:
            t = time.process_time()
            side = ExactSide(continue_logits(model, cache, cont), cont)
            for preset in ("balanced", "small", "faithful", "near-lossless"):
                settings, step0 = rf._table(presets[preset])
                plan = transform_plan(cache, step0, cal=cal, lm=lm, preset=preset, importance=None, **settings)
                dec, _ = roundtrip(cache, plan)
                out["kl"].setdefault(preset, {})[tag] = side.compare(continue_logits(model, dec, cont))["kl"]
            out["cpu_s"][tag] = round(time.process_time() - t, 1)
        ref = ExactSide(continue_logits(lm, c32, cont), cont)
        out["floor"] = {"fp32 vs bf16": ref.compare(continue_logits(tw, c16, cont))["kl"],
                        "fp32 vs bf16 with fp32 head": ref.compare(continue_logits(tw2, c16, cont))["kl"]}
    text = json.dumps(out, indent=1)
    print(text)
    if len(sys.argv) > 3:
        with open(sys.argv[3], "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
