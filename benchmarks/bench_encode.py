"""The encode path alone, per core: rate-controlled plan + write + the writer's read-back, in CPU-seconds.

    OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1 python benchmarks/bench_encode.py
    python benchmarks/bench_encode.py --models gemma3-270m --tokens 2048 --repeat 3

What issue 33's "encode MB/s per core" counts, without ``bench_rate.py``'s quality evaluation around it:
per (model, context length), one capture of a held-out text (with the token importance the plan reads,
as ``kvc encode`` captures), then ``--repeat`` encodes of it, each timed as one interval of process CPU
time (:func:`kvcodec.plan.presets.get_plan` with rate control, then
:func:`kvcodec.format.encode_kvc_bytes` with its read-back). The figure is the best of the repeats (the
least-disturbed run on a shared box); every repeat is in the result. MB is the cache as fp16 (stored K+V
elements x 2 bytes, as ``bench_rate.py``). One untimed warm-up encode per model and preset (numba kernels,
imports). Calibration and rate model are the model's (built once, not charged).

An A/B of two checkouts runs this script with ``PYTHONPATH`` set to each in turn: each row records the
``kvcodec`` it imported and that checkout's commit, and the sha256 of the file it wrote, so a change that
should not change the bytes can be seen not to.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
from pathlib import Path

import harness


def main(argv=None) -> None:
    from kvcodec.texts import HELD_OUT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--text", default="py-argparse", choices=HELD_OUT, help="a held-out text")
    ap.add_argument("--tokens", default="1024,2048,4096", help="context lengths")
    ap.add_argument("--presets", default="balanced")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    run = harness.cli(ap, argv, case="encode")
    a = run.args
    import torch

    import kvcodec
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.api import make_plan
    from kvcodec.api import resolve_rate_model
    from kvcodec.plan.presets import score_window
    from kvcodec.texts import load_text

    torch.set_num_threads(a.threads)
    src = Path(kvcodec.__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    presets = [p for p in a.presets.split(",") if p]
    rows = []
    for model in [m for m in a.models.split(",") if m]:
        lm = load_model(model)
        cal = ensure_calibration(lm)
        resolve_rate_model(lm, cal)
        warm = capture(lm, token_ids=tokenize(lm.tokenizer, load_text("gpl3"))[:256])
        for preset in presets:
            plan = make_plan(warm, preset, model=lm, calibration=cal)
            encode_kvc_bytes(warm, plan, chunk_tokens=plan.chunk_tokens, preset=preset)
        ids = tokenize(lm.tokenizer, load_text(a.text))
        for T in [int(x) for x in a.tokens.split(",") if x]:
            if len(ids) < T:
                print(f"{model} {T}: skipped, {a.text} has {len(ids)} tokens", file=sys.stderr)
                continue
            cache = capture(lm, token_ids=ids[:T], score_window=score_window("balanced"))
            mb = sum(k.numel() + v.numel() for k, v in zip(cache.keys, cache.values)) * 2 / 1e6
            for preset in presets:
                cpu, data = [], b""
                for _ in range(a.repeat):
                    with harness.stopwatch() as sw:
                        plan = make_plan(cache, preset, model=lm, calibration=cal)
                        data = encode_kvc_bytes(cache, plan, chunk_tokens=plan.chunk_tokens, preset=preset)
                    cpu.append(sw.cpu)
                best = min(cpu)
                rows.append({"model": model, "preset": preset, "text": a.text, "tokens": T, "fp16_mb": mb,
                             "encode_cpu_s": cpu, "best_cpu_s": best, "mb_s_per_core": mb / best, "bytes": len(data),
                             "sha256": hashlib.sha256(data).hexdigest(), "kvcodec": str(src), "commit": commit})
                print(f"{model} {T} {preset}: {best:.3f} CPU-s, {mb / best:.1f} MB/s per core, {len(data):,} B",
                      file=sys.stderr, flush=True)
    run.emit({"rows": rows})


if __name__ == "__main__":
    main()
