"""Experiment: per-(layer,kind) KL estimated from Fisher gradients x the actual coefficient errors, vs measured."""
import sys, time, math, copy, json, numpy as np, torch
from kvcodec.models.load import load_model
from kvcodec.models.capture import tokenize
from kvcodec.texts import load_text
from kvcodec.calibration.store import require_calibration
from kvcodec.calibration.build import _fisher_gradients, _coded_frame
from kvcodec.plan.ratefit import _fit_job, _table, ALLOC_PRESET, FIT_TEXTS
from kvcodec.plan.presets import lossy_settings
from kvcodec.plan.rate import noise_predictor
from kvcodec.plan.pipelines import transform_plan
from kvcodec.format.writer import roundtrip
from kvcodec.models.quality import continue_logits

lm = load_model(sys.argv[1]); S = int(sys.argv[2]); ncont = int(sys.argv[3]); nmeas = int(sys.argv[4])
texts = sys.argv[5].split(",") if len(sys.argv) > 5 else FIT_TEXTS
cal = require_calibration(lm.fingerprint)
settings, step0 = _table(lossy_settings()[ALLOC_PRESET])
sens = cal.sensitivity.astype(np.float64)
L = sens.shape[0]
B = cal.basis.astype(np.float64)  # [L,2,H,D,K]
out = {}
for name in texts:
    ids = tokenize(lm.tokenizer, load_text(name))
    t0 = time.process_time()
    with torch.inference_mode():
        cache, cont, exact, imp = _fit_job(lm, ids, 2048)
        predicted = sens * noise_predictor(cache, cal, settings, imp)(step0)
        dec, _ = roundtrip(cache, transform_plan(cache, step0, cal=cal, lm=lm, preset=ALLOC_PRESET, importance=imp, **settings))
    t1 = time.process_time()
    cont_e = cont[:ncont]
    # coefficient errors per tensor
    cerr = {}
    for l in range(L):
        for ki, kind in enumerate("kv"):
            e = (dec.keys if kind == "k" else dec.values)[l].float().numpy() - (cache.keys if kind == "k" else cache.values)[l].float().numpy()
            x = _coded_frame((dec.keys if kind == "k" else dec.values)[l].float().numpy(), cache, l, kind).astype(np.float64) - \
                _coded_frame((cache.keys if kind == "k" else cache.values)[l].float().numpy(), cache, l, kind).astype(np.float64)
            Binv = np.linalg.pinv(B[l, ki])  # [H,K,D]
            cerr[(l, ki)] = np.einsum("hkd,htd->htk", Binv, x)
    acc = np.zeros((L, 2))
    for s, grads in enumerate(_fisher_gradients(lm, cache, cont_e, S, 0)):
        for i, g in enumerate(grads):
            l, ki = i // 2, i % 2
            gx = _coded_frame(g[0].detach().float().numpy(), cache, l, "kv"[ki]).astype(np.float64)
            gc = np.einsum("hdk,htd->htk", B[l, ki], gx)
            acc[l, ki] += float((gc ** 2 * cerr[(l, ki)] ** 2).sum())
    est = 0.5 * acc / (S * len(cont_e))
    t2 = time.process_time()
    # measured for a few tensors
    meas = {}
    rng = np.random.default_rng(0)
    pick = [tuple(map(int, p)) for p in rng.choice([(l, k) for l in range(L) for k in range(2)], size=nmeas, replace=False)]
    with torch.inference_mode():
        lp_e = torch.log_softmax(exact.double(), -1)
        for (l, ki) in pick:
            one = copy.copy(cache); one.keys, one.values = list(cache.keys), list(cache.values)
            (one.keys if ki == 0 else one.values)[l] = (dec.keys if ki == 0 else dec.values)[l]
            lp_d = torch.log_softmax(continue_logits(lm, one, cont).double(), -1)
            meas[(l, ki)] = float((lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).mean())
    t3 = time.process_time()
    print(f"{name}: job {t1-t0:.1f} cpu-s, estimate {t2-t1:.1f} cpu-s, {nmeas} measured {t3-t2:.1f} cpu-s", flush=True)
    for (l, ki), m in meas.items():
        print(f"  L{l}{'kv'[ki]} measured {m:.3e} est {est[l,ki]:.3e} pred {predicted[l,ki]:.3e}  est/meas {est[l,ki]/max(m,1e-30):.2f}", flush=True)
    out[name] = {"est": est.tolist(), "pred": predicted.tolist(), "meas": {f"{l},{k}": v for (l, k), v in meas.items()}}
json.dump(out, open(f"/tmp/probe/lf-{sys.argv[1]}-{S}-{ncont}.json", "w"))
