"""The benchmark runner and harness (benchmarks/run.py, harness.py, cases.py) work and cannot rot.

Runs ``benchmarks/run.py --list`` and one cheap case (``entropy --quick``: no model, about two seconds)
in subprocesses, as a user would, and checks the result document against the schema written out here
(not imported from benchmarks/: the test pins the schema, so a change to it must change this file too).
Every ``bench_*.py`` script must be a registered case.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"

#: the result document's keys and types (benchmarks/harness.py DOC_KEYS)
DOC = {"schema": str, "case": str, "quick": bool, "params": dict, "machine": dict, "date": str, "wall_s": (int, float),
       "load": dict, "command": str, "results": (dict, list)}
MACHINE = {"id": str, "cpu": str, "simd": list, "simd_level": str, "cpus": int, "cpus_usable": int, "os": str, "python": str,
           "versions": dict, "git": dict, "threads": dict}


def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def problems(doc: object) -> list[str]:
    if not isinstance(doc, dict):
        return ["not an object"]
    bad = [f"{k}: missing or not {t}" for k, t in DOC.items() if not isinstance(doc.get(k), t)]
    bad += [f"machine.{k}: missing or not {t}" for k, t in MACHINE.items() if not isinstance(doc.get("machine", {}).get(k), t)]
    if doc.get("schema") != "kvcodec-bench/1":
        bad.append(f"schema {doc.get('schema')!r}")
    try:
        datetime.datetime.strptime(doc.get("date", ""), "%Y-%m-%dT%H:%M:%SZ")
    except ValueError:
        bad.append(f"date {doc.get('date')!r}")
    if not doc.get("results"):
        bad.append("no results")
    return bad


def test_list_names_every_script_and_every_script_exists():
    r = run(str(BENCH / "run.py"), "--list")
    assert r.returncode == 0, r.stderr
    listed = {line.split()[1] for line in r.stdout.splitlines() if line.startswith("  ")}
    scripts = {p.name for p in BENCH.glob("bench_*.py")} | {"kdn_scale_model.py"}
    assert scripts - listed == set(), f"scripts that are no case of benchmarks/cases.py: {sorted(scripts - listed)}"
    assert {s for s in listed if not (BENCH / s).is_file()} == set()
    for q in ("compression", "decode", "encode", "ttft", "storage", "kdn", "models", "robustness"):
        assert any(line.startswith(q + ":") for line in r.stdout.splitlines()), q


def test_an_unknown_case_fails():
    r = run(str(BENCH / "run.py"), "no-such-case", "--dry-run")
    assert r.returncode != 0 and "unknown case" in r.stderr


def test_quick_case_through_the_runner_writes_a_conforming_document(tmp_path):
    r = run(str(BENCH / "run.py"), "entropy", "--quick", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    docs = list((tmp_path / "entropy").glob("*-quick.json"))
    assert len(docs) == 1, list((tmp_path / "entropy").iterdir())
    doc = json.loads(docs[0].read_text())
    assert problems(doc) == []
    assert docs[0].name == f"{doc['machine']['id']}-quick.json"
    assert doc["case"] == "entropy" and doc["quick"] is True
    assert "python benchmarks/bench_entropy.py" in doc["command"] and "--quick" in doc["command"]
    assert doc["params"]["contexts"] == 8 and doc["params"]["symbols"] == 4096  # the case's quick settings
    assert "result" not in doc["params"] and "quick" not in doc["params"]
    (res,) = doc["results"]
    assert res["symbols"] == 8 * 4096 and {row["coder"] for row in res["rows"]} >= {"kvcodec rans v1"}
    for t in res["ours_timings"].values():  # harness.timeit's statistics
        assert t["repeat"] == len(t["runs_s"]) == 2
        assert 0 < t["min_s"] <= t["median_s"] <= t["max_s"] and math.isclose(t["min_s"], min(t["runs_s"]))
        assert 0 <= t["cpu_min_s"] <= t["cpu_median_s"]
    assert "kvcodec rans v1" in (docs[0].with_suffix(".txt")).read_text()  # the script's own report, kept


def test_a_flag_beats_the_quick_default_when_run_alone(tmp_path):
    out = tmp_path / "e.json"
    r = run(str(BENCH / "bench_entropy.py"), "--quick", "--contexts", "4", "--result", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert problems(doc) == []
    assert doc["params"]["contexts"] == 4 and doc["params"]["symbols"] == 4096 and doc["results"][0]["contexts"] == 4
