"""Run the benchmark cases (benchmarks/cases.py): all of them, or a named subset, full or ``--quick``.

    python benchmarks/run.py --list                    # the cases, by question
    python benchmarks/run.py                           # every case whose requirements are met (in_all)
    python benchmarks/run.py speed head_dims --quick   # two cases, small and fast
    python benchmarks/run.py decode                    # every case of a question
    python benchmarks/run.py ttft --dry-run            # print the commands only

Each case runs in its own process (numba's target and thread count are fixed at import, and a
case's memory and JIT state should not leak into the next), as
``python benchmarks/<script> <args> --case <case> --result <json>``, with one torch/numba thread
unless ``OMP_NUM_THREADS`` / ``NUMBA_NUM_THREADS`` are set. Per case it writes, under ``--out``
(default ``benchmarks/results``):

* ``<case>/<machine-id>.json``: the result document (benchmarks/harness.py), checked against the schema;
* ``<case>/<machine-id>.txt`` and ``.log``: the script's stdout and stderr;
* ``<case>/<machine-id>/``: side files of the cases that write some (the curve's plots and tables).

``--quick`` runs write ``<machine-id>-quick.*`` instead, so they never replace a full run's files.
A case whose requirements are missing (llama.cpp, vLLM, a GPU, ...) is skipped with the reason.
The exit status is 0 when every case that ran succeeded and wrote a conforming document.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import harness
from cases import CASES, QUESTIONS, Case


def select(names: list[str]) -> list[Case]:
    """Cases by name, or every case of a question key (a name that is a case is the case), in table order;
    no names: every case marked in_all."""
    if not names:
        return [c for c in CASES.values() if c.in_all]
    unknown = [n for n in names if n not in CASES and n not in QUESTIONS]
    if unknown:
        raise SystemExit(f"unknown case or question: {', '.join(unknown)} (python benchmarks/run.py --list)")
    questions = {n for n in names if n not in CASES}
    return [c for c in CASES.values() if c.name in names or c.question in questions]


def list_cases() -> str:
    lines = []
    for q, (title, anchor) in QUESTIONS.items():
        lines.append(f"{q}: {title}  [BENCHMARKS.md#{anchor}]")
        for c in (c for c in CASES.values() if c.question == q):
            flags = [] if c.in_all else ["only by name"]
            if c.needs:
                flags.append("needs " + ", ".join(c.needs))
            lines.append(f"  {c.name:16s} {c.script:26s} {c.summary}" + (f"  ({'; '.join(flags)})" if flags else ""))
    return "\n".join(lines)


def command(c: Case, quick: bool, result: Path, out_dir: Path) -> list[str]:
    py = str(harness.REPO / c.python) if c.python else sys.executable
    args = [a.replace("{out}", str(out_dir)) for a in c.always]
    args += ["--quick"] if quick else list(c.args)
    return [py, str(harness.ROOT / c.script), *args, "--case", c.name, "--result", str(result)]


def run_case(c: Case, quick: bool, out: Path, mid: str, timeout: float | None, dry: bool) -> tuple[str, str]:
    """(status, detail) of one case: ok, failed, skipped."""
    why = c.missing()
    if why:
        return "skipped", why
    stem = f"{mid}-quick" if quick else mid
    case_dir = out / c.name
    result = case_dir / f"{stem}.json"
    cmd = command(c, quick, result, case_dir / stem)
    if dry:
        print(" ".join(cmd))
        return "dry-run", ""
    case_dir.mkdir(parents=True, exist_ok=True)
    result.unlink(missing_ok=True)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    print(f"== {c.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    t0 = time.time()
    with open(case_dir / f"{stem}.txt", "w") as so, open(case_dir / f"{stem}.log", "w") as se:
        try:
            rc = subprocess.run(cmd, stdout=so, stderr=se, env=env, cwd=harness.REPO, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            return "failed", f"timed out after {timeout:.0f} s (log: {case_dir / (stem + '.log')})"
    took = f"{time.time() - t0:.0f} s"
    if rc != 0:
        return "failed", f"exit status {rc} after {took} (log: {case_dir / (stem + '.log')})"
    try:
        doc = json.loads(result.read_text())
    except (OSError, ValueError) as e:
        return "failed", f"no result document ({e})"
    bad = harness.validate(doc)
    if doc.get("case") != c.name:
        bad.append(f"case {doc.get('case')!r}, expected {c.name!r}")
    if doc.get("quick") is not quick:
        bad.append(f"quick {doc.get('quick')!r}, expected {quick}")
    if bad:
        return "failed", "result does not conform: " + "; ".join(bad)
    return "ok", f"{took}: {result}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="cases or questions (default: every case marked in_all)")
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--quick", action="store_true", help="each case's quick settings (seconds to minutes)")
    ap.add_argument("--out", type=Path, default=harness.RESULTS, help="results root [benchmarks/results]")
    ap.add_argument("--timeout", type=float, default=None, help="seconds per case (default: none)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    a = ap.parse_args(argv)
    if a.list:
        print(list_cases())
        return 0
    cases = select(a.names)
    mid = harness.machine_id()
    if not a.dry_run:
        print(f"machine {mid}; {len(cases)} case(s){' (quick)' if a.quick else ''} -> {a.out}", file=sys.stderr)
    report = [(c.name, *run_case(c, a.quick, a.out.resolve(), mid, a.timeout, a.dry_run)) for c in cases]
    if a.dry_run:
        return 0
    for name, status, detail in report:
        print(f"{name:16s} {status:8s} {detail}")
    return 1 if any(s == "failed" for _, s, _ in report) else 0


if __name__ == "__main__":
    sys.exit(main())
