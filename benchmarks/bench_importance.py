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

import numpy as np

import harness
from kvcodec.models.capture import select_context, tokenize
from kvcodec.eval.curve import cached_capture, default_capture_dir
from kvcodec.models.load import load_model
from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT
from kvcodec.models.importance import attention_importance, cache_importance
from kvcodec.plan.importance import token_multipliers
from kvcodec.texts import load_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--text", default="gpl3")
    ap.add_argument("--tokens", default="1024,2048")
    run = harness.cli(ap, argv, case="importance")
    args = run.args
    lm = load_model(args.model)
    ids_all = tokenize(lm.tokenizer, load_text(args.text))
    w = TOKENSCALE_DEFAULT["window"]
    rows = []
    for n in (int(x) for x in args.tokens.split(",")):
        cache = cached_capture(lm, select_context(ids_all, n), default_capture_dir())
        with harness.stopwatch(cpu=None) as sw_full:
            full = attention_importance(lm, cache.token_ids, w)
        with harness.stopwatch(cpu=None) as sw_fast:
            fast = cache_importance(lm, cache, w)
        diff = sum(int((token_multipliers(full[layer], 4, max_log2=2.0, power=0.25)[0]
                        != token_multipliers(fast[layer], 4, max_log2=2.0, power=0.25)[0]).sum())
                   for layer in range(full.shape[0]))
        rows.append({"model": args.model, "text": args.text, "tokens": cache.num_tokens, "window": w,
                     "prefill_s": round(sw_full.wall, 2), "from_cache_s": round(sw_fast.wall, 2),
                     "speedup": round(sw_full.wall / sw_fast.wall, 2),
                     "max_abs_diff": float(np.abs(full - fast).max()), "class_diffs": diff})
        print(json.dumps(rows[-1]), flush=True)
    run.emit({"rows": rows})


if __name__ == "__main__":
    main()
