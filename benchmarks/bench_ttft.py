"""Time-to-first-token: prefill vs loading the document's `.kvc` (issue 7, issue 8).

For each context length N, on the same machine and in the same run:

* **prefill**: full prefill of document + question, first token from the
  last logits (what an engine without a KV store pays);
* **kvc (disk)**: read the document's `.kvc` from a file, decode it layer by
  layer (lazy layers, background prefetch), prefill only the question on
  top, first token;
* **kvc (store)**: the same through ``kvcodec.store`` tiers (local directory,
  and Redis when ``redis-server`` is installed; a fresh ``Store`` object per
  query so the in-process LRU does not help).

Each timing is the median of ``--repeats`` runs after one warm-up (*warm*).
``--cold`` also times the first call in a fresh process (:func:`kvcodec.runtime.ttft.cold_ttft`,
model load excluded, reported apart) for prefill and for the `.kvc` on disk:
what every ``kvc ask`` process pays. Prefill computes only the last
position's logits (``logits_to_keep=1``) on every path. The first
token of every path is compared with prefill's (the `.kvc` path under a lossy
preset may legitimately differ; the table says whether it matched). Also
reports file size and bits/element, showing that prefill cost grows
superlinearly with N while the KV size grows linearly.

    python benchmarks/bench_ttft.py --tokens 1024,2048,4096,8192 --preset balanced --json out.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import harness
from common import QUESTION, long_ids
from kvcodec.atomic import atomic_write_text
from kvcodec.models.capture import capture, tokenize
from kvcodec.format import encode_kvc_bytes
from kvcodec.api import make_plan
from kvcodec.integrations.hf import greedy_from, load_cache
from kvcodec.runtime.ttft import cold_ttft, ttft_prefill
from kvcodec.models.load import load_model
from kvcodec.store import Store, StoreKey


def median_time(fn, repeats: int) -> tuple[float, object]:
    """(median seconds of ``repeats`` calls after one warm-up call, the last call's value) (harness.timeit)."""
    t = harness.timeit(fn, repeats, warmup=1, cpu=None)
    return t.median, t.value


def start_redis() -> tuple[subprocess.Popen | None, str | None]:
    exe = shutil.which("redis-server")
    if exe is None:
        return None, None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(50):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
            return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            time.sleep(0.1)
    proc.kill()
    return None, None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tokens", default="1024,2048,4096,8192")
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cold", action="store_true", help="also time the first call in a fresh process")
    ap.add_argument("--json", dest="json_out", default=None)
    run = harness.cli(ap, argv, case="ttft")
    args = run.args
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()  # as the `kvc` command does (kvcodec/runtime/allocator.py): warm and cold processes tuned alike
    if args.threads:
        torch.set_num_threads(args.threads)

    lm = load_model(args.model)
    q = tokenize(lm.tokenizer, QUESTION)
    tmp = Path(tempfile.mkdtemp(prefix="kvc-ttft-"))
    redis_proc, redis_url = start_redis()
    rows = []
    try:
        for n in [int(x) for x in args.tokens.split(",")]:
            ids = long_ids(lm.tokenizer, n)
            cache = capture(lm, token_ids=ids)
            plan = make_plan(cache, args.preset, model=lm)
            data = encode_kvc_bytes(cache, plan)
            path = tmp / f"doc{n}.kvc"
            path.write_bytes(data)

            def kvc_path(source_fn):
                def run():
                    loaded = load_cache(source_fn(), lm)
                    return greedy_from(lm, loaded.cache, loaded.next_position, q, 1)[0][0]
                return run

            t_prefill, tok_prefill = median_time(lambda: ttft_prefill(lm, ids, q), args.repeats)
            row = {
                "tokens": n, "preset": args.preset, "kvc_bytes": len(data), "fp16_bytes": cache.nbytes_fp16,
                "bits_per_element": len(data) * 8 / cache.num_elements, "prefill_s": t_prefill,
            }
            paths = {"disk": lambda: path.read_bytes()}
            stores = {"store_dir": str(tmp / f"store{n}")}
            if redis_url:
                stores["store_redis"] = redis_url
            key = StoreKey.for_tokens(ids, model=lm.fingerprint.id, codec=args.preset)
            for name, url in stores.items():
                with Store.open(url) as st:
                    st.put(key, data)

                def fetch(url=url):
                    with Store.open(url) as st:
                        return st.get(key)
                paths[name] = fetch
            for name, src in paths.items():
                t, tok = median_time(kvc_path(src), args.repeats)
                row[f"{name}_s"] = t
                row[f"{name}_speedup"] = t_prefill / t
                row[f"{name}_first_token_matches"] = tok == tok_prefill
            if args.cold:
                threads = torch.get_num_threads()
                cp = cold_ttft("prefill", args.model, ids, q, threads=threads)
                ck = cold_ttft("kvc", args.model, ids, q, kvc=path, threads=threads)
                row.update(cold_prefill_s=cp["ttft_s"], cold_disk_s=ck["ttft_s"], cold_speedup=cp["ttft_s"] / ck["ttft_s"],
                           cold_over_warm_disk=ck["ttft_s"] / row["disk_s"], cold_first_token_matches=ck["token"] == cp["token"],
                           cold_model_load_s=ck["model_load_s"])
            rows.append(row)
            print(json.dumps(row), file=sys.stderr)
    finally:
        if redis_proc is not None:
            redis_proc.terminate()
        shutil.rmtree(tmp, ignore_errors=True)

    cols = [c for c in ("disk", "store_dir", "store_redis") if f"{c}_s" in rows[0]]
    print(f"\nTTFT, {args.model}, preset {args.preset}, torch threads {torch.get_num_threads()}, median of {args.repeats}\n")
    print("| tokens | .kvc bytes | bits/el | prefill s | " + " | ".join(f"{c} s (speed-up)" for c in cols) + " |")
    print("|---|---|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = " | ".join(f"{r[c + '_s']:.3f} ({r[c + '_speedup']:.1f}x{'' if r[c + '_first_token_matches'] else ', 1st token differs'})" for c in cols)
        print(f"| {r['tokens']} | {r['kvc_bytes']:,} | {r['bits_per_element']:.2f} | {r['prefill_s']:.3f} | {cells} |")
    if args.cold:
        print("\ncold: first call in a fresh process (model load excluded)\n")
        print("| tokens | cold prefill s | cold .kvc (disk) s | speed-up | cold / warm .kvc |")
        print("|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['tokens']} | {r['cold_prefill_s']:.3f} | {r['cold_disk_s']:.3f} | {r['cold_speedup']:.1f}x"
                  f"{'' if r['cold_first_token_matches'] else ' (1st token differs)'} | {r['cold_over_warm_disk']:.2f}x |")
    if args.json_out:
        atomic_write_text(args.json_out, json.dumps({"machine": harness.machine(), "rows": rows}, indent=2))
    run.emit({"torch_threads": torch.get_num_threads(), "rows": rows})


if __name__ == "__main__":
    main()
