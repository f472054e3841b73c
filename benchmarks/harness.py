"""The benchmarks' one harness: timing, the machine, the result document and the shared arguments.

Every ``bench_*.py`` script in this folder is a *case* of this harness, registered in
:data:`cases.CASES` (the one table). A script stays runnable by itself with its own flags;
the harness adds three:

``--quick``
    a small, fast run: the case's quick settings (``cases.py``) become the argument
    defaults, and flags given on the command line still win;
``--result JSON``
    write the run's result document (below) to this file;
``--case NAME``
    (hidden) which registered case this run is, when one script serves several
    (``bench_speed.py`` is ``speed``, ``speed_model`` and ``speed_avx2``).

A script builds its ``argparse`` parser, calls :func:`cli`, measures, and hands its
results to :meth:`Run.emit`. ``benchmarks/run.py`` runs cases in subprocesses and files
their documents under ``benchmarks/results/<case>/<machine-id>.json``.

The result document (:data:`SCHEMA`), one JSON object::

    {"schema": "kvcodec-bench/1", "case": "speed", "quick": false,
     "params":  {...every argument of the script...},
     "machine": {...machine(): CPU, SIMD flags, cores, memory, GPU, versions, git commit...},
     "date": "2026-11-24T10:00:00Z", "wall_s": 12.3, "load": {"start": 1.0, "end": 1.1},
     "command": "NUMBA_NUM_THREADS=1 python benchmarks/bench_speed.py --tokens 2048",
     "results": ...the script's measurements (any JSON)...}

Timing: :func:`timeit` (warm-up calls, then repeats; min / median / max, and the CPU time
of the same runs, process or thread) and :func:`stopwatch` (one interval, wall and CPU).
Which statistic a script reports is the script's choice and is said in its docstring (best
of N where the least-disturbed run is wanted on a shared machine, median where a typical
call is).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

ROOT = Path(__file__).resolve().parent  #: benchmarks/
REPO = ROOT.parent
RESULTS = ROOT / "results"
SCHEMA = "kvcodec-bench/1"
#: keys every result document has, and their JSON types
DOC_KEYS: dict[str, type | tuple[type, ...]] = {
    "schema": str, "case": str, "quick": bool, "params": dict, "machine": dict, "date": str,
    "wall_s": (int, float), "load": dict, "command": str, "results": (dict, list),
}
#: keys every ``machine`` entry has
MACHINE_KEYS = ("id", "cpu", "simd", "simd_level", "cpus", "cpus_usable", "memory_gib", "gpu", "os", "python",
                "versions", "git", "threads")
_HARNESS_DESTS = ("quick", "result", "case")

# ----------------------------------------------------------------------------------------------- timing


@dataclass
class Timing:
    """Wall seconds of each timed run (and their CPU seconds, when measured), and the last call's value."""

    wall: list[float]
    cpu: list[float] | None = None
    value: Any = field(default=None, repr=False)

    @property
    def min(self) -> float:
        return min(self.wall)

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def max(self) -> float:
        return max(self.wall)

    @property
    def cpu_min(self) -> float | None:
        return min(self.cpu) if self.cpu else None

    @property
    def cpu_median(self) -> float | None:
        return statistics.median(self.cpu) if self.cpu else None

    def as_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"repeat": len(self.wall), "min_s": self.min, "median_s": self.median, "max_s": self.max,
                             "runs_s": list(self.wall)}
        if self.cpu:
            d.update(cpu_min_s=self.cpu_min, cpu_median_s=self.cpu_median, cpu_runs_s=list(self.cpu))
        return d


_CPU_CLOCKS: dict[str | None, Callable[[], float] | None] = {
    "process": time.process_time, "thread": time.thread_time, None: None}


def timeit(fn: Callable[[], Any], repeat: int = 3, *, warmup: int = 0, cpu: str | None = "process") -> Timing:
    """Call ``fn`` ``warmup`` times untimed, then ``repeat`` times timed (wall clock, and ``cpu``:
    ``"process"`` CPU time of all threads, ``"thread"`` this thread's, or None).

    The CPU time is what a quiet core would roughly take: on a shared machine the wall time also
    contains the time spent waiting for a core (it still suffers shared caches and memory bandwidth).
    """
    if repeat < 1:
        raise ValueError("repeat must be at least 1")
    for _ in range(warmup):
        fn()
    clock = _CPU_CLOCKS[cpu]
    wall: list[float] = []
    cpus: list[float] = []
    out = None
    for _ in range(repeat):
        c0 = clock() if clock else 0.0
        t0 = time.perf_counter()
        out = fn()
        wall.append(time.perf_counter() - t0)
        if clock:
            cpus.append(clock() - c0)
    return Timing(wall, cpus if clock else None, out)


class stopwatch:
    """One interval, wall and CPU: ``with stopwatch() as sw: ...`` then ``sw.wall``, ``sw.cpu`` (seconds).

    While running, ``sw.elapsed()`` gives the wall seconds so far.
    """

    def __init__(self, cpu: str | None = "process") -> None:
        self._clock = _CPU_CLOCKS[cpu]
        self.wall = math.nan
        self.cpu: float | None = None

    def __enter__(self) -> "stopwatch":
        self._c0 = self._clock() if self._clock else 0.0
        self._t0 = time.perf_counter()
        return self

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        self.cpu = (self._clock() - self._c0) if self._clock else None


# ----------------------------------------------------------------------------------------------- the machine

#: CPU flags worth recording (x86 /proc/cpuinfo names; aarch64's "Features" are kept as they come)
SIMD_FLAGS = ("sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
              "avx512_vbmi2", "avx512_vnni", "avx512_bf16", "amx_tile", "sha_ni", "asimd", "sve", "sve2")


def _cpuinfo() -> dict[str, str]:
    """The first processor block of /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    out: dict[str, str] = {}
    for line in text.split("\n\n")[0].splitlines():
        k, _, v = line.partition(":")
        out.setdefault(k.strip(), v.strip())
    return out


def simd_level(flags: Sequence[str]) -> str:
    f = set(flags)
    for level, need in (("avx512", "avx512f"), ("avx2", "avx2"), ("avx", "avx"), ("sve", "sve"), ("neon", "asimd"),
                        ("sse4.2", "sse4_2")):
        if need in f:
            return level
    return "unknown"


def _gpu() -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    names = [x.strip() for x in out.stdout.splitlines() if x.strip()]
    return ", ".join(names) or None


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("kvcodec", "torch", "numpy", "numba", "transformers", "triton"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def _git() -> dict[str, Any]:
    def git(*a: str) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None

    status = git("status", "--porcelain", "--untracked-files=no")
    return {"commit": git("rev-parse", "HEAD"), "dirty": None if status is None else bool(status)}


def _memory_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return None


def machine() -> dict[str, Any]:
    """What the numbers were measured on: CPU (model, family/model numbers, SIMD flags), cores,
    memory, GPU, OS, Python and library versions, the git commit, and the thread settings.

    Cheap: it imports nothing heavy (torch's thread count is read only if torch is already imported).
    """
    info = _cpuinfo()
    flags = (info.get("flags") or info.get("Features") or "").split()
    simd = [f for f in SIMD_FLAGS if f in flags]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    threads: dict[str, Any] = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS", "MKL_NUM_THREADS")}
    if "torch" in sys.modules:
        threads["torch"] = sys.modules["torch"].get_num_threads()
    m = {
        "cpu": info.get("model name") or platform.processor() or platform.machine(),
        "cpu_family": info.get("cpu family"), "cpu_model": info.get("model"), "arch": platform.machine(),
        "simd": simd, "simd_level": simd_level(flags),
        "cpus": os.cpu_count(), "cpus_usable": usable, "memory_gib": _memory_gib(), "gpu": _gpu(),
        "os": platform.platform(), "python": platform.python_version(), "versions": _versions(), "git": _git(),
        "threads": threads,
    }
    m["id"] = machine_id(m)
    return {"id": m.pop("id"), **m}


def _slug(s: str) -> str:
    s = re.sub(r"\((r|tm)\)|processor|cpu|@", " ", s.lower())
    return re.sub(r"[^a-z0-9.]+", "-", s).strip("-.") or "unknown"


def machine_id(m: dict[str, Any] | None = None) -> str:
    """A stable file name for a machine: CPU model, family/model numbers, SIMD level, logical CPUs, GPU.

    E.g. ``amd-epyc-f25m17-avx512-2cpu`` or ``intel-xeon-2.00ghz-f6m85-avx512-2cpu-nvidia-h100``.
    """
    m = m or machine()
    parts = [_slug(m["cpu"])]
    if m.get("cpu_family") and m.get("cpu_model"):
        parts.append(f"f{m['cpu_family']}m{m['cpu_model']}")
    parts += [m["simd_level"], f"{m['cpus']}cpu"]
    if m.get("gpu"):
        parts.append(_slug(m["gpu"].split(",")[0]))
    return "-".join(p for p in parts if p)


# ----------------------------------------------------------------------------------------------- documents


def jsonable(x: Any) -> Any:
    """``json.dumps`` default: numpy scalars and arrays, paths, tuples/sets, bytes (their length)."""
    if hasattr(x, "tolist"):  # numpy arrays and scalars, torch tensors
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    if isinstance(x, (set, frozenset)):
        return sorted(x)
    if isinstance(x, (bytes, bytearray, memoryview)):
        return {"bytes": len(x)}
    return str(x)


def validate(doc: Any) -> list[str]:
    """Problems of a result document against :data:`SCHEMA` (empty: it conforms)."""
    if not isinstance(doc, dict):
        return ["the document is not a JSON object"]
    bad = [f"missing key {k!r}" for k in DOC_KEYS if k not in doc]
    bad += [f"{k!r} is {type(doc[k]).__name__}, not {t}" for k, t in DOC_KEYS.items()
            if k in doc and (not isinstance(doc[k], t) or (t is not bool and isinstance(doc[k], bool)))]
    if doc.get("schema") not in (None, SCHEMA):
        bad.append(f"schema {doc.get('schema')!r}, not {SCHEMA!r}")
    if isinstance(doc.get("machine"), dict):
        bad += [f"machine lacks {k!r}" for k in MACHINE_KEYS if k not in doc["machine"]]
    if isinstance(doc.get("date"), str):
        try:
            _dt.datetime.strptime(doc["date"], "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            bad.append(f"date {doc['date']!r} is not ISO 8601 UTC (YYYY-MM-DDTHH:MM:SSZ)")
    if not doc.get("results"):
        bad.append("results are empty")
    return bad


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a temp file renamed over ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=jsonable, allow_nan=True) + "\n")
    os.replace(tmp, path)


def pin_threads(argv: Sequence[str], default: str = "1") -> str:
    """Size torch's, BLAS's and numba's pools from the script's ``--threads`` (else ``default``) and return it.

    Call before numpy or torch is imported: their pools size themselves at import, so an encode and the
    prefill it is compared with must run on the same number of threads from the start.
    """
    n = default
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            n = argv[i + 1]
        elif a.startswith("--threads="):
            n = a.split("=", 1)[1]
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMBA_NUM_THREADS"):
        os.environ[var] = n
    return n


def command_line(argv: Sequence[str] | None = None, script: str | None = None) -> str:
    """The command that reproduces this run: thread variables, ``python benchmarks/<script>`` and its arguments."""
    argv = list(sys.argv[1:] if argv is None else argv)
    script = script or Path(sys.argv[0]).name
    env = [f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS") if k in os.environ]
    return " ".join(env + ["python", f"benchmarks/{script}"] + [shlex.quote(a) for a in argv])


# ----------------------------------------------------------------------------------------------- arguments


def add_arguments(ap: argparse.ArgumentParser, case: str) -> None:
    """The harness's flags on a script's parser (``--quick`` only if the script has none of its own)."""
    g = ap.add_argument_group("benchmark harness (benchmarks/harness.py)")
    if "--quick" not in ap._option_string_actions:
        g.add_argument("--quick", action="store_true",
                       help="a small, fast run: the case's quick settings (benchmarks/cases.py) become the defaults")
    g.add_argument("--result", type=Path, default=None, metavar="JSON",
                   help="write the result document (benchmarks/harness.py) to this file")
    g.add_argument("--case", default=case, help=argparse.SUPPRESS)


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, a in enumerate(argv):
        if a == flag and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


@dataclass
class Run:
    """One run of a case: its parsed arguments, when it started, where its document goes."""

    case: str
    args: argparse.Namespace
    argv: list[str]
    script: str
    started: float = field(default_factory=time.time)
    load_start: float | None = field(default_factory=lambda: _loadavg())

    @property
    def quick(self) -> bool:
        return bool(getattr(self.args, "quick", False))

    def params(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self.args).items() if k not in _HARNESS_DESTS}

    def document(self, results: Any) -> dict[str, Any]:
        doc = {
            "schema": SCHEMA, "case": self.case, "quick": self.quick, "params": self.params(), "machine": machine(),
            "date": _dt.datetime.fromtimestamp(self.started, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "wall_s": round(time.time() - self.started, 3), "load": {"start": self.load_start, "end": _loadavg()},
            "command": command_line(self.argv, self.script), "results": results,
        }
        return json.loads(json.dumps(doc, default=jsonable))  # plain JSON types, as a reader will see them

    def emit(self, results: Any) -> dict[str, Any]:
        """The result document of this run; written to ``--result`` when given. Raises if it does not conform."""
        doc = self.document(results)
        bad = validate(doc)
        if bad:
            raise SystemExit(f"{self.script}: result document does not conform: {'; '.join(bad)}")
        if getattr(self.args, "result", None):
            write_json(self.args.result, doc)
        return doc


def _loadavg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def cli(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None, *, case: str) -> Run:
    """Parse a case script's arguments with the harness's flags added.

    With ``--quick``, the case's quick settings (``cases.CASES[case].quick``: argument destinations to
    values) are the defaults; flags on the command line still win.
    """
    from cases import CASES

    argv = list(sys.argv[1:] if argv is None else argv)
    add_arguments(ap, case)
    name = _flag_value(argv, "--case") or case
    if name not in CASES:
        ap.error(f"unknown case {name!r} (benchmarks/cases.py)")
    if "--quick" in argv:
        ap.set_defaults(**dict(CASES[name].quick))
    args = ap.parse_args(argv)
    args.case = name
    return Run(name, args, argv, CASES[name].script)
