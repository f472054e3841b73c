"""Bandwidth-adaptive streaming under a TTFT budget on shaped loopback links (issue 17).

One real document (the first ``--tokens`` of the GPL-3 text, as `kvc ask --doc`
does not matter here: the raw text tokens) is encoded once as a multi-level
entry (small / balanced / near-lossless, 256-token chunks) into a KDN service
(`kvc serve`, a subprocess on loopback). Each link is a :class:`ShapedLink`
proxy in front of the service: 10 Mbit/s, 100 Mbit/s, 1 Gbit/s (5 ms one-way
latency each) and a 100 Mbit/s link that drops (black hole) after a quarter of
the first chunk's near-lossless bytes.

Methods, per link, all in the same process and run:

* ``adaptive``: :class:`kvcodec.runtime.stream.AdaptiveStreamer` with the budget;
* ``fixed:<level>``: every chunk at one level (no adaptation; the budget is
  only reported against), the "one fixed encoding" kvcodec streamed before;
* ``prefill``: always prefilling the text (no network; run once).

The budget is ``--budget-frac`` times the measured TTFT of ``prefill`` in this
run (so it means the same on a fast and a slow machine). TTFT = from the
request to the first answer token's logits (context load + question prefill).
Quality: mean KL(exact || method) over ``--continuation`` tokens of the text
after the context, from the assembled cache, against the exact cache.
The process is warmed first (one unshaped load per level and one prefill:
codec imports, numba kernels, measured speeds), as a serving process would be.

    python benchmarks/bench_stream.py --tokens 768 --json-out benchmarks/results/stream/stream.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import harness

from kvcodec.atomic import atomic_write_text
from kvcodec.models.capture import capture, tokenize
from kvcodec.models.quality import compare_logits, continue_logits
from kvcodec.models.load import load_model
from kvcodec.testing.netshape import ShapedLink
from kvcodec.store import Store, TenantKey
from kvcodec.store.levels import manifest_key
from kvcodec.runtime.stream import SPEEDS, TEXT, AdaptiveStreamer, encode_levels, read_manifest
from kvcodec.texts import load_text

TOK = "tok-bench-stream-0123456789"
LINKS = [("10 Mbit/s", 10e6, None), ("100 Mbit/s", 100e6, None), ("1 Gbit/s", 1e9, None),
         ("100 Mbit/s, drops", 100e6, "drop")]


def start_service(tmp: Path) -> tuple[subprocess.Popen, int]:
    from kvcodec.testing.servers import free_port, subprocess_env, wait_port

    port = free_port()
    (tmp / "tokens.json").write_text(json.dumps({"tokens": [{"token": TOK, "tenant": "bench"}]}))
    proc = subprocess.Popen([sys.executable, "-m", "kvcodec", "serve", "--store", str(tmp / "kdn"), "--port", str(port),
                             "--tokens", str(tmp / "tokens.json"), "--max-body", "256M"],
                            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, timeout=180, proc=proc)
    return proc, port


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--tokens", type=int, default=768, help="Context tokens (multiple of 256 gives full chunks).")
    ap.add_argument("--levels", default="small,balanced,near-lossless")
    ap.add_argument("--budget-frac", type=float, default=0.3, help="Budget = this x the measured prefill TTFT.")
    ap.add_argument("--fixed", default="balanced", help="Level of the fixed-level baseline.")
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--json-out", default=None, metavar="FILE")
    run_ = harness.cli(ap, argv, case="stream")
    a = run_.args
    tokens, levels, budget_frac, fixed, continuation, json_out = (a.tokens, a.levels, a.budget_frac, a.fixed,
                                                                   a.continuation, a.json_out)
    lm = load_model("smollm2")
    all_ids = tokenize(lm.tokenizer, load_text("gpl3"))
    ids, cont = all_ids[:tokens], all_ids[tokens:tokens + continuation]
    q = tokenize(lm.tokenizer, "\nQuestion: what may I do with this program?\nAnswer:")
    key = TenantKey(os.urandom(32))
    tmp = Path(tempfile.mkdtemp(prefix="bench-stream-"))
    proc, port = start_service(tmp)
    try:
        exact = capture(lm, token_ids=ids)
        ex_logits = continue_logits(lm, exact, cont)
        with harness.stopwatch(cpu=None) as sw:
            direct = Store.open(f"kvc+http://:{TOK}@127.0.0.1:{port}", key=key)
            info = encode_levels(lm, direct, ids, levels, cache=exact)
        print(f"encoded {tokens} tokens at {levels} in {sw.wall:.1f} s: "
              + ", ".join(f"{lv} {d['bytes']:,} B ({d['bits_per_element']:.2f} bits/el)" for lv, d in info["levels"].items()),
              file=sys.stderr)
        man = read_manifest(direct, manifest_key(ids, model=lm.fingerprint.id))
        # warm the process: codec imports and kernels, measured decode and prefill speeds
        for lv in man.levels:
            AdaptiveStreamer(lm, direct, fixed=lv).load(ids, budget_s=None)
        rows = []

        def run(link_name: str, method: str, st: Store, budget: float | None, fixed_opt: str | None) -> dict:
            out, rep = AdaptiveStreamer(lm, st, fixed=fixed_opt).answer(ids, q, budget_s=budget, max_new_tokens=1)
            row = {"link": link_name, "method": method, "ttft_s": rep.ttft_s, "budget_s": budget,
                   "within_budget": None if budget is None else rep.ttft_s <= budget,
                   "levels": rep.level_counts(), "text_share": rep.text_share, "link_failed": rep.link_failed,
                   "bytes": sum(c.bytes for c in rep.chunks), "chunks": [c.to_json() for c in rep.chunks]}
            rows.append(row)
            print(f"{link_name:20s} {method:16s} TTFT {rep.ttft_s:7.3f} s  {rep.level_counts()}", file=sys.stderr)
            return row

        base = run("(none)", "prefill", direct, None, TEXT)
        budget = budget_frac * base["ttft_s"]
        base["budget_s"] = budget
        base["within_budget"] = base["ttft_s"] <= budget
        for name, rate, mode in LINKS:
            for method, fx in (("adaptive", None), (f"fixed:{fixed}", fixed)):
                drop_after = info["levels"][man.levels[-1]]["bytes"] // info["chunks"] // 4 if mode == "drop" else None
                SPEEDS.bw.clear()  # every link starts without a bandwidth history: the first chunk probes
                with ShapedLink(port, rate_bps=rate, latency_s=0.005, drop_after=drop_after) as link:
                    st = Store.open(f"kvc+http://:{TOK}@127.0.0.1:{link.port}", key=key)
                    run(name, method, st, budget, fx)
        # quality of each row's choices, against the exact cache (a second, unshaped load of the same choices)
        for row in rows:
            choices = [c["choice"] for c in row["chunks"]]
            row["kl_mean"] = quality(lm, direct, ids, choices, ex_logits, cont)
    finally:
        proc.terminate()
        proc.wait(30)
    doc = {"machine": machine(), "tokens": tokens, "levels": info["levels"], "budget_frac": budget_frac,
           "budget_s": budget, "command": harness.command_line(run_.argv, run_.script), "rows": rows}
    if json_out:
        atomic_write_text(json_out, json.dumps(doc, indent=2, default=str))
    print(table(doc))
    run_.emit({k: v for k, v in doc.items() if k not in ("machine", "command")})


def quality(lm, st: Store, ids: np.ndarray, choices: list[str], ex_logits, cont) -> float:
    """KL of the cache made of exactly these per-chunk choices (levels from the store, text prefilled)."""
    from kvcodec.runtime.stream import (  # one code path: the streamer's own assembly
        Speeds,
        StreamReport,
        _Run,
    )

    s = AdaptiveStreamer(lm, st, speeds=Speeds())
    man = read_manifest(st, manifest_key(ids, model=lm.fingerprint.id))
    run = _Run(s, man, ids, None, 0, time.perf_counter(), StreamReport("", None, man.levels, []))
    orig = run.decide
    run.decide = lambda i: _force(orig(i), choices[i], run)  # type: ignore[method-assign]
    past = run.go()
    from kvcodec.core.kvcache import KVCache

    kv = KVCache([la.keys[0] for la in past.layers], [la.values[0] for la in past.layers], ids, lm.fingerprint)
    return compare_logits(ex_logits, continue_logits(lm, kv, cont), cont)["kl_mean"]


def _force(item, choice: str, run):
    item.choice.choice = choice
    item.est_s = 0.0
    return item


def machine() -> dict:
    return {**harness.machine(), "loadavg": os.getloadavg()}


def table(doc: dict) -> str:
    lines = [f"budget {doc['budget_s']:.2f} s (= {doc['budget_frac']} x prefill TTFT), {doc['tokens']} tokens",
             "| link | method | TTFT s | within budget | chunks chosen | text share | KL vs exact |",
             "|---|---|---:|---|---|---:|---:|"]
    for r in doc["rows"]:
        lv = ", ".join(f"{k} {v}" for k, v in r["levels"].items())
        lines.append(f"| {r['link']} | {r['method']} | {r['ttft_s']:.3f} | {'yes' if r['within_budget'] else 'NO'} | "
                     f"{lv} | {100 * r['text_share']:.0f} % | {r['kl_mean']:.2e} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
