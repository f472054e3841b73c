"""Probe (issue 38): the bits per *stored* K+V element `balanced` needs for KL 0.01, with token importance the
encoder cannot have.

Per text: the 2,048-token capture (the encoder's proxy importance observed by it, as shipped), the next 256 tokens
as the continuation. Three importances, each swept over step0 and joined log-log at KL 0.01:

- ``proxy``: what `balanced` codes with (the last 512 context queries, power 0.25, multipliers <= 4x, floor 2 %);
- ``oracle``: the continuation's own queries' mean a^2 over the context keys (one forward of context +
  continuation with the attention tap), with `balanced`'s tokenscale options;
- ``oracle-p0.5``: the same importance with the high-rate optimum for values (step ~ w^-1/2: power 0.5) and no
  floor (multipliers still <= 4x: at power 0.5 and up to 45x, SmolLM2 c-stdio's KL was 0.12 at step0 0.5, since
  a coarse key can lift an unread token's logit);
- ``oracle-wide``: power 0.25, multipliers up to 11x, no floor (towards prune-and-code's limit).

Bits are the file's (calibration external, not counted here; amortised over 100 documents it adds
``cal_bits_amortised``) over the K+V elements the cache stores, and over the full context's.

Run: ``python benchmarks/results/rate/issue38-oracle/probe_oracle.py gemma3-270m c-stdio py-argparse changelog-apt
> benchmarks/results/rate/issue38-oracle/gemma3-270m.jsonl`` (one JSON row per text).
"""

import json
import math
import os
import sys
import time

import numpy as np
import torch

from kvcodec.calibration.build import ensure_calibration
from kvcodec.format import KvcReader, encode_kvc_bytes
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.load import load_model
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.models.importance import attention_importance
from kvcodec.plan.pipelines import external_bytes
from kvcodec.api import make_plan
from kvcodec.plan.presets import score_window
from kvcodec.texts import load_text

T, CONT = 2048, 256
STEPS = tuple(float(s) for s in os.environ.get("STEPS", "0.35,0.5,0.7,1.0,1.4").split(","))
VARIANTS = {
    "proxy": None,
    "oracle": None,
    "oracle-p0.5": {"power": 0.5, "floor": 0.0},
    "oracle-wide": {"max_log2": 3.5, "floor": 0.0},
}


def bits_at(points: list[tuple[float, float]], kl: float) -> float | None:
    """Bits at ``kl`` on the (bits, KL) points, joined log-log between the two that bracket it."""
    pts = sorted(points, key=lambda p: p[1])
    for (b0, k0), (b1, k1) in zip(pts, pts[1:]):
        if k0 <= kl <= k1 and k0 > 0 and k1 > k0:
            t = (math.log(kl) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return None


def main() -> None:
    lm = load_model(sys.argv[1])
    cal = ensure_calibration(lm)
    for name in sys.argv[2:]:
        t0 = time.time()
        ids = tokenize(lm.tokenizer, load_text(name))
        if len(ids) < T + CONT:
            raise SystemExit(f"{name}: {len(ids)} tokens, need {T + CONT}")
        cache = capture(lm, token_ids=ids[:T], score_window=score_window("balanced"))
        cont = np.asarray(ids[T:T + CONT], np.int64)
        stored = sum(int(k.numel()) + int(v.numel()) for k, v in zip(cache.keys, cache.values))
        context = 2 * T * sum(int(k.shape[0]) * int(k.shape[-1]) for k in cache.keys)
        oracle = attention_importance(lm, ids[:T + CONT], window=CONT)[:, :T]
        with torch.inference_mode():
            exact = continue_logits(lm, cache, cont)
        row: dict = {"text": name, "T": T, "continuation": CONT, "stored_elements": stored,
                     "context_elements": context, "variants": {}}
        for variant, ts in VARIANTS.items():
            imp = None if variant == "proxy" else oracle
            pts = []
            for s in STEPS:
                over = {"step0": s}
                if ts is not None:
                    over["tokenscale"] = {"max_log2": 2.0, **ts}
                plan = make_plan(cache, "balanced", model=lm, calibration=cal, importance=imp, overrides=over)
                blob = encode_kvc_bytes(cache, plan, chunk_tokens=plan.chunk_tokens, preset="balanced")
                dec = KvcReader(blob).read_cache()
                row["cal_bits_amortised_per_stored"] = 8 * external_bytes(plan) / 100 / stored
                with torch.inference_mode():
                    q = compare_logits(exact, continue_logits(lm, dec, cont), cont)
                pts.append({"step0": s, "bits_stored": 8 * len(blob) / stored, "kl": q["kl_mean"],
                            "top1": q["top1_agreement"]})
            b = bits_at([(p["bits_stored"], p["kl"]) for p in pts], 0.01)
            row["variants"][variant] = {"points": pts, "bits_stored_at_kl_0.01": b,
                                        "bits_context_at_kl_0.01": None if b is None else b * stored / context}
        row["seconds"] = round(time.time() - t0, 1)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
