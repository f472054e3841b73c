"""Many engines, one store: N engine processes share one ``kvc serve`` or one Redis Cluster (loopback).

    python benchmarks/bench_load.py [--engines 8] [--requests 4] [--docs 16] [--doc-tokens 300]
                                    [--zipf 1.1] [--backend kdn,cluster] [--json OUT]

Every engine is a separate process with the embedded model (SmolLM2-135M,
one torch thread) running :meth:`kvcodec.runtime.knowledge.KnowledgeBase.ask`, the
code path of ``kvc ask``.  The workload:

* documents: real texts (``kvcodec.texts``: the license texts and the Python
  language reference) cut into ``--docs`` pieces of about ``--doc-tokens``
  tokens;
* popularity: each engine draws its requests from a Zipf(``--zipf``)
  distribution over the documents (seeded, so both backends see the same
  requests), with a question drawn from a fixed mix;
* every document starts new: the first engine to ask about it prefills,
  answers and stores the encoded cache (preset ``balanced``); later requests
  from any engine load it from the shared store.

Engines keep no in-process cache (``memory_bytes=0``), so every hit is a real
fetch from the shared store.  All engines load their model first and then
start together.  Reported per backend: hit rate, TTFT p50/p99 of hits and of
prefills (misses), fetch latency p50/p99, fetched bytes/s per engine, and the
store's CPU time (``kvc serve`` process, or the sum over the redis-server
processes) over the run.

The CPU is shared by all engines and the store, so on a small machine the
TTFTs include CPU contention; the ratios between hits and prefills are
measured under the same contention.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

import harness

ROOT = Path(__file__).resolve().parents[1]

QUESTIONS = [
    "What is this text about?",
    "Summarize the first paragraph.",
    "Who does this apply to?",
    "List one obligation it states.",
    "What term is defined here?",
    "Give one keyword from the text.",
]
TOKEN = "bench-load-token-0001"


# -- workload -------------------------------------------------------------------------

def corpus(n_docs: int, doc_tokens: int) -> list[str]:
    """``n_docs`` real documents of about ``doc_tokens`` tokens (paragraph-aligned cuts of real texts)."""
    from kvcodec.texts import NAMED, load_text

    texts = [load_text(n) for n in ["pydoc", *NAMED]]
    chars = doc_tokens * 4  # ~4 characters per token in English prose for this tokenizer
    docs: list[str] = []
    for t in texts:
        paras = [p.strip() for p in t.split("\n\n") if p.strip()]
        cur = ""
        for p in paras:
            cur = f"{cur}\n\n{p}" if cur else p
            if len(cur) >= chars:
                docs.append(cur[: int(chars * 1.2)])
                cur = ""
                if len(docs) == n_docs:
                    return docs
    if len(docs) < n_docs:
        raise SystemExit(f"only {len(docs)} documents of {doc_tokens} tokens in the corpus")
    return docs


def schedules(engines: int, requests: int, n_docs: int, s: float, seed: int) -> list[list[tuple[int, int]]]:
    """Per engine: ``requests`` (document, question) pairs, documents Zipf(s)-popular."""
    rng = np.random.default_rng(seed)
    p = 1.0 / np.arange(1, n_docs + 1) ** s
    p /= p.sum()
    perm = rng.permutation(n_docs)  # which document is the most popular is arbitrary
    return [[(int(perm[rng.choice(n_docs, p=p)]), int(rng.integers(len(QUESTIONS)))) for _ in range(requests)]
            for _ in range(engines)]


# -- one engine (a subprocess) -----------------------------------------------------------

def engine_main(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(1)
    from kvcodec.runtime.knowledge import KnowledgeBase
    from kvcodec.models.load import load_model
    from kvcodec.store import Store

    class CountingStore(Store):
        """The store the engine uses, timing every entry fetch and counting its bytes."""

        fetches: list[tuple[float, int]] = []

        def get_entry(self, key):  # type: ignore[override]
            with harness.stopwatch(cpu=None) as sw:
                e = super().get_entry(key)
            if e is not None:
                self.fetches.append((sw.wall, len(e.data)))
            return e

    job = json.loads(Path(args.job).read_text())
    docs = job["docs"]
    lm = load_model("smollm2")
    base = Store.open(job["store"], memory_bytes=0)
    st = CountingStore(base.tiers, base.url)
    kb = KnowledgeBase(lm, st, preset="balanced", namespace="default")
    # Warm-up (not timed): JIT, allocator, and the encode + put path, on a text outside the workload.
    kb.ask([f"Warm-up note of engine {os.getpid()}: " + docs[0][:300]], "warm up", max_new_tokens=1)
    st.fetches.clear()
    print("ready", flush=True)
    sys.stdin.readline()  # the start signal: all engines begin together
    rows = []
    with harness.stopwatch(cpu=None) as sw:
        for d, q in job["schedule"]:
            n_before = len(st.fetches)
            ans = kb.ask([docs[d]], QUESTIONS[q], max_new_tokens=1)
            f = st.fetches[n_before:]
            rows.append({"doc": d, "source": ans.source, "ttft_s": ans.ttft_s, "context_tokens": ans.context_tokens,
                         "cached_tokens": ans.cached_tokens, "fetch_s": sum(x for x, _ in f),
                         "fetch_bytes": sum(n for _, n in f), "stored_bytes": (ans.stored or {}).get("bytes", 0),
                         "failed": (ans.stored or {}).get("failed", {})})
    Path(args.out).write_text(json.dumps({"wall_s": sw.wall, "rows": rows}))


# -- the store backends --------------------------------------------------------------------

class KdnBackend:
    name = "kvc serve (directory store behind it)"

    def __init__(self, work: Path) -> None:
        from kvcodec.testing.servers import free_port, subprocess_env, wait_port

        self.port = free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcodec", "serve", "--store", str(work / "kdn-store"), "--port", str(self.port)],
            env=subprocess_env(KVC_SERVE_TOKEN=TOKEN), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout=180, proc=self.proc)
        self.url = f"kvc+http://:{TOKEN}@127.0.0.1:{self.port}"
        self.pids = [self.proc.pid]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class ClusterBackend:
    name = "Redis Cluster (3 masters)"

    def __init__(self, work: Path) -> None:
        from kvcodec.testing.servers import RedisCluster, find_binary

        server, cli = find_binary("redis-server"), find_binary("redis-cli")
        if not server or not cli:
            raise SystemExit("redis-server / redis-cli not found: bash .ci/services.sh")
        self.c = RedisCluster(server, cli, work / "cluster")
        self.c.start()
        self.url = self.c.url
        self.pids = [p.pid for p in self.c.procs.values()]

    def stop(self) -> None:
        self.c.stop()


def cpu_seconds(pids: list[int]) -> float:
    import psutil

    t = 0.0
    for pid in pids:
        c = psutil.Process(pid).cpu_times()
        t += c.user + c.system
    return t


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def run_backend(kind: str, a: argparse.Namespace, docs: list[str], plan: list[list[tuple[int, int]]]) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as td:
        work = Path(td)
        be = KdnBackend(work) if kind == "kdn" else ClusterBackend(work)
        from kvcodec.testing.servers import subprocess_env

        env = subprocess_env(OMP_NUM_THREADS="1", NUMBA_NUM_THREADS="1")
        procs = []
        try:
            for i, sched in enumerate(plan):
                job = work / f"job{i}.json"
                job.write_text(json.dumps({"docs": docs, "store": be.url, "schedule": sched}))
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, "--engine", "--job", str(job), "--out", str(work / f"out{i}.json")],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env))
            for p in procs:
                line = p.stdout.readline()
                if line.strip() != "ready":
                    raise SystemExit(f"an engine failed to start (exit {p.wait()})")
            cpu0 = cpu_seconds(be.pids)
            with harness.stopwatch(cpu=None) as sw:
                for p in procs:
                    p.stdin.write("go\n")
                    p.stdin.flush()
                for p in procs:
                    if p.wait() != 0:
                        raise SystemExit(f"an engine failed (exit {p.returncode})")
            wall = sw.wall
            store_cpu = cpu_seconds(be.pids) - cpu0
            outs = [json.loads((work / f"out{i}.json").read_text()) for i in range(len(plan))]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            be.stop()
    rows = [r for o in outs for r in o["rows"]]
    hits = [r for r in rows if r["source"] != "prefill"]
    miss = [r for r in rows if r["source"] == "prefill"]
    fetches = [r["fetch_s"] for r in hits if r["fetch_bytes"]]
    failed = [r["failed"] for r in rows if r["failed"]]
    per_engine_bps = [sum(r["fetch_bytes"] for r in o["rows"]) / o["wall_s"] for o in outs]
    return {
        "backend": be.name, "url_scheme": be.url.split("://")[0], "engines": len(plan), "requests": len(rows),
        "wall_s": wall, "hit_rate": len(hits) / len(rows),
        "token_hit_rate": sum(r["cached_tokens"] for r in rows) / sum(r["context_tokens"] for r in rows),
        "ttft_hit_p50_s": pct([r["ttft_s"] for r in hits], 50), "ttft_hit_p99_s": pct([r["ttft_s"] for r in hits], 99),
        "ttft_prefill_p50_s": pct([r["ttft_s"] for r in miss], 50),
        "ttft_prefill_p99_s": pct([r["ttft_s"] for r in miss], 99),
        "fetch_p50_s": pct(fetches, 50), "fetch_p99_s": pct(fetches, 99),
        "fetch_bytes_mean": float(np.mean([r["fetch_bytes"] for r in hits])) if hits else None,
        "bytes_per_s_per_engine_mean": float(np.mean(per_engine_bps)),
        "stored_entries_bytes": sum(r["stored_bytes"] for r in rows),
        "store_cpu_s": store_cpu, "store_cpu_pct_of_core": 100 * store_cpu / wall,
        "context_tokens_mean": float(np.mean([r["context_tokens"] for r in rows])),
        "put_failures": failed,
    }


def render(res: dict[str, Any]) -> str:
    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    ratio = (res["ttft_prefill_p50_s"] / res["ttft_hit_p50_s"]) if res["ttft_hit_p50_s"] and res["ttft_prefill_p50_s"] \
        else None
    return "\n".join([
        f"backend            {res['backend']}: {res['engines']} engines, {res['requests']} requests in "
        f"{res['wall_s']:.1f} s (contexts of {res['context_tokens_mean']:.0f} tokens on average)",
        f"hit rate           {res['hit_rate']:.2f} of requests, {res['token_hit_rate']:.2f} of context tokens",
        f"TTFT hit           p50 {ms(res['ttft_hit_p50_s'])}, p99 {ms(res['ttft_hit_p99_s'])}",
        f"TTFT prefill       p50 {ms(res['ttft_prefill_p50_s'])}, p99 {ms(res['ttft_prefill_p99_s'])}"
        + (f"  (hit p50 {ratio:.1f}x faster)" if ratio else ""),
        f"fetch latency      p50 {ms(res['fetch_p50_s'])}, p99 {ms(res['fetch_p99_s'])} "
        f"(entries of {res['fetch_bytes_mean'] or 0:,.0f} bytes on average)",
        f"bytes/s per engine {res['bytes_per_s_per_engine_mean'] / 1e6:.2f} MB/s (mean over engines, whole run)",
        f"store CPU          {res['store_cpu_s']:.1f} s = {res['store_cpu_pct_of_core']:.0f} % of one core over the run",
        f"put failures       {len(res['put_failures'])}",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engines", type=int, default=8)
    ap.add_argument("--requests", type=int, default=4, help="requests per engine")
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--doc-tokens", type=int, default=300)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="kdn,cluster", help="comma list of kdn, cluster")
    ap.add_argument("--json", default=None)
    ap.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    if "--engine" in (sys.argv[1:] if argv is None else argv):
        engine_main(ap.parse_args(argv))
        return
    run = harness.cli(ap, argv, case="load")
    a = run.args
    if a.engines < 1 or a.requests < 1:
        raise SystemExit("--engines and --requests must be at least 1")
    docs = corpus(a.docs, a.doc_tokens)
    plan = schedules(a.engines, a.requests, a.docs, a.zipf, a.seed)
    print(f"workload: {a.engines} engines x {a.requests} requests over {a.docs} real documents of ~{a.doc_tokens} "
          f"tokens, Zipf s={a.zipf}, {len(set(d for s in plan for d, _ in s))} distinct documents asked, "
          f"{os.cpu_count()} CPU cores shared by engines and store\n")
    results = []
    for kind in a.backend.split(","):
        res = run_backend(kind.strip(), a, docs, plan)
        results.append(res)
        print(render(res) + "\n", flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "results": results}, indent=2, default=str))
    run.emit({"results": results})


if __name__ == "__main__":
    main()
