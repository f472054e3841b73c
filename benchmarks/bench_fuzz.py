"""Structure-aware fuzzing of the .kvc reader (the engine is kvcodec.testing.fuzz; see its --help).

    python benchmarks/bench_fuzz.py [--n 100000] [--workers 2] [--seed 1] [--tokens 24] [--seeds DIR] [--json OUT]

A thin wrapper: the flags are ``python kvcodec/testing/fuzz.py``'s (``--repro I`` and ``--make-seeds``
go to it unchanged), plus the harness's ``--quick`` / ``--result``; the run, its report and its exit
status (1 on a foreign exception, a crash, a run over 10 s or a worker over 512 MB) are the engine's.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

import harness
from kvcodec.testing import fuzz


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--repro" in argv or "--make-seeds" in argv:
        sys.argv = [fuzz.__file__, *argv]
        fuzz.main()
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeds", type=Path, default=None, help="seed directory (built if empty)")
    ap.add_argument("--json", type=Path, default=None)
    run = harness.cli(ap, argv, case="fuzz")
    a = run.args
    out = a.json or Path(tempfile.mkdtemp(prefix="kvc-bench-fuzz-")) / "fuzz.json"
    sys.argv = [fuzz.__file__, "--n", str(a.n), "--workers", str(a.workers), "--seed", str(a.seed),
                "--tokens", str(a.tokens), "--json", str(out)] + (["--seeds", str(a.seeds)] if a.seeds else [])
    try:
        fuzz.main()
        status = 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    if out.is_file():
        run.emit(json.loads(out.read_text()))
    sys.exit(status)


if __name__ == "__main__":
    main()
