"""Soak fuzz of the `.kvc` reader: structure-aware mutations with every checksum recomputed.

    python kvcodec/testing/fuzz.py [--n 100000] [--workers 2] [--seed 1] [--tokens 24] [--json OUT]
    python kvcodec/testing/fuzz.py --repro I [--seed 1]      # re-run mutation I in-process, with a traceback

Seed files are real caches of the embedded SmolLM2-135M (the first ``--tokens``
tokens of the GPL-3 text) written by kvcodec's own writer: every preset
(lossless, fp16, near-lossless, balanced, small), a bfloat16 lossless file,
an H2O-pruned file (per-head positions), chunked files (tokens and heads),
an embedded-calibration file and a file storing only the token-id hash.
They are built once by a child process (the model never enters the workers)
into ``--seeds DIR`` (default: a temp dir).

Each mutation (deterministic in ``--seed`` and its index) picks a seed file
and one of the operators below; CRC32Cs of the header, index, footer, blobs
and chunk records are recomputed afterwards, so the mutation reaches the
parsers and decoders instead of stopping at a checksum:

* header JSON: a value replaced by a hostile one (64.0, true, 2**64, -1,
  "\\ud800", 1e308, nested junk ...), a key deleted / duplicated / added, raw
  text bytes changed; preamble fields (versions, feature bits);
* index and footer fields set to edge values; chunk records re-laid out
  (offsets, lengths, alignment follow the new sizes);
* chunk records: head / stage sizes / side-array heads and elements (NaN,
  inf, huge, negative, dims, dtype codes, names), payload bytes, rANS stream
  fields (contexts, alphabet, counts, frequencies, states), zstd bombs and
  frames that lie about their content size, records spliced in from another
  seed (another pipeline);
* blobs (token ids, positions, calibration attachments) with their header CRC;
* for control, a few plain byte flips (CRC left wrong), truncations and
  extensions.

Every mutated file is opened, fully verified (every blob, attachment and
chunk decoded) and one random layer is read as tensors, in a pool of worker
processes (a segfault kills only its worker: it is counted as a crash and the
worker restarts after that mutation). Reported: outcomes, exceptions that are
not ``KvcError`` (must be 0), crashes (0), runs over 10 s of CPU time (0; a
run blocked without using CPU is caught by the ``HANG_S`` wall-clock watchdog
and counted as a crash; runs over 10 s of wall time are listed too, since on a
shared machine wall time measures the neighbours) and the workers' peak RSS
(must stay <= 512 MB).

This module is the runner (seeds, worker processes, the watchdog, the report and the command line); the
mutations are :mod:`kvcodec.testing.mutations` and the file surgery they use :mod:`kvcodec.testing.surgery`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import subprocess
import sys
import tempfile
import time
import traceback
from collections import Counter
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from kvcodec.testing.mutations import mutate
from kvcodec.testing.surgery import Parts

SLOW_S = 10.0  # a run over this is reported
HANG_S = 120.0  # a worker silent for this long is killed (counted as a crash and as slow)
BATCH = 100


# --------------------------------------------------------------------------- seeds
def make_seeds(out: Path, tokens: int, lm: Any = None) -> None:
    """Write the seed files (needs the embedded model: ``lm``, else loaded here -- the benchmark runs this in a
    child process so the model never enters the fuzzing processes)."""
    import numpy as np
    import torch

    from kvcodec.models.capture import capture, tokenize
    from kvcodec.format import write_kvc
    from kvcodec.api import make_plan
    from kvcodec.models.load import load_model
    from kvcodec.prune import apply_prune
    from kvcodec.texts import load_text

    out.mkdir(parents=True, exist_ok=True)
    lm = lm or load_model("smollm2")
    ids = tokenize(lm.tokenizer, load_text("gpl3"))[:tokens]
    cache = capture(lm, token_ids=ids)

    def put(name: str, c: Any, preset: str, **kw: Any) -> None:
        plan = make_plan(c, preset, model=lm, overrides=kw.pop("plan", {}))
        write_kvc(c, out / f"{name}.kvc", plan,
                  meta=c.meta, **kw)
        print(f"seed {name}: {(out / f'{name}.kvc').stat().st_size} bytes", file=sys.stderr)

    for preset in ("lossless", "fp16", "near-lossless", "balanced", "small"):
        put(preset, cache, preset)
    put("bf16-lossless", cache.to(torch.bfloat16), "lossless")
    put("lossless-chunked", cache, "lossless", chunk_tokens=8, chunk_heads=2)
    put("balanced-chunked", cache, "balanced", chunk_tokens=10, chunk_heads=1)
    put("balanced-embedded", cache, "balanced", plan={"calibration": "embedded"})
    put("lossless-idhash", cache, "lossless", store_token_ids=False)
    pruned = apply_prune(cache, "h2o:0.5", lm=lm)
    put("balanced-pruned", pruned, "balanced")
    put("lossless-pruned", pruned, "lossless")
    np.save(out / "ids.npy", np.asarray(ids, np.int64), allow_pickle=False)



def consume(data: bytes, resolver: Any, rng: random.Random, chunks: list[int] | None = None) -> str:
    """What a consumer does with a file: open (the whole structure is validated), then verify everything
    (``chunks`` None: every padding byte, blob, attachment and chunk decoded, and one layer read as tensors)
    or read the blobs and decode the given chunks."""
    from kvcodec.errors import KvcError, KvcFormatError
    from kvcodec.format import KvcReader

    try:
        with KvcReader(data, attachment_resolver=resolver) as r:
            if chunks is None:
                r.verify(strict=True, backend="cpu")
                r.read_layer(rng.randrange(r.num_layers), backend="cpu")
            else:
                _ = (r.token_ids, r.positions, r.attachments)  # each property parses and checks its blob
                for a, b in r._gaps():  # padding bytes, as verify() checks them
                    if any(bytes(r._src.read(a, b - a))):
                        raise KvcFormatError(f"non-zero padding in bytes [{a}, {b})")
                for j in chunks:
                    if j < r.num_chunks:
                        r.read_chunk(j, backend="cpu")
        return "ok"
    except KvcError as exc:
        return "kvc:" + type(exc).__name__


def _load_seeds(d: Path) -> list[tuple[str, bytes]]:
    return [(p.stem, p.read_bytes()) for p in sorted(d.glob("*.kvc"))]


def _resolver(seeds: list[tuple[str, bytes]]) -> dict[str, Any]:
    """name -> array of the external calibration attachments the seeds reference (resolved once, as a mapping)."""
    from kvcodec.format import KvcReader
    from kvcodec.calibration.store import default_resolver as attachment_resolver

    out: dict[str, Any] = {}
    for _, data in seeds:
        with KvcReader(data) as r:
            for name, a in r.header.attachments.items():
                if a.blob is None and a.sha256 not in out:
                    arr = attachment_resolver(name, a)
                    if arr is not None:
                        out[a.sha256] = arr
    return out


def _peak_rss_kb() -> int:
    """This process's peak RSS (kB): VmHWM, the high-water mark of its own address space. Not ru_maxrss:
    Linux carries that across fork + exec, so a worker spawned by a big parent (pytest with the model
    loaded) would report the parent's peak."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _worker(conn: Any, seeds_dir: str, seed: int) -> None:

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    seeds = _load_seeds(Path(seeds_dir))
    parsed = [Parts(d) for _, d in seeds]
    resolver = _resolver(seeds)
    conn.send(("ready", _peak_rss_kb()))
    while True:
        task = conn.recv()
        if task is None:
            return
        lo, hi = task
        for i in range(lo, hi):
            name, op, data, chunks = mutate(i, seed, seeds, parsed)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                out = consume(data, resolver, random.Random(i), chunks)
                detail = ""
            except Exception as exc:  # noqa: BLE001 - the point: anything that is not a KvcError
                out = "other:" + type(exc).__name__
                detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()[:300]
            dt, cpu = time.perf_counter() - t0, time.process_time() - c0
            conn.send((i, name, op, out, dt, cpu, detail, _peak_rss_kb()))


# --------------------------------------------------------------------------- the pool
class _Slot:
    def __init__(self, ctx: Any, seeds_dir: str, seed: int) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker, args=(child, seeds_dir, seed), daemon=True)
        self.proc.start()
        child.close()
        self.task: tuple[int, int] | None = None
        self.next = 0
        self.since = time.monotonic()
        self.ready = False
        self.rss = 0


def run(seeds_dir: Path, n: int, workers: int, seed: int, progress: bool = True, checkpoint: Path | None = None) -> dict[str, Any]:
    """Run mutations 0..n-1 over the seeds in ``seeds_dir``; the summary dict (also written to
    ``checkpoint`` every 30 s while running, with ``"complete": false``)."""
    ctx = mp.get_context("spawn")
    pending = [(lo, min(n, lo + BATCH)) for lo in range(0, n, BATCH)]
    pending.reverse()
    slots = [_Slot(ctx, str(seeds_dir), seed) for _ in range(min(workers, max(1, len(pending))))]
    outcomes: Counter = Counter()
    by_op: dict[str, Counter] = {}
    by_seed: Counter = Counter()
    foreign: list[dict[str, Any]] = []
    crashes: list[dict[str, Any]] = []
    slow: list[dict[str, Any]] = []
    jumps: list[dict[str, Any]] = []
    slow_wall: list[dict[str, Any]] = []
    peak_kb = base_kb = 0
    done = 0
    t_start = time.monotonic()
    last_print = t_start

    def summary() -> dict[str, Any]:
        return dict(_summary(done, seed, workers, time.monotonic() - t_start, by_seed, outcomes, by_op, foreign, crashes,
                             slow, peak_kb, base_kb), rss_jumps=jumps[:20], over_10s_wall=len(slow_wall),
                    over_10s_wall_examples=slow_wall[:20])

    def assign(s: _Slot) -> None:
        if pending:
            s.task = pending.pop()
            s.next = s.task[0]
            s.since = time.monotonic()
            s.conn.send(s.task)
        else:
            s.task = None

    def restart(s: _Slot, why: str) -> _Slot:
        nonlocal done
        assert s.task is not None
        crashes.append({"mutation": s.next, "why": why})
        outcomes["crash"] += 1
        done += 1
        if s.next + 1 < s.task[1]:
            pending.append((s.next + 1, s.task[1]))
        s.proc.kill()
        s.proc.join()
        return _Slot(ctx, str(seeds_dir), seed)

    while any(s.task is not None or not s.ready for s in slots) or pending:
        ready = wait([s.conn for s in slots], timeout=1.0)
        for i, s in enumerate(slots):
            if s.conn in ready:
                try:
                    msg = s.conn.recv()
                except (EOFError, OSError):
                    s.proc.join(timeout=5)
                    if s.task is None:
                        raise RuntimeError(f"fuzz worker died while starting (exit code {s.proc.exitcode})") from None
                    slots[i] = restart(s, f"worker died, exit code {s.proc.exitcode}")
                    continue
                if msg[0] == "ready":
                    s.ready = True
                    s.rss = msg[1]
                    base_kb = max(base_kb, msg[1])
                    assign(s)
                    continue
                idx, name, op, out, dt, cpu, detail, rss = msg
                done += 1
                peak_kb = max(peak_kb, rss)
                outcomes[out] += 1
                by_op.setdefault(op, Counter())[out.split(":")[0]] += 1
                by_seed[name] += 1
                if out.startswith("other:"):
                    foreign.append({"mutation": idx, "seed_file": name, "op": op, "error": detail})
                if rss - s.rss > 16 << 10:  # the peak RSS grew by > 16 MB during this one mutation
                    jumps.append({"mutation": idx, "seed_file": name, "op": op, "mb": round((rss - s.rss) / 1024, 1)})
                s.rss = max(s.rss, rss)
                if cpu > SLOW_S:
                    slow.append({"mutation": idx, "seed_file": name, "op": op, "cpu_s": round(cpu, 2), "wall_s": round(dt, 2)})
                if dt > SLOW_S:
                    slow_wall.append({"mutation": idx, "seed_file": name, "op": op, "cpu_s": round(cpu, 2), "wall_s": round(dt, 2)})
                s.next = idx + 1
                s.since = time.monotonic()
                if s.task is not None and s.next >= s.task[1]:
                    assign(s)
            elif s.ready and s.task is not None and time.monotonic() - s.since > HANG_S:
                slow.append({"mutation": s.next, "seconds": HANG_S, "op": "killed (hang)"})
                slots[i] = restart(s, f"no answer for {HANG_S:.0f} s")
        if progress and time.monotonic() - last_print > 30:
            last_print = time.monotonic()
            rate = done / max(1e-9, last_print - t_start)
            print(f"fuzz: {done}/{n} ({rate:.0f}/s) {dict(outcomes)} peak RSS {peak_kb / 1024:.0f} MB", file=sys.stderr, flush=True)
            if checkpoint is not None:
                checkpoint.write_text(json.dumps(dict(summary(), complete=False), indent=1) + "\n")
        if not pending and all(s.task is None for s in slots if s.ready) and all(s.ready for s in slots):
            break
    for s in slots:
        try:
            s.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        s.proc.join(timeout=10)
        if s.proc.is_alive():
            s.proc.kill()
    return dict(summary(), complete=True)


def _summary(done: int, seed: int, workers: int, wall: float, by_seed: Counter, outcomes: Counter, by_op: dict,
             foreign: list, crashes: list, slow: list, peak_kb: int, base_kb: int) -> dict[str, Any]:
    return {
        "mutations": done, "seed": seed, "workers": workers, "wall_s": round(wall, 1),
        "seed_files": dict(sorted(by_seed.items())),
        "outcomes": dict(sorted(outcomes.items())),
        "by_operator": {k: dict(v) for k, v in sorted(by_op.items())},
        "non_kvc_exceptions": len(foreign), "non_kvc_examples": foreign[:20],
        "crashes": len(crashes), "crash_examples": crashes[:20],
        "over_10s": len(slow), "slow_examples": slow[:20],
        "peak_rss_mb": round(peak_kb / 1024, 1), "worker_rss_after_import_mb": round(base_kb / 1024, 1),
    }


def ensure_seeds(seeds_dir: Path, tokens: int) -> None:
    if any(seeds_dir.glob("*.kvc")):
        return
    here = Path(__file__).resolve()
    subprocess.run([sys.executable, str(here), "--make-seeds", str(seeds_dir), "--tokens", str(tokens)], check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--seeds", type=Path, default=None, help="seed directory (built if empty)")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--make-seeds", type=Path, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--repro", type=int, default=None, help="re-run one mutation in-process, with its traceback")
    a = ap.parse_args()
    if a.make_seeds is not None:
        make_seeds(a.make_seeds, a.tokens)
        return
    seeds_dir = a.seeds or Path(tempfile.gettempdir()) / f"kvc-fuzz-seeds-{a.tokens}"
    ensure_seeds(seeds_dir, a.tokens)
    if a.repro is not None:
        seeds = _load_seeds(seeds_dir)
        name, op, data, chunks = mutate(a.repro, a.seed, seeds, [Parts(d) for _, d in seeds])
        print(f"mutation {a.repro}: seed file {name}, operator {op}, {len(data)} bytes, chunks {chunks}", file=sys.stderr)
        res = _resolver(seeds)
        consume(data, res, random.Random(a.repro), chunks)  # warm-up (numba, caches)
        t0, c0 = time.perf_counter(), time.process_time()
        out = consume(data, res, random.Random(a.repro), chunks)
        print(f"{out}  ({time.perf_counter() - t0:.2f} s wall, {time.process_time() - c0:.2f} s CPU)")
        return
    res = run(seeds_dir, a.n, a.workers, a.seed, checkpoint=a.json)
    text = json.dumps(res, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(text)
    ok = res["non_kvc_exceptions"] == 0 and res["crashes"] == 0 and res["over_10s"] == 0 and res["peak_rss_mb"] <= 512
    print(f"fuzz: {res['mutations']} mutations in {res['wall_s']} s: non-KvcError {res['non_kvc_exceptions']}, "
          f"crashes {res['crashes']}, over 10 s {res['over_10s']}, peak RSS {res['peak_rss_mb']} MB -> "
          f"{'PASS' if ok else 'FAIL'}", file=sys.stderr)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
