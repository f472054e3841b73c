"""The thorough rate-model fit's phases in CPU-s (issue 54, item 6): a probe, not a shipped path.

Usage (run on the code of d988ef1, before the rate modules moved to kvcodec/onboard/; at later commits import
``kvcodec.onboard.ratefit`` instead): ``KVCODEC_CACHE=<cache holding MODEL's calibration> OMP_NUM_THREADS=1
python thorough_phases.py MODEL OUT.json``. Prints one ``PHASE name CPU-s`` line per phase, then the totals.
"""

import json
import os
import sys
import time
from pathlib import Path

import torch

import kvcodec.plan.ratefit as rf
from kvcodec.calibration.ratemodel import save_rate_model
from kvcodec.calibration.store import load_calibration
from kvcodec.models.load import load_model
from kvcodec.plan.presets import answer_targets, lossy_settings, preset_targets

torch.set_num_threads(int(os.environ.get("TT", "1")))
T: dict[str, float] = {}


def timed(mod, name, key):
    """Wrap ``mod.name`` so that its CPU-s add up under ``key``."""
    f = getattr(mod, name)

    def g(*a, **k):
        t = time.process_time()
        r = f(*a, **k)
        d = time.process_time() - t
        T[key] = T.get(key, 0) + d
        print("PHASE", key, round(d, 1), flush=True)
        return r

    setattr(mod, name, g)


timed(rf, "measure_layer_factor", "layer_factor")
timed(rf, "_measure", "measure")
timed(rf, "_answer_probe", "answer_probe")
timed(rf, "_chat_factors", "chat_factor")
lm = load_model(sys.argv[1])
cal = load_calibration(lm.fingerprint.id)
t0 = time.process_time()
rm = rf.fit_rate_model(lm, cal, lossy_settings(), answers=answer_targets(), targets=preset_targets(), progress=False)
T["total"] = time.process_time() - t0
print(json.dumps({k: round(v, 1) for k, v in T.items()}), flush=True)
save_rate_model(rm, Path(sys.argv[2]))
