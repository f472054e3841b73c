"""Page faults and system time of each ``ask`` in one process (issue 21: why cold and warm differed).

Answers the same question from a directory store ``--asks`` times in one process (the
entry is deposited first if missing) and prints, per ask, TTFT, minor page faults and
user/system CPU seconds from ``getrusage``. ``--untuned`` skips
``kvcodec.runtime.allocator.tune_allocator`` (what the ``kvc`` command does at start-up), to
compare the two allocator settings on the same entry.

    python benchmarks/bench_faults.py --tokens 4096 [--untuned]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
from pathlib import Path

import torch

import harness

QUESTION = "What does this document say about warranties?"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--asks", type=int, default=3)
    ap.add_argument("--untuned", action="store_true")
    ap.add_argument("--store", default=str(Path(tempfile.gettempdir()) / "kvc-bench-faults"))
    run = harness.cli(ap, argv, case="faults")
    args = run.args
    from kvcodec.runtime.allocator import tune_allocator

    if not args.untuned:
        tune_allocator()
    torch.set_num_threads(1)
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text
    from kvcodec.runtime.warmup import prewarm

    th = prewarm()
    lm = load_model("smollm2")
    lm.warm_up()
    if th is not None:
        th.join()
    text = "".join(load_text(t) for t in ("gpl3", "lgpl21", "pydoc"))
    doc = lm.tokenizer.decode(lm.tokenizer(text)["input_ids"][: args.tokens])
    kb = KnowledgeBase(lm, f"{args.store}-{args.tokens}", preset="balanced")
    kb.ask([doc], QUESTION, max_new_tokens=1)  # deposits the entry on the first run
    print(f"allocator {'untuned' if args.untuned else 'tuned'}, {args.tokens} tokens")
    rows = []
    for i in range(args.asks):
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        a = kb.ask([doc], QUESTION, max_new_tokens=1, store_new=False)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        rows.append({"ask": i, "source": a.source, "ttft_s": a.ttft_s, "minor_faults": r1.ru_minflt - r0.ru_minflt,
                     "user_s": r1.ru_utime - r0.ru_utime, "system_s": r1.ru_stime - r0.ru_stime})
        print(f"ask {i}: {a.source} TTFT {a.ttft_s:.3f} s, minor faults {r1.ru_minflt - r0.ru_minflt}, "
              f"user {r1.ru_utime - r0.ru_utime:.3f} s, system {r1.ru_stime - r0.ru_stime:.3f} s", flush=True)
    run.emit({"allocator": "untuned" if args.untuned else "tuned", "rows": rows})


if __name__ == "__main__":
    main()
