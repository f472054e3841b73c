"""``kvc calibrate`` with its phases' CPU-s printed (issue 54, item 6): a probe, not a shipped path.

Usage: ``KVCODEC_CACHE=<fresh> OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 /usr/bin/time -v python calibrate_phases.py
calibrate --model MODEL --json``: the CLI itself (``kvcodec.cli.main``), with the model load, the calibration and the
rate model's phases wrapped so that each prints ``PHASE name CPU-s`` (``time.process_time``, every thread) to stderr
and a ``PHASES {...}`` line of the totals at the end.
"""

import atexit
import json
import sys
import time

import kvcodec.calibration.build as build
import kvcodec.models.load as load
import kvcodec.onboard.ratefit as rf
from kvcodec.cli.main import main

T: dict[str, float] = {}
T0 = time.process_time()


def timed(mod, name, key):
    """Wrap ``mod.name`` so that its CPU-s add up under ``key``."""
    f = getattr(mod, name)

    def g(*a, **k):
        t = time.process_time()
        r = f(*a, **k)
        d = time.process_time() - t
        T[key] = T.get(key, 0) + d
        print("PHASE", key, round(d, 1), file=sys.stderr, flush=True)
        return r

    setattr(mod, name, g)


timed(load, "load_model", "load_model")
timed(build, "build_calibration", "calibration")
timed(rf, "_measure", "fit_rows")
timed(rf, "_answer_probe", "answer_probe")
timed(rf, "_chat_factors", "chat_factor")
timed(rf, "fit_rate_model", "rate_model")


@atexit.register
def _report():
    T["process"] = time.process_time() - T0
    print("PHASES", json.dumps({k: round(v, 1) for k, v in T.items()}), file=sys.stderr, flush=True)


main()
