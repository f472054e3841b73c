# ruff: noqa  (a one-off probe kept as it ran; see README.md)
"""apache2 on Gemma 3: per-token KL of a plain balanced encode of the first 1,152 tokens over the next 256; the
largest terms with their text. Usage: python per_token.py"""
import torch, numpy as np
torch.set_num_threads(1)
from kvcodec.api import encode
from kvcodec.format import KvcReader
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import continue_logits
from kvcodec.texts import load_text
lm = load_model("gemma3-270m"); lm.warm_up()
ids = tokenize(lm.tokenizer, load_text("apache2")); n = 1152
ex = capture(lm, token_ids=ids[:n]); enc = encode(ex, None, preset="balanced", model=lm)
with KvcReader(enc.data) as r: c = r.read_cache()
cont = ids[n:n+256]
a = torch.log_softmax(continue_logits(lm, ex, cont).double(), -1); b = torch.log_softmax(continue_logits(lm, c, cont).double(), -1)
kl = (a.exp() * (a - b)).sum(-1).clamp_min(0).numpy()
print("mean", kl.mean(), "top10 share", np.sort(kl)[-10:].sum() / kl.sum(), "first 32 mean", kl[:32].mean(), "rest", kl[32:].mean())
for i in np.argsort(-kl)[:12]:
    print(i, round(float(kl[i]), 4), repr(lm.tokenizer.decode(ids[n+i-6:n+i+1])), '->', repr(lm.tokenizer.decode(ids[n+i+1:n+i+2])))
print(repr(lm.tokenizer.decode(ids[n-60:n])), '|||', repr(lm.tokenizer.decode(ids[n:n+80])))
