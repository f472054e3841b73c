"""Cold vs warm time-to-first-token of ``kvc ask`` answering from the store (issue 21).

``kvc ask`` runs in a fresh process every time, so its first `.kvc` load pays
whatever a process pays once: imports, loading (or compiling) the numba
decoder, resolving the calibration, torch's first forward pass. For each
context length this script

1. writes a document of about N real tokens and stores its `.kvc` (one
   ``KnowledgeBase.ask`` that prefills and deposits, preset ``--preset``);
2. **warm**: asks again in this process (``--repeats`` times after one
   warm-up; median of the TTFT that ``ask`` reports);
3. **cold**: runs ``python -m kvcodec ask --json`` in ``--repeats`` fresh
   processes (median of their reported TTFT, and of the process wall time from
   spawn to exit with ``--max-new-tokens 1``);
4. **first run**: one more fresh process with an empty numba cache directory
   (``NUMBA_CACHE_DIR``), i.e. what a process pays when the JIT cache was
   never built (``.ci/setup`` builds it);
5. ``--profile``: one cold process under cProfile, top functions of the
   ``ask`` call by cumulative time.

    python benchmarks/bench_coldstart.py --tokens 2048,4096 --repeats 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import harness
from common import long_ids
from kvcodec.runtime.knowledge import KnowledgeBase  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402

QUESTION = "What does this document say about warranties?"


def cold_ask(doc: Path, store: Path, preset: str, env: dict[str, str], profile: Path | None = None) -> tuple[float, float]:
    """(TTFT reported by ask, process wall time) of one fresh ``kvc ask`` process."""
    cmd = [sys.executable]
    if profile is not None:
        cmd += ["-m", "cProfile", "-o", str(profile)]
    cmd += ["-m", "kvcodec", "ask", "--doc", str(doc), "--store", str(store), "--preset", preset,
            "--max-new-tokens", "1", "--no-store", "--json", QUESTION]
    with harness.stopwatch(cpu=None) as sw:
        out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    wall = sw.wall
    if out.returncode != 0:
        raise SystemExit(f"kvc ask failed: {out.stderr.strip()}")
    ans = json.loads(out.stdout)
    if ans["source"] != "store":
        raise SystemExit(f"expected an answer from the store, got {ans['source']}")
    return ans["ttft_s"], wall


def profile_table(path: Path, n: int = 14) -> str:
    import io
    import pstats

    buf = io.StringIO()
    st = pstats.Stats(str(path), stream=buf)
    st.sort_stats("cumulative").print_stats(n)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="2048,4096")
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads in every process (0: torch's default)")
    ap.add_argument("--profile", action="store_true", help="also profile one cold process per length")
    ap.add_argument("--json", dest="json_out", default=None)
    run = harness.cli(ap, argv, case="coldstart")
    args = run.args
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()  # as the `kvc` command does (kvcodec/runtime/allocator.py): warm and cold processes tuned alike
    env = dict(os.environ)
    if args.threads:
        torch.set_num_threads(args.threads)
        env["OMP_NUM_THREADS"] = str(args.threads)
    lm = load_model()
    tmp = Path(tempfile.mkdtemp(prefix="kvc-cold-"))
    rows = []
    for n in [int(x) for x in args.tokens.split(",")]:
        doc = tmp / f"doc{n}.txt"
        doc.write_text(lm.tokenizer.decode(long_ids(lm.tokenizer, n)))
        store = tmp / f"store{n}"
        kb = KnowledgeBase(lm, str(store), preset=args.preset)
        first = kb.ask([doc.read_text()], QUESTION, max_new_tokens=1)
        warm = [kb.ask([doc.read_text()], QUESTION, max_new_tokens=1, store_new=False) for _ in range(args.repeats + 1)][1:]
        assert all(a.source == "store" for a in warm)
        cold = [cold_ask(doc, store, args.preset, env) for _ in range(args.repeats)]
        nocache = cold_ask(doc, store, args.preset, dict(env, NUMBA_CACHE_DIR=str(tmp / f"numba{n}")))
        row = {
            "tokens": first.context_tokens, "kvc_bytes": first.stored["bytes"] if first.stored else None,
            "prefill_ttft_s": first.ttft_s,
            "warm_ttft_s": statistics.median(a.ttft_s for a in warm),
            "cold_ttft_s": statistics.median(c[0] for c in cold),
            "cold_process_s": statistics.median(c[1] for c in cold),
            "no_jit_cache_ttft_s": nocache[0], "no_jit_cache_process_s": nocache[1],
        }
        row["cold_over_warm"] = row["cold_ttft_s"] / row["warm_ttft_s"]
        if args.profile:
            prof = tmp / f"cold{n}.prof"
            cold_ask(doc, store, args.preset, env, profile=prof)
            row["profile"] = profile_table(prof)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), file=sys.stderr, flush=True)

    print(f"\nkvc ask from the store, preset {args.preset}, torch threads {torch.get_num_threads()}, "
          f"median of {args.repeats}, load average {os.getloadavg()[0]:.1f}\n")
    print("| tokens | .kvc bytes | prefill TTFT s | warm TTFT s | cold TTFT s | cold / warm | cold process s | no JIT cache: TTFT s / process s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['kvc_bytes']:,} | {r['prefill_ttft_s']:.3f} | {r['warm_ttft_s']:.3f} | {r['cold_ttft_s']:.3f} | "
              f"{r['cold_over_warm']:.2f}x | {r['cold_process_s']:.2f} | {r['no_jit_cache_ttft_s']:.2f} / {r['no_jit_cache_process_s']:.2f} |")
    for r in rows:
        if "profile" in r:
            print(f"\ncold process profile, {r['tokens']} tokens:\n{r['profile']}")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"rows": rows, "torch_threads": torch.get_num_threads()}, indent=2))
    run.emit({"rows": rows, "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
