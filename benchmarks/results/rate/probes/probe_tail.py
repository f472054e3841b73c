"""Probe (issue 33): does the context's own tail foresee the continuation's KL?

``balanced``, per held-out text and length: the continuation's KL (the next 320 tokens, as bench_rate.py), the
tail's KL (the context's last TAIL tokens continued over the coded cache of the tokens before them) and the
rate control's prediction. Run: ``python benchmarks/results/rate/probes/probe_tail.py smollm2 256``
(2026-11-28, stopped after 5 rows: probe_tail-smollm2.jsonl).
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
from kvcodec.texts import HELD_OUT, load_text


def kl_of(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    la, lb = torch.log_softmax(a.double(), -1), torch.log_softmax(b.double(), -1)
    return (la.exp() * (la - lb)).sum(-1).clamp_min(0).numpy()


def main() -> None:
    torch.set_num_threads(1)
    model, tail_n = sys.argv[1], int(sys.argv[2])
    lm = load_model(model)
    cal = ensure_calibration(lm)
    for name in HELD_OUT:
        ids = tokenize(lm.tokenizer, load_text(name))
        for T in (1024, 2048, 4096):
            if len(ids) < T + 320:
                continue
            cache = capture(lm, token_ids=ids[:T], score_window=score_window("balanced"))
            plan = make_plan(cache, "balanced", model=lm, calibration=cal)
            dec = KvcReader(encode_kvc_bytes(cache, plan, chunk_tokens=plan.chunk_tokens, preset="balanced")).read_cache()
            cont = np.asarray(ids[T:T + 320], np.int64)
            tail = np.asarray(ids[T - tail_n:T], np.int64)
            with torch.inference_mode():
                c = kl_of(continue_logits(lm, cache, cont), continue_logits(lm, dec, cont))
                t = kl_of(continue_logits(lm, cache.prefix(T - tail_n), tail),
                          continue_logits(lm, dec.prefix(T - tail_n), tail))
            print(json.dumps({"text": name, "T": T, "pred": plan.params["rate"]["predicted_kl"], "cont": float(c.mean()),
                              "tail": float(t.mean()), "tail_half2": float(t[tail_n // 2:].mean())}), flush=True)


if __name__ == "__main__":
    main()
