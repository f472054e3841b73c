"""Entropy coder benchmark: kvcodec rANS v1 vs constriction 0.5.0 on the same data and tables.

    python benchmarks/bench_entropy.py                 # 18.9 M symbols of 4-bit Laplace data
    python benchmarks/bench_entropy.py --real-kv 1024  # + real SmolLM2 KV, 4-bit per-channel quantized
    python benchmarks/bench_entropy.py --json

Best of ``--repeat`` runs (harness.timeit; the JSON also has min/median/max). Reports encode/decode throughput (M symbols/s = MB/s of uint8 symbols, one
CPU thread), coded size vs the empirical entropy, and the overhead split
(tables, 128-byte state flush per context, headers).
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np

import harness
from kvcodec.entropy import model, rans


def laplace_contexts(n_ctx: int, n_sym: int, seed: int = 0) -> np.ndarray:
    """Quantized-KV-like data: discretised Laplace, 4-bit, a different scale per context."""
    rng = np.random.default_rng(seed)
    scales = rng.uniform(0.6, 3.0, size=(n_ctx, 1))
    return np.clip(np.round(rng.laplace(0, 1, (n_ctx, n_sym)) * scales) + 8, 0, 15).astype(np.uint8)


def real_kv_contexts(tokens: int) -> np.ndarray:
    """Real KV (SmolLM2-135M on the Python reference text), every layer's K and V quantized
    to 4 bits per (head, channel) with min/max over tokens; one context per head (g = D)."""
    from kvcodec.models.capture import capture
    from kvcodec.codecs.rans import to_contexts
    from kvcodec.models.load import load_model
    from kvcodec.texts import pydoc_text

    cache = capture(load_model(), text=pydoc_text(), max_tokens=tokens)
    ctxs = []
    for t in list(cache.keys) + list(cache.values):
        x = t.float().numpy()
        lo, hi = x.min(axis=1, keepdims=True), x.max(axis=1, keepdims=True)
        q = np.round((x - lo) / np.maximum(hi - lo, 1e-8) * 15).astype(np.uint8)
        ctxs.append(to_contexts(q))
    return np.concatenate(ctxs)


def best_of(fn, repeat: int) -> tuple[float, object, harness.Timing]:
    """(best wall seconds of ``repeat`` runs, the last run's value, the timing)."""
    t = harness.timeit(fn, repeat)
    return t.min, t.value, t


def bench_ours(sym: np.ndarray, repeat: int) -> dict:
    C, N = sym.shape
    rans.decode_contexts(rans.encode_contexts(sym[:1, :64]))  # JIT warm-up / cache load
    t_enc, buf, tm_enc = best_of(lambda: rans.encode_contexts(sym), repeat)
    t_parse, stream, _ = best_of(lambda: rans.parse_header(buf, C, N), repeat)
    t_dec, out, tm_dec = best_of(lambda: rans.decode(stream), repeat)
    assert np.array_equal(out.reshape(C, N), sym)
    # the numpy lane-vectorised reference decoder (mirrors the GPU kernel) on a slice
    k = max(1, (1 << 20) // N)
    small = rans.parse_header(rans.encode_contexts(sym[:k]))
    t_ref, ref, _ = best_of(lambda: rans.decode_reference(small), 1)
    assert np.array_equal(ref, sym[:k].ravel())
    b = rans.size_breakdown(buf)
    return {
        "coder": "kvcodec rans v1", "bytes": len(buf), "enc_s": t_enc, "dec_s": t_dec, "parse_s": t_parse,
        "ref_dec_msym_s": k * N / t_ref / 1e6,
        "table_bytes": b.table_bytes, "flush_bytes": b.flush_bytes, "header_bytes": b.header_bytes,
        "padding_bytes": b.padding_bytes, "payload_bytes": b.payload_bits // 8, "stream": buf, "freqs": stream.freqs,
        "timings": {"encode": tm_enc.as_dict(), "decode": tm_dec.as_dict()},
    }


def bench_constriction(sym: np.ndarray, freqs: np.ndarray, repeat: int) -> dict | None:
    try:
        import constriction
    except ImportError:
        return None
    C, N = sym.shape
    models, xs = [], []
    for c in range(C):
        present = np.flatnonzero(freqs[c])
        remap = np.zeros(256, np.int32)
        remap[present] = np.arange(present.size)
        F = freqs[c, present].astype(np.float64) * 4096  # same table, at constriction's 24 bits
        models.append(constriction.stream.model.Categorical(F - 1, perfect=False))
        xs.append((remap[sym[c]], present))

    def enc():
        out = []
        for m, (x, _) in zip(models, xs):
            coder = constriction.stream.stack.AnsCoder()
            coder.encode_reverse(x, m)
            out.append(coder.get_compressed())
        return out

    def dec(comp):
        return [xs[c][1][constriction.stream.stack.AnsCoder(comp[c]).decode(models[c], N)] for c in range(C)]

    t_enc, comp, _ = best_of(enc, repeat)
    t_dec, out, _ = best_of(lambda: dec(comp), repeat)
    assert all(np.array_equal(o, sym[c]) for c, o in enumerate(out))
    return {"coder": "constriction 0.5.0 AnsCoder", "bytes": int(sum(c.nbytes for c in comp)), "enc_s": t_enc, "dec_s": t_dec}


def run(name: str, sym: np.ndarray, repeat: int) -> dict:
    C, N = sym.shape
    n = C * N
    ideal = float(model.empirical_entropy_bits(sym).sum() / 8)
    ours = bench_ours(sym, repeat)
    table_ideal = float(model.table_code_length_bits(sym, ours["freqs"]).sum() / 8)
    cons = bench_constriction(sym, ours["freqs"], repeat)
    rows = []
    for r in [ours, cons]:
        if r is None:
            continue
        rows.append({
            "coder": r["coder"], "bytes": r["bytes"], "bits_per_sym": 8 * r["bytes"] / n,
            "vs_entropy_pct": 100 * (r["bytes"] / ideal - 1),
            "enc_msym_s": n / r["enc_s"] / 1e6, "dec_msym_s": n / r["dec_s"] / 1e6,
        })
    return {
        "data": name, "contexts": C, "symbols_per_context": N, "symbols": n,
        "entropy_bytes": ideal, "entropy_bits_per_sym": 8 * ideal / n,
        "table_quantization_pct": 100 * (table_ideal / ideal - 1),
        "ours_split": {k: ours[k] for k in ("payload_bytes", "table_bytes", "flush_bytes", "header_bytes", "padding_bytes")},
        "ours_parse_ms": 1e3 * ours["parse_s"], "ours_reference_numpy_dec_msym_s": ours["ref_dec_msym_s"],
        "rows": rows, "ours_timings": ours["timings"],
    }


def print_report(res: dict) -> None:
    print(f"\n== {res['data']}: {res['contexts']} contexts x {res['symbols_per_context']} symbols = "
          f"{res['symbols'] / 1e6:.1f} M symbols; empirical entropy {res['entropy_bits_per_sym']:.4f} bits/sym")
    print(f"{'coder':30s} {'bytes':>12s} {'bits/sym':>9s} {'vs H':>8s} {'enc Msym/s':>11s} {'dec Msym/s':>11s}")
    for r in res["rows"]:
        print(f"{r['coder']:30s} {r['bytes']:12d} {r['bits_per_sym']:9.4f} {r['vs_entropy_pct']:+7.3f}% "
              f"{r['enc_msym_s']:11.1f} {r['dec_msym_s']:11.1f}")
    s = res["ours_split"]
    total = sum(s.values())
    print("rans overhead split: " + ", ".join(f"{k[:-6]} {v} B ({100 * v / total:.3f} %)" for k, v in s.items())
          + f"; table quantization {res['table_quantization_pct']:+.4f} %")
    print(f"rans parse_header {res['ours_parse_ms']:.2f} ms; numpy reference decoder "
          f"{res['ours_reference_numpy_dec_msym_s']:.2f} Msym/s (1 Mi-symbol slice)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", type=int, default=288, help="Laplace contexts (default 288)")
    ap.add_argument("--symbols", type=int, default=1 << 16, help="symbols per Laplace context (default 65536)")
    ap.add_argument("--real-kv", type=int, default=0, metavar="TOKENS", help="also real SmolLM2 KV of this many tokens")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    run_ = harness.cli(ap, argv, case="entropy")
    args = run_.args
    results = [run("laplace-4bit", laplace_contexts(args.contexts, args.symbols), args.repeat)]
    if args.real_kv:
        results.append(run(f"smollm2-kv-4bit-{args.real_kv}tok", real_kv_contexts(args.real_kv), args.repeat))
    if args.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        for r in results:
            print_report(r)
    run_.emit(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
