"""Token pruning (H2O, LLMLingua-style) alone and composed with the codec.

For each text: capture the exact cache of the first ``--tokens`` tokens (with
H2O attention scores from the same prefill), then measure on the next
``--cont`` tokens, against the exact cache:

* KL (mean, nats), top-1 agreement, dPPL (%), greedy match (16 tokens);
* effective bits per element = real .kvc bytes x 8 / elements of the
  UNPRUNED cache (``raw`` preset = fp16 + positions + header; ``balanced`` =
  the codec preset; its shared per-model calibration is external and not
  counted, as for every balanced file).

Then a retrieval-like check: ``--keys`` lines "The code for <name> is
<5 digits>." planted in real text (seeded), the model is asked for each code
after the cached context; accuracy = the 5 digits come out greedily.
H2O scores come from the context only (question-agnostic, as a stored cache
must be); lingua is run plainly and question-aware (one prune per question).

    python benchmarks/bench_prune.py                       # 3 texts, 1024 tokens
    python benchmarks/bench_prune.py --tokens 2048 --json  # the issue's setting

Exact captures and scores are cached under /tmp/kvc-cache/.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import harness
from common import CACHE_DIR as CACHE
from kvcodec.models.cachelayout import cache_for_model  # noqa: E402
from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.models.quality import continue_logits, greedy  # noqa: E402
from kvcodec.core.kvcache import KVCache, load_h5, save_h5  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.prune import evaluate_pruned, h2o_prune, parse_prune  # noqa: E402
from kvcodec.prune.h2o import attention_scores  # noqa: E402
from kvcodec.digest import token_ids_sha256 as ids_sha256  # noqa: E402
from kvcodec.prune.lingua import pack_mask, segment_relevance, select_lingua, self_information  # noqa: E402
from kvcodec.texts import DEFAULT_BENCH_TEXTS, load_text  # noqa: E402


def cached_exact(lm: Any, name: str, ids: np.ndarray, window: int | None) -> tuple[KVCache, np.ndarray]:
    """Exact capture + H2O scores, cached on disk by (ids, window)."""
    CACHE.mkdir(parents=True, exist_ok=True)
    key = f"prune-{name}-{len(ids)}-{ids_sha256(ids)[:12]}-w{window or 'all'}"
    h5, npy = CACHE / f"{key}.h5", CACHE / f"{key}.scores.npy"
    if h5.is_file() and npy.is_file():
        return load_h5(h5), np.load(npy)
    from kvcodec.models.capture import cache_from_hf

    past, scores = attention_scores(lm, ids, window)
    cache = cache_from_hf(past, ids, lm, meta={"model": lm.name})
    save_h5(cache, h5)
    np.save(npy, scores)
    return cache, scores


def cached_info(lm: Any, name: str, ids: np.ndarray) -> np.ndarray:
    CACHE.mkdir(parents=True, exist_ok=True)
    p = CACHE / f"prune-{name}-{len(ids)}-{ids_sha256(ids)[:12]}.selfinfo.npy"
    if p.is_file():
        return np.load(p)
    info = self_information(lm, ids)
    np.save(p, info)
    return info


def lingua_cache(lm: Any, ids: np.ndarray, info: np.ndarray, spec: str, relevance: np.ndarray | None = None) -> KVCache:
    b = parse_prune(spec)
    kept = select_lingua(info, b.resolve(len(ids)), b.segment, relevance, b.spread)
    c = capture(lm, token_ids=ids[kept])
    c.meta["prune"] = {"method": "lingua", "spec": b.spec(), "context_tokens": len(ids), "kept_tokens": len(kept),
                       "kept_fraction": len(kept) / len(ids), "positions": "renumbered",
                       "kept_mask_b64": pack_mask(kept, len(ids)), "question_aware": relevance is not None}
    return c


def encode_decode(cache: KVCache, preset: str) -> tuple[int, KVCache]:
    """(.kvc bytes, decoded cache) for a preset name or ``step0=X`` (the codec's rate knob)."""
    from kvcodec.format import KvcReader, write_kvc
    from kvcodec.plan.presets import get_plan
    from kvcodec.calibration.store import default_resolver as attachment_resolver

    if preset.startswith("step0="):
        plan = get_plan("balanced", cache, step0=float(preset.split("=", 1)[1]))
    else:
        plan = get_plan(preset, cache)
    buf = io.BytesIO()
    write_kvc(cache, buf, plan, meta=cache.meta)
    data = buf.getvalue()
    dec = KvcReader(data, attachment_resolver=attachment_resolver).read_cache()
    if preset == "raw":
        dec = cache  # bit-exact by construction; skip float16 round trip differences in dtype
    return len(data), dec


def quality_rows(lm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    presets = ["raw"] + ([] if args.no_codec else ["balanced"])
    codec_only = [] if args.no_codec else [f"step0={x}" for x in args.codec_steps]
    for name in args.texts:
        all_ids = tokenize(lm.tokenizer, load_text(name))
        ids, cont = all_ids[: args.tokens], all_ids[args.tokens : args.tokens + args.cont]
        t0 = time.time()
        exact, scores = cached_exact(lm, name, ids, args.window)
        scores_all = cached_exact(lm, name, ids, None)[1] if args.h2o_all else None
        info = cached_info(lm, name, ids)
        exact16 = exact.to(torch.float16)  # files store fp16; the codec input is fp16 too
        ex_logits = continue_logits(lm, exact, cont)
        ex_greedy = greedy(lm, exact, int(cont[0]), args.greedy) if args.greedy else None
        elems = exact.num_elements
        variants: list[tuple[str, str, Any]] = [("none", "exact", lambda: exact16)]
        if args.only_codec:
            presets = []
        for b in ([] if args.only_codec else args.h2o):
            variants.append(("h2o", f"h2o:{b}", lambda b=b: h2o_prune(exact16, scores, parse_prune(f"h2o:{b},window={args.window}"))))
        if scores_all is not None and not args.only_codec:
            for b in args.h2o_all:
                variants.append(("h2o", f"h2o:{b},window=all", lambda b=b: h2o_prune(exact16, scores_all, parse_prune(f"h2o:{b},window=all"))))
        for r in ([] if args.only_codec else args.lingua):
            variants.append(("lingua", f"lingua:{r}", lambda r=r: lingua_cache(lm, ids, info, f"lingua:{r}").to(torch.float16)))
        for method, spec, make in variants:
            pruned = make()
            for preset in presets + (codec_only if method == "none" else []):
                nbytes, dec = encode_decode(pruned, preset)
                q = evaluate_pruned(lm, exact, dec, cont, greedy_tokens=args.greedy, exact_logits=ex_logits, exact_greedy=ex_greedy)
                rows.append({"text": name, "method": method, "spec": spec, "preset": preset,
                             "kept_fraction": pruned.num_tokens / exact.num_tokens, "bytes": nbytes,
                             "bits_per_element": nbytes * 8 / elems, "kl_mean": q.kl_mean, "top1": q.top1_agreement,
                             "dppl_percent": q.dppl_percent, "greedy_match": q.greedy_match})
                print(f"  {name:7s} {spec:22s} {preset:9s} kept {rows[-1]['kept_fraction']:.3f} "
                      f"bits {rows[-1]['bits_per_element']:.3f} KL {q.kl_mean:.4f} dPPL {q.dppl_percent:+.2f}%", file=sys.stderr)
        print(f"  [{name}: {time.time() - t0:.0f} s]", file=sys.stderr)
    return rows


# ------------------------------------------------------------------ retrieval
NAMES = ["Alice", "Bruno", "Chen", "Dmitri", "Elena", "Farah", "Gustav", "Hiro", "Ingrid", "Jamal", "Kenji", "Lucia",
         "Mateo", "Nadia", "Omar", "Priya"]


def retrieval_context(lm: Any, seed: int, n_keys: int, tokens: int) -> tuple[np.ndarray, dict[str, str]]:
    """Filler text (GPL-3 paragraphs from a seeded offset) with ``n_keys`` code lines at seeded places."""
    rng = np.random.default_rng(seed)
    names = list(rng.choice(NAMES, size=n_keys, replace=False))
    codes = {n: "".join(str(d) for d in rng.integers(0, 10, 5)) for n in names}
    paras = [p for p in load_text("gpl3").split("\n\n") if p.strip()]
    start = int(rng.integers(0, len(paras) // 2))
    filler = paras[start:]
    slots = sorted(rng.choice(np.arange(0, 12), size=n_keys, replace=False))
    out, k = [], 0
    for i, p in enumerate(filler):
        out.append(p)
        while k < n_keys and slots[k] == i:
            out.append(f"The code for {names[k]} is {codes[names[k]]}.")
            k += 1
        if len(tokenize(lm.tokenizer, "\n\n".join(out))) > tokens + 64 and k == n_keys:
            break
    ids = tokenize(lm.tokenizer, "\n\n".join(out))
    # keep the last `tokens` tokens that still contain every code line
    ids = ids[:tokens] if len(ids) >= tokens else ids
    text = lm.tokenizer.decode(ids)
    present = {n: c for n, c in codes.items() if f"The code for {n} is {c}." in text}
    return ids, present


@torch.inference_mode()
def answer(lm: Any, cache: KVCache, prompt_ids: np.ndarray, n: int = 7) -> str:
    past = cache_for_model(lm, cache)
    pos0 = cache.next_position
    ids = torch.as_tensor(prompt_ids)[None]
    out = lm.model(input_ids=ids, past_key_values=past, position_ids=torch.arange(pos0, pos0 + ids.shape[1])[None], use_cache=True)
    pos, toks = pos0 + ids.shape[1], []
    tok = int(out.logits[0, -1].argmax())
    for _ in range(n):
        toks.append(tok)
        out = lm.model(input_ids=torch.tensor([[tok]]), past_key_values=past, position_ids=torch.tensor([[pos]]), use_cache=True)
        tok, pos = int(out.logits[0, -1].argmax()), pos + 1
    return lm.tokenizer.decode(toks)


def retrieval_rows(lm: Any, args: argparse.Namespace) -> list[dict[str, Any]]:
    hits: dict[str, list[int]] = {}
    kept: dict[str, float] = {}
    for seed in range(args.seeds):
        ids, codes = retrieval_context(lm, 1000 + seed, args.keys, args.retrieval_tokens)
        exact, scores = cached_exact(lm, f"retr{seed}", ids, args.window)
        info = cached_info(lm, f"retr{seed}", ids)
        caches: dict[str, KVCache] = {"exact": exact}
        for b in args.h2o:
            caches[f"h2o:{b}"] = h2o_prune(exact, scores, parse_prune(f"h2o:{b},window={args.window}"))
        for r in args.retrieval_lingua:
            caches[f"lingua:{r}"] = lingua_cache(lm, ids, info, f"lingua:{r}")
        bounds = [(a, min(len(ids), a + 200)) for a in range(0, len(ids), 200)]
        for name, code in codes.items():
            question = f"\n\nQuestion: What is the code for {name}?\nAnswer: The code for {name} is"
            q_ids = tokenize(lm.tokenizer, question)
            per_q = dict(caches)
            if args.question_aware:
                rel = segment_relevance(lm, ids, bounds, tokenize(lm.tokenizer, f"\nWhat is the code for {name}?"))
                for r in args.retrieval_lingua:
                    per_q[f"lingua-qa:{r}"] = lingua_cache(lm, ids, info, f"lingua:{r},spread=0.9", relevance=rel)
            for label, c in per_q.items():
                got = answer(lm, c, q_ids)
                hits.setdefault(label, []).append(int(code in got.replace(" ", "")[:8]))
                kept[label] = c.num_tokens / len(ids)
        print(f"  [retrieval seed {seed}: {len(codes)} keys, {len(ids)} tokens] " +
              " ".join(f"{k}={np.mean(v):.2f}" for k, v in hits.items()), file=sys.stderr)
    return [{"method": k, "kept_fraction": kept[k], "accuracy": float(np.mean(v)), "questions": len(v)} for k, v in hits.items()]


def markdown(rows: list[dict[str, Any]], retr: list[dict[str, Any]], args: argparse.Namespace) -> str:
    out = [f"### Pruning quality (SmolLM2-135M, {args.tokens}-token contexts, {args.cont}-token continuation, mean over {', '.join(args.texts)})", "",
           "| method | preset | kept | bits/elem (eff.) | KL mean | top-1 | dPPL % | greedy |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    keys = []
    for r in rows:
        k = (r["spec"], r["preset"])
        if k not in keys:
            keys.append(k)
    for spec, preset in keys:
        g = [r for r in rows if r["spec"] == spec and r["preset"] == preset]
        m = {f: float(np.mean([r[f] for r in g])) for f in ("kept_fraction", "bits_per_element", "kl_mean", "top1", "dppl_percent", "greedy_match")}
        out.append(f"| {spec} | {preset} | {m['kept_fraction']:.3f} | {m['bits_per_element']:.3f} | {m['kl_mean']:.4f} | "
                   f"{m['top1']:.3f} | {m['dppl_percent']:+.2f} | {m['greedy_match']:.2f} |")
    out += ["", "Per text (KL mean / dPPL %):", "", "| method | preset | " + " | ".join(args.texts) + " |",
            "|---|---|" + "---:|" * len(args.texts)]
    for spec, preset in keys:
        cells = []
        for t in args.texts:
            g = [r for r in rows if r["spec"] == spec and r["preset"] == preset and r["text"] == t]
            cells.append(f"{g[0]['kl_mean']:.4f} / {g[0]['dppl_percent']:+.2f}" if g else "-")
        out.append(f"| {spec} | {preset} | " + " | ".join(cells) + " |")
    if retr:
        out += ["", f"### Retrieval ({args.seeds} seeds x {args.keys} planted codes, {args.retrieval_tokens}-token contexts)", "",
                "| cache | kept | accuracy | questions |", "|---|---:|---:|---:|"]
        for r in retr:
            out.append(f"| {r['method']} | {r['kept_fraction']:.3f} | {r['accuracy']:.3f} | {r['questions']} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--texts", nargs="+", default=list(DEFAULT_BENCH_TEXTS))
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--cont", type=int, default=256)
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--h2o", nargs="+", default=["0.75", "0.5", "0.25", "0.1"])
    ap.add_argument("--h2o-all", nargs="*", default=["0.25"], help="budgets also scored with window=all")
    ap.add_argument("--lingua", nargs="+", default=["0.75", "0.5", "0.25"])
    ap.add_argument("--no-codec", action="store_true", help="skip the balanced composition")
    ap.add_argument("--codec-steps", nargs="*", default=["0.8", "1.6", "3.2"],
                    help="codec-only rate points (step0; balanced=0.4, small=0.8) on the exact cache, for equal-bits comparison")
    ap.add_argument("--only-codec", action="store_true", help="run only the codec-only rate points (quality part)")
    ap.add_argument("--seeds", type=int, default=2)
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--retrieval-tokens", type=int, default=1024)
    ap.add_argument("--retrieval-lingua", nargs="+", default=["0.5", "0.25"])
    ap.add_argument("--question-aware", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--skip-quality", action="store_true")
    ap.add_argument("--skip-retrieval", action="store_true")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--render", nargs="+", metavar="JSON", help="print the Markdown tables of saved --json outputs (merged)")
    run = harness.cli(ap, argv, case="prune")
    args = run.args
    if args.render:
        rows, retr = [], []
        for path in args.render:
            d = json.loads(Path(path).read_text())
            rows += d["quality"]
            retr += d["retrieval"]
            saved = argparse.Namespace(**d["args"])
        print(markdown(rows, retr, saved))
        return
    torch.set_num_threads(args.threads)
    lm = load_model()
    rows = [] if args.skip_quality else quality_rows(lm, args)
    retr = [] if args.skip_retrieval else retrieval_rows(lm, args)
    if args.json:
        print(json.dumps({"args": vars(args), "quality": rows, "retrieval": retr}, indent=2, default=str))
    else:
        print(markdown(rows, retr, args))
    run.emit({"quality": rows, "retrieval": retr})


if __name__ == "__main__":
    main()
