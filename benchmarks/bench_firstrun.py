"""The README's first command on a fresh machine, as a harness case: runs ``bench_firstrun.sh``.

    python benchmarks/bench_firstrun.py [PIP_CACHE_DIR]

The measurement itself is the shell script (a clean clone, an empty home, ``.ci/setup`` then
``kvc demo``, timed per phase; it needs no virtual environment, so it is what to run on a really
fresh machine: ``bash benchmarks/bench_firstrun.sh``). This wrapper passes its output through and
files the phase table (seconds) and the demo's output in the result document. Minutes, and the
package downloads are included: the runner runs it only by name (``run.py firstrun``).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys

import harness


def parse(out: str) -> dict:
    """The phase table rows (``| phase | seconds |``) and the closing load line of the script's output."""
    phases = {m.group(1).strip(): float(m.group(2)) for m in re.finditer(r"^\| (.+?) \| ([0-9.]+) \|$", out, re.M)}
    load = re.search(r"^\(load average at the end: ([^;]+); logs in (.+)\)$", out, re.M)
    demo = out.split("\n| phase | seconds |")[0].rstrip()
    return {"phases_s": phases, "load_average_end": load.group(1) if load else None,
            "logs": load.group(2) if load else None, "demo_output": demo}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pip_cache_dir", nargs="?", default=None, help="PIP_CACHE_DIR for pip's install of uv (optional)")
    run = harness.cli(ap, argv, case="firstrun")
    a = run.args
    cmd = ["bash", str(harness.ROOT / "bench_firstrun.sh")] + ([a.pip_cache_dir] if a.pip_cache_dir else [])
    p = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    sys.stdout.write(p.stdout)
    if p.returncode != 0:
        raise SystemExit(p.returncode)
    res = parse(p.stdout)
    if not res["phases_s"]:
        raise SystemExit("bench_firstrun.sh printed no phase table")
    run.emit(res)


if __name__ == "__main__":
    main()
