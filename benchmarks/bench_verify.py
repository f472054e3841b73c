"""Cost of the writer's read-back check: ``write_kvc`` time with and without ``verify``.

    python benchmarks/bench_verify.py [--tokens 512] [--repeat 3] [--presets lossless,fp16,balanced] [--json OUT]

A real cache of the embedded SmolLM2-135M (the first ``--tokens`` tokens of
the GPL-3 text) is written to a temp file with each preset's plan, alternating
``verify="file"`` and ``verify="off"`` so both see the same machine load; the
median of ``--repeat`` runs is reported with the ratio. ``verify="file"`` reads
the temp file back before the rename: structure, every CRC, padding and blob,
and every chunk decoded and compared (SHA-256) with what the encoder meant --
the input itself for lossless pipelines, the normative stage-by-stage decode
of the encoder's own output for lossy ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

import harness

from kvcodec.models.capture import capture, tokenize
from kvcodec.format import write_kvc
from kvcodec.api import make_plan
from kvcodec.models.load import load_model
from kvcodec.texts import load_text


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--presets", default="lossless,fp16,balanced")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    run = harness.cli(ap, argv, case="verify")
    a = run.args
    torch.set_num_threads(a.threads)
    lm = load_model("smollm2")
    cache = capture(lm, token_ids=tokenize(lm.tokenizer, load_text("gpl3"))[: a.tokens])
    rows = []
    with tempfile.TemporaryDirectory() as td:
        for preset in a.presets.split(","):
            plan = make_plan(cache, preset, model=lm)
            times: dict[bool, list[float]] = {True: [], False: []}
            size = 0
            for rep in range(a.repeat + 1):  # the first round warms numba / caches and is not counted
                for verify in (False, True) if rep % 2 else (True, False):  # alternating: one call at a time
                    with harness.stopwatch(cpu=None) as sw:
                        size = write_kvc(cache, Path(td) / f"{preset}.kvc", plan,
                                         verify="file" if verify else "off")
                    if rep:
                        times[verify].append(sw.wall)
            off, on = statistics.median(times[False]), statistics.median(times[True])
            rows.append({"preset": preset, "tokens": a.tokens, "bytes": size, "encode_s": round(off, 3),
                         "encode_verify_s": round(on, 3), "verify_overhead": round(on / off - 1, 3)})
            print(f"{preset:14s} {a.tokens} tokens {size:>11,} B  write {off * 1e3:8.0f} ms  write+verify {on * 1e3:8.0f} ms"
                  f"  ratio {on / off:5.2f}x (+{(on / off - 1) * 100:.0f} %)", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1) + "\n")
    run.emit({"rows": rows})


if __name__ == "__main__":
    main()
