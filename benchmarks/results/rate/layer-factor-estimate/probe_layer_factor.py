"""Probe (issue 54, item 6): each (layer, kind)'s KL at balanced's step from Fisher gradients, against measuring it.

    python benchmarks/results/rate/layer-factor-estimate/probe_layer_factor.py MODEL S CONT NMEAS [TEXTS]

For each rate-model fit text at 2,048 tokens: the codec's real coefficient errors c of every K/V tensor (decoded
minus exact, in the plans' coded frame), S Hutchinson Fisher gradients g over the first CONT continuation tokens,
and the estimate KL ~ 1/2 E_s sum_{t,k} (B^T g_s)^2 c^2 (the quadratic form's expectation over independent errors).
NMEAS random tensors are also measured the way ``ratefit.measure_layer_factor`` does (that tensor alone decoded,
a real continuation). Writes ``lf-MODEL-S-CONT.json`` in the working directory: per text, est / pred [L, 2] and the
measured ones.
"""

from __future__ import annotations

import copy
import json
import sys
import time

import numpy as np
import torch

from kvcodec.calibration.build import _coded_frame, _fisher_gradients
from kvcodec.calibration.store import require_calibration
from kvcodec.core.roundtrip import roundtrip
from kvcodec.models.capture import tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import continue_logits
from kvcodec.plan.pipelines import transform_plan
from kvcodec.plan.presets import lossy_settings
from kvcodec.plan.ratecontrol import noise_predictor
from kvcodec.onboard.ratefit import ALLOC_PRESET, FIT_TEXTS, _fit_job, _table
from kvcodec.texts import load_text


def main() -> None:
    lm = load_model(sys.argv[1])
    S, ncont, nmeas = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    texts = sys.argv[5].split(",") if len(sys.argv) > 5 else FIT_TEXTS
    cal = require_calibration(lm.fingerprint)
    settings, step0 = _table(lossy_settings()[ALLOC_PRESET])
    sens = cal.sensitivity.astype(np.float64)
    L = sens.shape[0]
    B = cal.basis.astype(np.float64)  # [L, 2, H, D, K]
    out = {}
    for name in texts:
        ids = tokenize(lm.tokenizer, load_text(name))
        t0 = time.process_time()
        with torch.inference_mode():
            cache, cont, exact, imp = _fit_job(lm, ids, 2048)
            predicted = sens * noise_predictor(cache, cal, settings, imp)(step0)
            dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, lm=lm, preset=ALLOC_PRESET, importance=imp,
                                                     **settings))
        t1 = time.process_time()
        cerr = {}
        for l in range(L):
            for ki, kind in enumerate("kv"):
                got = (dec.keys if kind == "k" else dec.values)[l].float().numpy()
                ref = (cache.keys if kind == "k" else cache.values)[l].float().numpy()
                x = _coded_frame(got, cache, l, kind).astype(np.float64) - _coded_frame(ref, cache, l, kind).astype(np.float64)
                cerr[(l, ki)] = np.einsum("hkd,htd->htk", np.linalg.pinv(B[l, ki]), x)
        acc = np.zeros((L, 2))
        for grads in _fisher_gradients(lm, cache, cont[:ncont], S, 0):
            for i, g in enumerate(grads):
                l, ki = i // 2, i % 2
                gx = _coded_frame(g[0].detach().float().numpy(), cache, l, "kv"[ki]).astype(np.float64)
                gc = np.einsum("hdk,htd->htk", B[l, ki], gx)
                acc[l, ki] += float((gc ** 2 * cerr[(l, ki)] ** 2).sum())
        est = 0.5 * acc / (S * len(cont[:ncont]))
        t2 = time.process_time()
        meas = {}
        rng = np.random.default_rng(0)
        pick = [tuple(map(int, p)) for p in rng.choice([(l, k) for l in range(L) for k in range(2)], size=nmeas, replace=False)]
        with torch.inference_mode():
            lp_e = torch.log_softmax(exact.double(), -1)
            for (l, ki) in pick:
                one = copy.copy(cache)
                one.keys, one.values = list(cache.keys), list(cache.values)
                (one.keys if ki == 0 else one.values)[l] = (dec.keys if ki == 0 else dec.values)[l]
                lp_d = torch.log_softmax(continue_logits(lm, one, cont).double(), -1)
                meas[(l, ki)] = float((lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).mean())
        t3 = time.process_time()
        print(f"{name}: job {t1 - t0:.1f} cpu-s, estimate {t2 - t1:.1f} cpu-s, {nmeas} measured {t3 - t2:.1f} cpu-s", flush=True)
        for (l, ki), m in meas.items():
            print(f"  L{l}{'kv'[ki]} measured {m:.3e} est {est[l, ki]:.3e} pred {predicted[l, ki]:.3e}  "
                  f"est/meas {est[l, ki] / max(m, 1e-30):.2f}", flush=True)
        out[name] = {"est": est.tolist(), "pred": predicted.tolist(), "meas": {f"{l},{k}": v for (l, k), v in meas.items()}}
    with open(f"lf-{sys.argv[1]}-{S}-{ncont}.json", "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
