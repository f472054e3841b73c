"""A model on paper: what a shared KDN store must deliver per engine, and the prefill compute it saves.

    python benchmarks/kdn_scale_model.py [--bits 1.94] [--context 8192] [--rps 1] [--hit 0.9] [--docs 10000]

Inputs are stated, not measured here: the KV shapes of Llama-3 8B / 70B (from
their published configs), kvcodec's bits/element (default: ``balanced`` at
1.94 bits/element, the figure measured on SmolLM2 in BENCHMARKS.md; a larger
model's cache is assumed to compress as well), and a workload (requests per
second per engine, context length, hit rate, distinct documents).

Per token of context:

* KV bytes = 2 (K and V) x layers x kv_heads x head_dim x bits / 8;
* prefill FLOPs ~= 2 x parameters (the matmuls) + 2 x layers x context x d_model
  (attention scores and weighted sum over, on average, half the context,
  2 FLOPs per multiply-add), i.e. the standard 2N + attention estimate.

Per engine: bytes/s = rps x hit x context x KV bytes/token; FLOPs saved/s =
rps x hit x context x FLOPs/token.  The store holds each distinct document once,
whatever the number of engines, so storage is docs x context x KV bytes/token;
without a shared store every engine prefills every document it sees at least
once (up to docs x engines cold prefills instead of docs).
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass

import harness


@dataclass(frozen=True)
class Model:
    name: str
    params: float
    layers: int
    kv_heads: int
    head_dim: int
    d_model: int


MODELS = [
    Model("Llama-3 8B", 8.03e9, 32, 8, 128, 4096),
    Model("Llama-3 70B", 70.6e9, 80, 8, 128, 8192),
]


def si(x: float, unit: str) -> str:
    for p, s in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= p:
            return f"{x / p:.3g} {s}{unit}"
    return f"{x:.3g} {unit}"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bits", type=float, default=1.94, help="kvcodec bits per KV element (balanced)")
    ap.add_argument("--context", type=int, default=8192, help="context tokens per request")
    ap.add_argument("--rps", type=float, default=1.0, help="requests per second per engine")
    ap.add_argument("--hit", type=float, default=0.9, help="fraction of requests served from the store")
    ap.add_argument("--docs", type=int, default=10_000, help="distinct documents in the store")
    run = harness.cli(ap, argv, case="kdn_scale_model")
    a = run.args
    print(f"Assumptions: {a.bits} bits/element, contexts of {a.context} tokens, {a.rps} request/s per engine, "
          f"hit rate {a.hit}, {a.docs:,} distinct documents.\n")
    print("| model | KV bytes/token (kvcodec / fp16) | prefill FLOPs/token | bytes per GFLOP saved | "
          "per engine: store bytes/s | per engine: prefill FLOP/s saved | store size (kvcodec / fp16) |")
    print("|---|---|---|---|---|---|---|")
    per = {}
    rows = []
    for m in MODELS:
        elems = 2 * m.layers * m.kv_heads * m.head_dim
        b = elems * a.bits / 8
        f = 2 * m.params + 2 * m.layers * a.context * m.d_model
        bps = a.rps * a.hit * a.context * b
        fps = a.rps * a.hit * a.context * f
        size = a.docs * a.context * b
        per[m.name] = (bps, fps, size)
        rows.append({"model": asdict(m), "kv_bytes_per_token": b, "kv_bytes_per_token_fp16": elems * 2, "prefill_flops_per_token": f,
                     "bytes_per_gflop_saved": b / (f / 1e9), "engine_store_bytes_per_s": bps, "engine_prefill_flops_saved_per_s": fps,
                     "store_bytes": size, "store_bytes_fp16": a.docs * a.context * elems * 2})
        print(f"| {m.name} | {si(b, 'B')} / {si(elems * 2, 'B')} | {si(f, 'FLOP')} | {b / (f / 1e9):.3g} B | "
              f"{si(bps, 'B/s')} | {si(fps, 'FLOP/s')} | {si(size, 'B')} / {si(a.docs * a.context * elems * 2, 'B')} |")
    print("\n| engines | model | store egress (all engines) | prefill FLOP/s saved (all engines) | "
          "store size | cold prefills with a shared store / without |")
    print("|---|---|---|---|---|---|")
    scale = []
    for n in (1, 10, 100, 1000):
        for m in MODELS:
            bps, fps, size = per[m.name]
            scale.append({"engines": n, "model": m.name, "store_egress_bytes_per_s": n * bps,
                          "prefill_flops_saved_per_s": n * fps, "store_bytes": size, "cold_prefills_shared": a.docs,
                          "cold_prefills_without_up_to": a.docs * n})
            print(f"| {n:,} | {m.name} | {si(n * bps, 'B/s')} | {si(n * fps, 'FLOP/s')} | {si(size, 'B')} | "
                  f"{a.docs:,} / up to {a.docs * n:,} |")

    run.emit({"models": rows, "engines": scale})


if __name__ == "__main__":
    main()
