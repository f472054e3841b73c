"""What richer entropy contexts would save on real lossy files (issue 38, lever 3): a measurement, not a codec.

    python benchmarks/bench_entropy_contexts.py --model smollm2 --texts pydoc-exec,py-argparse --train gpl3
    python benchmarks/bench_entropy_contexts.py --quick

Each text's first ``--tokens`` tokens are encoded with ``--preset`` (rate-controlled, as ``kvc encode`` does)
on the model, entropy coded with rans v1 (``--config '{"rans_blocks": 0}'``); the rANS symbols of every chunk are read back from the file, and each alternative coding is
charged against what the file spends today on the same symbols: the rANS payload plus its stored tables
(rans v1: one 12-bit table per context, a context being (head, 8 coefficient channels) over all the chunk's
tokens; ``kvcodec.entropy.rans.size_breakdown``). Lane flushes and headers are the same in every
alternative and are left out of both sides.

The alternatives, each split of a context into ``blocks`` of B consecutive tokens keeping the lanes' states
(so no flush is added):

* ``chunk-bank B K``: a bank of K tables stored in each chunk (LEB128 like v1's, learned by k-means on the
  chunk's own block histograms under cross-entropy) and one index per (context, block), ceil(log2 K) bits;
  the code length is exact for the bank's 12-bit tables (``normalize_freqs``). Self-contained: it needs
  nothing outside the chunk.
* ``model-bank B K``: K tables learned once per model on a tuning text's file (``--train``; would ship with
  the calibration, so not charged per file), smoothed to code any symbol up to twice the largest the training
  file produced (beyond: an escape of 24 bits), an index per (context, block) at its empirical entropy.
* ``model-bank class K``: the same bank, one index per (context, tokenscale class) instead of per block: the
  class of each token is already in the chunk (the tokenscale stage's side data), so no index per block.
* ``ideal ...``: each split's own empirical entropy with free tables, the bound no bank reaches.

Ratios below 1 are savings. Last, the one that was built: each text encoded again with ``rans`` v2
(``--config '{"rans_blocks": 128}'``, the presets' default since it was built; spec/rans-v2.md: the chunk-bank
coding above with K <= 8 tables merged while that shortens the stream, and v2's smaller header) and the two whole
files compared in bits per K+V element; the decoded caches must be identical.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import harness
import kvcodec
from kvcodec.entropy.model import normalize_freqs
from kvcodec.entropy.rans import _leb128, size_breakdown
from kvcodec.texts import load_text

A = 256  # rans v1 symbols are bytes
MIN_LOG2P = -float(np.log2(4096))  # a 12-bit table gives a coded symbol at least 1/4096


@dataclass
class Chunk:
    """One chunk's rANS symbols as the stage codes them, and what v1 spent on them."""

    sym: np.ndarray  # (H, T, D) int64 zigzag symbols
    group: int  # channels per context
    classes: np.ndarray  # (T,) tokenscale class per token (0 without tokenscale)
    v1_bits: float  # payload bits + stored table bits


def read_chunks(path: Path) -> list[Chunk]:
    """Every rANS chunk of a lossy file, symbols decoded by the stage itself."""
    out = []
    with kvcodec.open(str(path)) as r:
        for j in range(r.num_chunks):
            pipeline, payload, sides, sizes, spec, ctx = r.chunk_inputs(j)
            bs = pipeline.bytes_stage
            if pipeline.byte_stages or bs.name != "rans":
                continue
            specs = pipeline.specs(spec)
            na = len(pipeline.array_stages)
            sym = bs.decode(payload, sides[na], specs[-1], ctx).astype(np.int64)
            T, D = sym.shape[1], sym.shape[2]
            classes = np.zeros(T, np.int64)
            for i, st in enumerate(pipeline.array_stages):
                if st.name == "tokenscale":
                    m = st.multipliers(sides[i], specs[i].shape[1])
                    if m.shape[0] == T:
                        classes = np.unique(m, return_inverse=True)[1].astype(np.int64)
            b = size_breakdown(bytes(payload))
            out.append(Chunk(sym, bs.get_config().get("channel_group") or D, classes,
                             float(b.payload_bits + 8 * b.table_bytes)))
    return out


def _splits(c: Chunk, by: int | str) -> np.ndarray:
    """Histograms [n, A] of each (context, block of ``by`` tokens) or (context, tokenscale class)."""
    H, T, D = c.sym.shape
    rows = []
    for h in range(H):
        for k0 in range(0, D, c.group):
            s = c.sym[h, :, k0:k0 + c.group]
            if by == "class":
                rows += [np.bincount(s[c.classes == k].ravel(), minlength=A) for k in np.unique(c.classes)]
            else:
                rows += [np.bincount(s[t0:t0 + int(by)].ravel(), minlength=A) for t0 in range(0, T, int(by))]
    return np.asarray(rows, np.float64)


def _log2_tables(counts: np.ndarray) -> np.ndarray:
    """log2 probabilities of the 12-bit tables of ``counts`` (absent symbols: impossible)."""
    f = normalize_freqs(counts.astype(np.int64)).astype(np.float64)
    return np.where(f > 0, np.log2(np.maximum(f, 1.0) / 4096), -1e9)


def learn_bank(hist: np.ndarray, k: int, iters: int = 10) -> np.ndarray:
    """K table counts by k-means under cross-entropy, started from K quantile groups of the mean symbol."""
    k = min(k, len(hist))
    mean = (hist * np.arange(A)).sum(1) / np.maximum(hist.sum(1), 1)
    assign = np.minimum((np.argsort(np.argsort(mean, kind="stable"), kind="stable") * k) // len(hist), k - 1)
    total = hist.sum(0)
    for _ in range(iters):
        counts = np.stack([hist[assign == i].sum(0) if (assign == i).any() else total for i in range(k)])
        assign = np.argmax(hist @ _log2_tables(counts).T, axis=1)
    counts = np.stack([hist[assign == i].sum(0) for i in range(k)])
    return counts[counts.sum(1) > 0]


def _entropy_bits(hist: np.ndarray) -> float:
    n = hist.sum(1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(-np.nansum(hist * np.log2(np.where(hist > 0, hist / np.maximum(n, 1), 1))))


def _coded_bits(hist: np.ndarray, log2p: np.ndarray) -> tuple[float, np.ndarray]:
    """Bits of each split coded with its best table of the bank, and the chosen indices."""
    cost = hist @ log2p.T
    idx = np.argmax(cost, axis=1)
    return -float(cost[np.arange(len(hist)), idx].sum()), idx


def chunk_bank_bits(c: Chunk, block: int, k: int) -> float:
    """Payload + bank tables + indices of one chunk coded with its own K-table bank."""
    hist = _splits(c, block)
    counts = learn_bank(hist, k)
    bits, _ = _coded_bits(hist, _log2_tables(counts))
    amax = int(np.flatnonzero(hist.sum(0))[-1]) + 1
    table_bits = 8 * len(_leb128(normalize_freqs(counts.astype(np.int64))[:, :amax]))
    return bits + table_bits + len(hist) * max(1, int(np.ceil(np.log2(max(len(counts), 2)))))


ESCAPE_BITS = 24.0  # a symbol a model bank cannot code: charged as an escape plus the raw byte and more


def model_bank(hist: np.ndarray, k: int) -> np.ndarray:
    """log2 tables of a bank learned on a tuning file, smoothed so every symbol up to twice the largest seen can be
    coded (a shipped bank must code what its training text never produced); symbols above: :data:`ESCAPE_BITS`."""
    counts = learn_bank(hist, k)
    reach = min(A, 2 * (int(np.flatnonzero(hist.sum(0))[-1]) + 1))
    smooth = counts * 4096
    smooth[:, :reach] += 1
    log2p = _log2_tables(smooth)
    log2p[:, reach:] = -ESCAPE_BITS
    return log2p


def model_bank_bits(chunks: list[Chunk], by: int | str, log2p: np.ndarray) -> float:
    """Payload + entropy-coded indices with a bank shipped once per model."""
    bits, idx_all = 0.0, []
    for c in chunks:
        b, idx = _coded_bits(_splits(c, by), log2p)
        bits += b
        idx_all.append(idx)
    idx = np.concatenate(idx_all)
    p = np.bincount(idx) / idx.size
    p = p[p > 0]
    return bits + idx.size * float(-(p * np.log2(p)).sum())


def study(chunks: list[Chunk], train: list[Chunk], blocks: list[int], ks: list[int], model_k: list[int]) -> dict:
    v1 = sum(c.v1_bits for c in chunks)
    n = sum(c.sym.size for c in chunks)
    rows: dict[str, float] = {}
    for by in ["context"] + [str(b) for b in blocks] + ["class"]:
        split = 10**9 if by == "context" else (by if by == "class" else int(by))
        rows[f"ideal {by}"] = sum(_entropy_bits(_splits(c, split)) for c in chunks) / v1
    for b in blocks:
        for k in ks:
            rows[f"chunk-bank {b} {k}"] = sum(chunk_bank_bits(c, b, k) for c in chunks) / v1
    for by in [str(b) for b in blocks] + ["class"]:
        split = by if by == "class" else int(by)
        hist = np.concatenate([_splits(c, split) for c in train])
        for k in model_k:
            rows[f"model-bank {by} {k}"] = model_bank_bits(chunks, split, model_bank(hist, k)) / v1
    return {"symbols": n, "v1_bits_per_symbol": v1 / n, "ratios": rows}


def encode(text: str, model: str, tokens: int, preset: str, out: Path, rans_blocks: int = 0) -> tuple[Path, int]:
    """The text's first ``tokens`` tokens encoded with ``preset``, entropy coded with rans v1 (``rans_blocks`` 0)
    or v2 (cached by name in ``out``), and the K+V elements its rate is charged against."""
    path = out / f"{model}-{text}-{tokens}-{preset}-b{rans_blocks}.kvc"
    meta = path.with_suffix(".json")
    if not path.exists() or not meta.exists():
        e = kvcodec.encode(None, str(path), preset=preset, model=model, text=load_text(text), max_tokens=tokens,
                           overrides={"rans_blocks": rans_blocks})
        meta.write_text(json.dumps({"kv_elements": e.kv_elements}))
    return path, int(json.loads(meta.read_text())["kv_elements"])


def built(text: str, a: argparse.Namespace, work: Path) -> dict:
    """The rans v2 stage as built (``rans_blocks`` = ``--built-blocks``) against v1: whole files, same symbols, so
    the same decoded cache and KL; bits per K+V element of the real file bytes (calibration not counted)."""
    v1, n = encode(text, a.model, a.tokens, a.preset, work)
    v2, _ = encode(text, a.model, a.tokens, a.preset, work, a.built_blocks)
    b1, b2 = 8 * v1.stat().st_size / n, 8 * v2.stat().st_size / n
    with kvcodec.open(str(v1)) as r1, kvcodec.open(str(v2)) as r2:
        same = all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(*(
            [t for pair in zip(c.keys, c.values) for t in pair] for c in (r1.read_cache(), r2.read_cache()))))
    return {"bits_v1": b1, "bits_v2": b2, "ratio": b2 / b1, "same_cache": same}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--texts", default="pydoc-exec,py-argparse,py-heapq,c-stdio,c-stdlib,changelog-apt",
                    help="held-out texts measured (comma-separated)")
    ap.add_argument("--train", default="gpl3", help="the tuning text the model-level banks are learned on")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--preset", default="balanced")
    ap.add_argument("--blocks", default="128,256", help="block lengths in tokens")
    ap.add_argument("--k", default="8,16", help="chunk-bank sizes")
    ap.add_argument("--model-k", default="16,64", help="model-bank sizes")
    ap.add_argument("--built-blocks", type=int, default=128, help="rans v2's block of tokens for the as-built A/B")
    ap.add_argument("--work", type=Path, default=None, help="where the encoded files are kept (default: a temp dir)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    run = harness.cli(ap, argv, case="entropy_contexts")
    a = run.args
    blocks, ks, model_k = ([int(x) for x in s.split(",")] for s in (a.blocks, a.k, a.model_k))
    with tempfile.TemporaryDirectory(prefix="kvc-entctx-") as tmp:
        work = a.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        train = read_chunks(encode(a.train, a.model, a.tokens, a.preset, work)[0])
        results: dict = {"model": a.model, "preset": a.preset, "tokens": a.tokens, "train": a.train,
                         "built_blocks": a.built_blocks, "texts": {}, "built": {}}
        for text in [t for t in a.texts.split(",") if t]:
            results["texts"][text] = study(read_chunks(encode(text, a.model, a.tokens, a.preset, work)[0]), train,
                                           blocks, ks, model_k)
            results["built"][text] = built(text, a, work)
            print(f"[{time.perf_counter() - t0:6.0f} s] {text} done", file=sys.stderr, flush=True)
    names = list(next(iter(results["texts"].values()))["ratios"]) if results["texts"] else []
    results["geomean"] = {k: float(np.exp(np.mean([np.log(r["ratios"][k]) for r in results["texts"].values()])))
                          for k in names}
    if a.json:
        json.dump(results, sys.stdout, indent=2)
        print()
    else:
        texts = list(results["texts"])
        print(f"{a.model} {a.preset} at {a.tokens} tokens; bits against rans v1's payload + tables (bank learned on {a.train})")
        print("| coding | " + " | ".join(texts) + " | geomean |")
        print("|---|" + "---|" * (len(texts) + 1))
        for k in names:
            print(f"| {k} | " + " | ".join(f"{results['texts'][t]['ratios'][k]:.3f}" for t in texts)
                  + f" | {results['geomean'][k]:.3f} |")
        b = results["built"]
        gm = float(np.exp(np.mean([np.log(b[t]["ratio"]) for t in texts]))) if texts else float("nan")
        print(f"\nrans v2 as built (block {a.built_blocks} tokens), whole files, bits/element v1 -> v2 (same cache: "
              f"{all(b[t]['same_cache'] for t in texts)}):")
        print("| text | v1 | v2 | ratio |\n|---|---|---|---|")
        for t in texts:
            print(f"| {t} | {b[t]['bits_v1']:.3f} | {b[t]['bits_v2']:.3f} | {b[t]['ratio']:.3f} |")
        print(f"| geomean | | | {gm:.3f} |")
    run.emit(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
