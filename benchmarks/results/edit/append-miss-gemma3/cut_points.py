# ruff: noqa  (a one-off probe kept as it ran; see README.md)
"""apache2 on Gemma: plain balanced encodes (rate control, no check) of the first n tokens, n = 896..1408 step 64,
each scored on its next 256 tokens: does the miss follow the text stretch after 1,152?"""
import json, sys
import numpy as np, torch
torch.set_num_threads(1)
from kvcodec.api import encode
from kvcodec.format import KvcReader
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.texts import load_text
lm = load_model("gemma3-270m"); lm.warm_up()
ids = tokenize(lm.tokenizer, load_text(sys.argv[1]))
out = []
for n in range(896, 1409, 64):
    ex = capture(lm, token_ids=ids[:n])
    enc = encode(ex, None, preset="balanced", model=lm)
    with KvcReader(enc.data) as r:
        c = r.read_cache()
    cont = ids[n:n + 256]
    q = compare_logits(continue_logits(lm, ex, cont), continue_logits(lm, c, cont), cont)
    row = {"n": n, "kl": round(float(q["kl_mean"]), 5), "top1": round(float(q["top1_agreement"]), 3),
           "pred": enc.plan.params["rate"]["predicted_kl"]}
    print(row, flush=True); out.append(row)
json.dump(out, open(sys.argv[2], "w"))
