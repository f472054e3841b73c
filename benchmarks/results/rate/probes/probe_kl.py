"""Probe (issue 33): how is a 320-token mean KL made up? ``balanced``, per-window KL over a 1,280-token continuation
and the share of the first window's KL held by its 5 largest tokens.

Run: ``python benchmarks/results/rate/probes/probe_kl.py smollm2 pydoc-exec:4096 py-heapq:4096 py-argparse:2048
c-stdlib:2048 c-stdio:4096`` (2026-11-28: probe_kl-smollm2.jsonl).
"""

import json
import sys

import numpy as np
import torch

from kvcodec.calibration.build import ensure_calibration
from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import continue_logits
from kvcodec.api import make_plan
from kvcodec.plan.presets import score_window
from kvcodec.texts import load_text

CONT = 1280


def main() -> None:
    torch.set_num_threads(1)
    lm = load_model(sys.argv[1])
    cal = ensure_calibration(lm)
    for spec in sys.argv[2:]:
        name, t = spec.split(":")
        T = int(t)
        ids = tokenize(lm.tokenizer, load_text(name))
        cache = capture(lm, token_ids=ids[:T], score_window=score_window("balanced"))
        cont = np.asarray(ids[T:T + CONT], np.int64)
        plan = make_plan(cache, "balanced", model=lm, calibration=cal)
        dec = KvcReader(encode_kvc_bytes(cache, plan, chunk_tokens=plan.chunk_tokens, preset="balanced")).read_cache()
        with torch.inference_mode():
            lp_e = torch.log_softmax(continue_logits(lm, cache, cont).double(), -1)
            lp_d = torch.log_softmax(continue_logits(lm, dec, cont).double(), -1)
        kl = (lp_e.exp() * (lp_e - lp_d)).sum(-1).clamp_min(0).numpy()
        first = np.sort(kl[:320])[::-1]
        print(json.dumps({"text": name, "T": T, "kl320": [float(kl[i:i + 320].mean()) for i in range(0, CONT, 320)],
                          "kl_all": float(kl.mean()), "share_top5_of_first320": float(first[:5].sum() / first.sum())}),
              flush=True)


if __name__ == "__main__":
    main()
