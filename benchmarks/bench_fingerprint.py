"""Cost of the v2 model fingerprint on the embedded model: first time vs cached, per GB of weights.

    python benchmarks/bench_fingerprint.py [--model smollm2] [--repeats 3] [--json out.json]

Measured in one run, in one process, against a private cache dir (so the first
computation really is the first):

* weights digest, first time (``weights_sha256(use_cache=False)``: every
  tensor streamed through sha256), next to a plain ``hashlib.file_digest`` of the
  same files (the floor: raw sha256 of the bytes) — their ratio is the cost of
  hashing tensor by tensor in canonical order;
* weights digest, cached: from the HMAC'd entry on disk (a fresh process's
  path: stat + MAC check) and from the in-process memo;
* tokenizer digest, first time and cached;
* ``fingerprint_dir`` first time / cached, next to loading the model with
  transformers (what every fingerprint computation accompanies).

The page cache is warm for every timed run (one untimed read first): the
numbers are CPU cost, not disk. Peak RSS growth of the first digest shows the
memory bound (one 4 MiB buffer, not the model).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import harness


def _times(fn: Callable[[], Any], repeats: int) -> harness.Timing:
    """Wall and process-CPU seconds of ``repeats`` runs (harness.timeit; this script reports medians)."""
    return harness.timeit(fn, repeats, cpu="process")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", dest="json_path", default=None)
    run = harness.cli(ap, argv, case="fingerprint")
    a = run.args

    from kvcodec.models.load import resolve_model_dir

    model_dir = resolve_model_dir(a.model)  # before KVCODEC_CACHE moves: the converted model stays where it is
    os.environ["KVCODEC_CACHE"] = tempfile.mkdtemp(prefix="kvc-bench-fp-")
    from kvcodec.models import fingerprint as F

    files = F.weight_files(model_dir.resolve())
    file_bytes = sum(p.stat().st_size for p in files)
    gb = file_bytes / 1e9
    for p in files:  # warm the page cache (untimed)
        with open(p, "rb") as f:
            while f.read(1 << 20):
                pass

    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    first_digest = F.weights_sha256(model_dir, use_cache=False)
    rss_growth_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0) / 1024

    def raw() -> None:
        for p in files:
            with open(p, "rb") as f:
                hashlib.file_digest(f, "sha256")

    t_raw = _times(raw, a.repeats)
    t_first = _times(lambda: F.weights_sha256(model_dir, use_cache=False), a.repeats)
    F.weights_sha256(model_dir)  # writes the cache entry

    def from_disk() -> None:
        F._memo.clear()
        assert F.weights_sha256(model_dir) == first_digest

    t_disk = _times(from_disk, max(a.repeats, 20))
    t_memo = _times(lambda: F.weights_sha256(model_dir), max(a.repeats, 20))

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    t_tok_first = _times(lambda: F.tokenizer_sha256(tok), a.repeats)

    def fp_first() -> None:
        F._memo.clear()
        for p in (Path(os.environ["KVCODEC_CACHE"]) / "fingerprints").glob("*.json"):
            p.unlink()
        F.fingerprint_dir(model_dir, tok)

    t_fp_first = _times(fp_first, a.repeats)

    def fp_cached() -> None:
        F._memo.clear()
        F.fingerprint_dir(model_dir)  # no tokenizer handed in: a fresh process's path on a cache hit

    t_fp_cached = _times(fp_cached, max(a.repeats, 10))
    t_load = _times(lambda: AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, use_safetensors=True),
                    a.repeats)

    cpu_first, cpu_raw = t_first.cpu_median, t_raw.cpu_median
    r = {
        "model": a.model, "weight_files": len(files), "weight_bytes": file_bytes, "repeats": a.repeats,
        "weights_first_s": t_first.median, "raw_sha256_s": t_raw.median,
        "weights_first_s_per_gb": t_first.median / gb, "raw_sha256_s_per_gb": t_raw.median / gb,
        "weights_first_cpu_s": cpu_first, "raw_sha256_cpu_s": cpu_raw, "weights_first_cpu_s_per_gb": cpu_first / gb,
        "tokenizer_first_cpu_s": t_tok_first.cpu_median, "model_load_cpu_s": t_load.cpu_median,
        "weights_cached_disk_ms": t_disk.median * 1e3, "weights_cached_memo_ms": t_memo.median * 1e3,
        "tokenizer_first_s": t_tok_first.median, "fingerprint_first_s": t_fp_first.median,
        "fingerprint_cached_ms": t_fp_cached.median * 1e3, "model_load_s": t_load.median,
        "first_hash_rss_growth_mb": rss_growth_mb, "load_average": os.getloadavg()[0],
    }
    print(f"model {a.model}: {len(files)} safetensors file(s), {file_bytes:,} bytes ({gb:.3f} GB); median of {a.repeats}, "
          f"warm page cache, load average {r['load_average']:.1f}")
    print(f"weights digest, first time   {r['weights_first_s']:7.3f} s  = {r['weights_first_s_per_gb']:.2f} s/GB "
          f"(raw sha256 of the files {r['raw_sha256_s']:.3f} s = {r['raw_sha256_s_per_gb']:.2f} s/GB; "
          f"ratio {r['weights_first_s'] / r['raw_sha256_s']:.2f}x)")
    print(f"  CPU time (what a quiet box would see as wall time, one core): {cpu_first:.3f} s = "
          f"{cpu_first / gb:.2f} CPU-s/GB (raw sha256 {cpu_raw:.3f} s)")
    print(f"weights digest, cached       {r['weights_cached_disk_ms']:7.2f} ms from the HMAC'd entry, "
          f"{r['weights_cached_memo_ms']:.3f} ms from the in-process memo "
          f"({r['weights_first_s'] * 1e3 / r['weights_cached_disk_ms']:,.0f}x faster than first time)")
    print(f"tokenizer digest, first time {r['tokenizer_first_s']:7.3f} s ({r['tokenizer_first_cpu_s']:.3f} CPU-s)")
    print(f"fingerprint_dir, first time  {r['fingerprint_first_s']:7.3f} s; cached {r['fingerprint_cached_ms']:.2f} ms; "
          f"model load (transformers) {r['model_load_s']:.3f} s -> first time = {r['fingerprint_first_s'] / r['model_load_s']:.2f}x "
          f"a model load, cached = {r['fingerprint_cached_ms'] / 1e3 / r['model_load_s'] * 100:.2f} % of one "
          f"(model load {r['model_load_cpu_s']:.3f} CPU-s)")
    print(f"peak RSS growth while hashing the weights the first time: {rss_growth_mb:.1f} MB")
    if a.json_path:
        Path(a.json_path).write_text(json.dumps(r, indent=1) + "\n")
    run.emit(r)
    return 0


if __name__ == "__main__":
    sys.exit(main())
