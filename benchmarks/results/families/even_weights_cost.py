"""What the calibration's even-weights fallback costs, measured on a real model (SmolLM2-135M).

A model whose attention modules kvcodec cannot find (GPT-2, Falcon, MPT: blocks outside ``.model.layers``) is
calibrated with even weights: its bases fit plain squared error on the keys and values instead of the error the
attention sees (queries' energy per key channel pair, W_o^T W_o for the values). No real model of those families
is on this machine, so this calibrates SmolLM2 both ways, in one process (float32, nothing saved), and encodes the
same held-out contexts with ``balanced``'s pipelines at a sweep of steps under each: bits per stored element (the
chunks' payload, no header) against the KL of a 256-token continuation against the exact cache. Rate control
aims at a KL, so what the fallback costs is the bits at equal KL.

    KVCODEC_ONBOARD_DTYPE=float32 OMP_NUM_THREADS=2 python benchmarks/results/families/even_weights_cost.py > out.json
"""

from __future__ import annotations

import json
import math
import platform
import subprocess
import sys
import time

import numpy as np

from kvcodec.api import make_plan
from kvcodec.calibration.build import build_calibration
from kvcodec.core.roundtrip import roundtrip
from kvcodec.eval.curve import kv_elements
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.layout import LEADING
from kvcodec.models.load import load_model
from kvcodec.models.quality import compare_caches, continue_logits
from kvcodec.texts import HELD_OUT, load_text

TEXTS = HELD_OUT[:3]
TOKENS, CONT = 1024, 256
STEPS = (0.25, 0.4, 0.6, 0.9, 1.3)


def blind(lm):
    """``lm`` with a layout that finds no query or output projection: what GPT-2, Falcon and MPT get."""
    lay = lm.layout

    class Blind(type(lay)):
        def query(self, model, layer):
            return None, None, None, LEADING

        def output_projection(self, model, layer):
            return None

    return Blind(**{f: getattr(lay, f) for f in lay.__dataclass_fields__})


def main() -> int:
    lm = load_model("smollm2")
    t0 = time.time()
    cals = {"attention": build_calibration(lm, progress=False)}
    real = lm.layout
    lm.__dict__["layout"] = blind(lm)
    try:
        cals["even"] = build_calibration(lm, progress=False)
    finally:
        lm.__dict__["layout"] = real
    assert "even_weights" in cals["even"].meta and "even_weights" not in cals["attention"].meta
    rows = []
    for name in TEXTS:
        ids = tokenize(lm.tokenizer, load_text(name))[: TOKENS + CONT]
        cache = capture(lm, token_ids=ids[:TOKENS])
        cont = ids[TOKENS:]
        exact = continue_logits(lm, cache, cont)
        n = kv_elements(cache)
        for kind, cal in cals.items():
            for step in STEPS:
                plan = make_plan(cache, "balanced", model=lm, calibration=cal, rate="fixed", overrides={"step0": step})
                dec, nbytes = roundtrip(cache, plan)
                q = compare_caches(lm, cache, dec, cont, greedy_tokens=0, exact_logits=exact)
                rows.append({"text": name, "calibration": kind, "step0": step, "bits_per_element": 8 * nbytes / n,
                             "kl": q.kl_mean, "top1": q.top1_agreement})
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    # bits at equal KL: each even-weights point against the attention-weighted curve of its text (log-log)
    ratios = []
    for name in TEXTS:
        att = sorted((r["kl"], r["bits_per_element"]) for r in rows if r["text"] == name and r["calibration"] == "attention")
        for r in (r for r in rows if r["text"] == name and r["calibration"] == "even"):
            if att[0][0] <= r["kl"] <= att[-1][0]:
                i = next(j for j in range(1, len(att)) if att[j][0] >= r["kl"])
                (k0, b0), (k1, b1) = att[i - 1], att[i]
                w = (math.log(r["kl"]) - math.log(k0)) / (math.log(k1) - math.log(k0)) if k1 > k0 else 0.0
                ratios.append({"text": name, "step0": r["step0"], "kl": r["kl"],
                               "bits_even_over_attention": r["bits_per_element"] / math.exp(
                                   math.log(b0) + w * (math.log(b1) - math.log(b0)))})
    out = {"command": " ".join(sys.argv), "machine": platform.processor() or platform.machine(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "texts": list(TEXTS), "tokens": TOKENS, "continuation": CONT, "rows": rows, "equal_kl": ratios,
           "geomean_bits_ratio": math.exp(float(np.mean([math.log(r["bits_even_over_attention"]) for r in ratios])))
           if ratios else None, "seconds": round(time.time() - t0, 1)}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
