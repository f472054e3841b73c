"""The CLI path's forward passes: `kvc capture` then `kvc encode --preset P`, each a process of its own, in CPU-s.

Why processes: the question (issue 53) is what a user of the two commands pays, model loads and imports
included. The encode is run twice on the same capture: on the file as `kvc capture` wrote it (the token
importance its prefill observed rides in it) and on the same file with the scores dropped (what the encoder
then recomputes with a forward pass over the context's last queries). Both files' bytes are reported, so the
saving is seen at equal output. CPU-s are the child processes' user + system time (resource.getrusage).

    python benchmarks/bench_cli_encode.py --texts c-stdio,py-argparse --tokens 2048
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness


def _run(cmd: list[str]) -> tuple[float, float]:
    """(CPU-s, wall-s) of one child process; raises with its stderr's last line if it fails."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)}: exit {p.returncode}: {(p.stderr.strip().splitlines() or [''])[-1]}")
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), wall


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", default="c-stdio,py-argparse", help="kvcodec.texts names (held-out texts by default)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--model", default="smollm2")
    run = harness.cli(ap, argv, case="cli_encode")
    args = run.args
    kvc = str(Path(sys.executable).with_name("kvc"))
    from kvcodec.core.kvcache import load_capture, save_capture

    rows = []
    with tempfile.TemporaryDirectory(prefix="kvc-cli-encode-") as tmp:
        for text in [t for t in args.texts.split(",") if t]:
            cap, plain = os.path.join(tmp, f"{text}.h5"), os.path.join(tmp, f"{text}-noscores.h5")
            c_cpu, c_wall = _run([kvc, "capture", "--text", text, "-m", args.model, "--max-tokens", str(args.tokens), "-o", cap])
            c = load_capture(cap)
            c.attention = None
            save_capture(c, plain)
            out = {}
            for name, src in (("encode", cap), ("encode_recomputing", plain)):
                dst = os.path.join(tmp, f"{text}-{name}.kvc")
                cpu, wall = _run([kvc, "encode", src, "-m", args.model, "--preset", args.preset, "-o", dst])
                out[name] = {"cpu_s": round(cpu, 2), "wall_s": round(wall, 2), "bytes": os.path.getsize(dst)}
            rows.append({"text": text, "tokens": int(c.num_tokens), "capture": {"cpu_s": round(c_cpu, 2), "wall_s": round(c_wall, 2)},
                         **out, "encode_over_capture_cpu": round(out["encode"]["cpu_s"] / c_cpu, 3)})
            r = rows[-1]
            print(f"{text:14s} {r['tokens']:5d} tok  capture {r['capture']['cpu_s']:6.1f} CPU-s  encode {r['encode']['cpu_s']:6.1f} "
                  f"({r['encode']['bytes']:,} B)  encode recomputing the scores {r['encode_recomputing']['cpu_s']:6.1f} "
                  f"({r['encode_recomputing']['bytes']:,} B)  encode/capture {r['encode_over_capture_cpu']:.2f}", flush=True)
    run.emit({"model": args.model, "preset": args.preset, "rows": rows})


if __name__ == "__main__":
    main()
