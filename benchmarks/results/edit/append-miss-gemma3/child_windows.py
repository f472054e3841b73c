# ruff: noqa  (a one-off probe kept as it ran; see README.md)
"""Issue 57: is Gemma's apache2 append-child miss rate control's own per-file miss, or edit-specific?
For each held-out text: the child's ids = first 1,152 tokens; a fresh prefill encoded at balanced
(a) plain (rate control, no check) and (b) with the check (as the edit does); each scored on the
next 256 tokens (the promise's window) and on the two windows after it.
Usage: python child_windows.py TEXT[,TEXT...] OUT.json"""
import json, sys, time
import numpy as np, torch
torch.set_num_threads(1)
from kvcodec.api import encode
from kvcodec.format import KvcReader
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.texts import load_text

def dec(data):
    with KvcReader(data) as r:
        return r.read_cache(), r.header.num_elements

def score(lm, exact, cache, cont):
    ref = continue_logits(lm, exact, cont)
    q = compare_logits(ref, continue_logits(lm, cache, cont), cont)
    return round(float(q["kl_mean"]), 5), round(float(q["top1_agreement"]), 3)

lm = load_model("gemma3-270m"); lm.warm_up()
texts = sys.argv[1].split(",")
N, A, C = 1024, 128, 256
out = []
for t in texts:
    ids = tokenize(lm.tokenizer, load_text(t))
    n = N + A
    ex = capture(lm, token_ids=ids[:n])
    row = {"text": t, "tokens": len(ids)}
    for check in (False, True):
        t0 = time.process_time()
        enc = encode(ex, None, preset="balanced", model=lm, check=check)
        cache, ne = dec(enc.data)
        r = enc.plan.params.get("rate", {})
        chk = enc.plan.params.get("check") or {}
        d = {"bits": round(8 * len(enc.data) / ne, 3), "step0": r.get("step0"), "predicted_kl": r.get("predicted_kl"),
             "aim_kl": r.get("aim_kl"), "cpu_s": round(time.process_time() - t0, 1),
             "tries": [(round(x["step0"], 4), round(x["kl_mean"], 5), round(x["top1"], 3)) for x in chk.get("tries", [])]}
        wins = []
        for w in range(3):
            a, b = n + w * C, n + (w + 1) * C
            if b > len(ids):
                break
            # window w: continue over ids[n:a] then score [a,b): continuation of ids[n:b] scored on its last C
            cont = ids[n:b]
            ref = continue_logits(lm, ex, cont)
            got = continue_logits(lm, cache, cont)
            q = compare_logits(ref[-C:], got[-C:], cont[-C:])
            wins.append((round(float(q["kl_mean"]), 5), round(float(q["top1_agreement"]), 3)))
        d["windows"] = wins
        row["checked" if check else "plain"] = d
        print(t, "check" if check else "plain", d, flush=True)
    out.append(row)
json.dump(out, open(sys.argv[2], "w"), indent=1)
