import sys, time, json, os
import torch; torch.set_num_threads(int(os.environ.get("TT", "1")))
import kvcodec.plan.ratefit as rf
from kvcodec.models.load import load_model
from kvcodec.calibration.store import load_calibration
from kvcodec.calibration.ratemodel import save_rate_model
from kvcodec.plan.presets import lossy_settings, answer_targets, preset_targets
T = {}
def timed(mod, name, key):
    f = getattr(mod, name)
    def g(*a, **k):
        t = time.process_time(); r = f(*a, **k); d = time.process_time() - t; T[key] = T.get(key, 0) + d
        print("PHASE", key, round(d, 1), flush=True); return r
    setattr(mod, name, g)
timed(rf, "measure_layer_factor", "layer_factor")
timed(rf, "_measure", "measure")
timed(rf, "_answer_probe", "answer_probe")
timed(rf, "_chat_factors", "chat_factor")
lm = load_model(sys.argv[1])
cal = load_calibration(lm.fingerprint.id)
t = time.process_time()
rm = rf.fit_rate_model(lm, cal, lossy_settings(), answers=answer_targets(), targets=preset_targets(), progress=False)
T["total"] = time.process_time() - t
save_rate_model(rm, sys.argv[2])
print(json.dumps({k: round(v, 1) for k, v in T.items()}), flush=True)
