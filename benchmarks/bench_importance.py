"""Token importance: one prefill of the whole context vs the last window's queries over the cache (issue 21).

The lossy presets' token-importance scores need the last ``window`` (512)
queries' attention over every key. ``attention_importance`` runs a prefill of
the whole context; ``cache_importance`` runs only those queries over the
cache's own prefix. This script times both in the same process on a real
capture, reports the largest difference of the scores and how many tokenscale
classes (balanced's settings) differ.

    python benchmarks/bench_importance.py --model smollm2 --text gpl3 --tokens 1024,2048
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from kvcodec.models.capture import select_context, tokenize
from kvcodec.eval.curve import cached_capture, default_capture_dir
from kvcodec.models.load import load_model
from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT
from kvcodec.plan.importance import attention_importance, cache_importance, token_multipliers
from kvcodec.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", default="1024,2048")
    args = ap.parse_args()
    lm = load_model(args.model)
    ids_all = tokenize(lm.tokenizer, load_text(args.text))
    w = TOKENSCALE_DEFAULT["window"]
    for n in (int(x) for x in args.tokens.split(",")):
        cache = cached_capture(lm, select_context(ids_all, n), default_capture_dir())
        t0 = time.perf_counter()
        full = attention_importance(lm, cache.token_ids, w)
        t1 = time.perf_counter()
        fast = cache_importance(lm, cache, w)
        t2 = time.perf_counter()
        diff = sum(int((token_multipliers(full[layer], 4, max_log2=2.0, power=0.25)[0]
                        != token_multipliers(fast[layer], 4, max_log2=2.0, power=0.25)[0]).sum())
                   for layer in range(full.shape[0]))
        print(json.dumps({"model": args.model, "text": args.text, "tokens": cache.num_tokens, "window": w,
                          "prefill_s": round(t1 - t0, 2), "from_cache_s": round(t2 - t1, 2),
                          "speedup": round((t1 - t0) / (t2 - t1), 2),
                          "max_abs_diff": float(np.abs(full - fast).max()), "class_diffs": diff}), flush=True)


if __name__ == "__main__":
    main()
