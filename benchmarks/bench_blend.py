"""CacheBlend quality and TTFT vs naive concatenation vs full prefill (issue 9).

For each text: the first ``chunks x chunk_tokens`` tokens are cut into
chunks, each captured on its own from position 0 (captures cached under
/tmp/kvc-cache/), and put together in a shuffled order; the next
``question_tokens`` tokens are the query ("question") and the
``continuation_tokens`` after them are scored.

Reference = full prefill of [shuffled chunks + question]. Every method
produces the logits of the first continuation token (the TTFT step) and a
cache; the continuation is then fed on that cache and its next-token
distributions are compared with the reference: KL(full || method) mean over
all continuation positions, top-1 agreement, and PPL / ΔPPL of the
continuation.

TTFT = time from chunk caches in memory to the logits of the last query
token: full prefill (HF forward of all tokens, logits of the last one only);
naive (re-rotate + concatenate + query on top = blend at 0 %); blend at each
ratio. Each is timed ``--repeats`` times, interleaved, and the median is
reported.

    python benchmarks/bench_blend.py                 # Markdown table
    python benchmarks/bench_blend.py --json          # one JSON document
    python benchmarks/bench_blend.py --model gemma3-270m   # any model of the matrix (issue 19)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys

import numpy as np
import torch

import harness
from common import CACHE_DIR

from kvcodec.models.cachelayout import cache_for_model
from kvcodec.runtime.blend import blend  # noqa: E402
from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.core.kvcache import KVCache, load_capture, save_capture  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402


def chunk_cache(lm, ids: np.ndarray) -> KVCache:
    """Capture of ``ids`` from position 0, cached on disk by (model, tokens)."""
    key = hashlib.sha256(lm.fingerprint.id.encode() + np.asarray(ids, np.int64).tobytes()).hexdigest()[:24]
    path = CACHE_DIR / f"blend-chunk-{key}.safetensors"
    if path.is_file():
        try:
            c = load_capture(path)
            if np.array_equal(c.token_ids, ids):
                return c
        except Exception:  # a broken cache file is just recomputed
            pass
    c = capture(lm, token_ids=ids)
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    save_capture(c, path)
    return c


@torch.inference_mode()
def continuation_logits(lm, cache: KVCache, first_logits: torch.Tensor, cont: np.ndarray) -> torch.Tensor:
    """[n_cont, vocab]: row i predicts cont[i] (row 0 is the TTFT logits)."""
    past = cache_for_model(lm, cache)
    ids = torch.as_tensor(cont[:-1]).unsqueeze(0)
    pos = torch.arange(cache.next_position, cache.next_position + ids.shape[1]).unsqueeze(0)
    out = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, use_cache=True).logits[0].float()
    return torch.cat([first_logits.float().reshape(1, -1), out], dim=0)


def score(ref: torch.Tensor, got: torch.Tensor, cont: np.ndarray) -> dict[str, float]:
    lp_r = torch.log_softmax(ref.double(), -1)
    lp_g = torch.log_softmax(got.double(), -1)
    kl = (lp_r.exp() * (lp_r - lp_g)).sum(-1).clamp_min(0)
    tgt = torch.as_tensor(cont)[:, None]
    return {
        "kl_mean": float(kl.mean()),
        "kl_first": float(kl[0]),
        "top1": float((ref.argmax(-1) == got.argmax(-1)).double().mean()),
        "ppl": float((-lp_g.gather(1, tgt).mean()).exp()),
    }


@torch.inference_mode()
def full_prefill(lm, ids: np.ndarray):
    out = lm.model(input_ids=torch.as_tensor(ids).unsqueeze(0), use_cache=True, logits_to_keep=1)
    return out.past_key_values, out.logits[0, -1]


def run_text(lm, name: str, n_chunks: int, chunk_tokens: int, q_tokens: int, c_tokens: int,
             ratios: list[float], repeats: int, seed: int, select_layer: int, log) -> dict:
    ids = tokenize(lm.tokenizer, load_text(name))
    need = n_chunks * chunk_tokens + q_tokens + c_tokens
    if len(ids) < need:
        raise SystemExit(f"Error: {name} has {len(ids)} tokens, need {need}")
    pieces = [ids[i * chunk_tokens:(i + 1) * chunk_tokens] for i in range(n_chunks)]
    order = np.random.default_rng(seed).permutation(n_chunks)
    n_ctx = n_chunks * chunk_tokens
    question = ids[n_ctx:n_ctx + q_tokens]
    cont = ids[n_ctx + q_tokens:n_ctx + q_tokens + c_tokens]
    log(f"[{name}] capturing {n_chunks} chunks of {chunk_tokens} tokens, order {order.tolist()}")
    chunks = [chunk_cache(lm, pieces[i]) for i in order]
    prompt = np.concatenate([pieces[i] for i in order] + [question])

    # Reference: full prefill of the same prompt, then the continuation.
    past, first = full_prefill(lm, prompt)
    ref_cache = KVCache([l.keys[0] for l in past.layers], [l.values[0] for l in past.layers], prompt, lm.fingerprint)
    ref = continuation_logits(lm, ref_cache, first, cont)

    methods = [("full prefill", None), ("naive concat", 0.0)] + [(f"blend {r:.0%}", r) for r in ratios]
    rows = {}
    for label, r in methods:
        if r is None:
            rows[label] = {"ratio": 1.0, **score(ref, ref, cont), "selected_tokens": len(prompt)}
            continue
        res = blend(lm, chunks, question, recompute_ratio=r, select_layer=select_layer)
        assert np.array_equal(res.cache.token_ids, prompt)
        got = continuation_logits(lm, res.cache, res.logits_last, cont)
        rows[label] = {"ratio": r, **score(ref, got, cont), "selected_tokens": int(len(res.selected))}
        log(f"[{name}] {label}: KL {rows[label]['kl_mean']:.4f} PPL {rows[label]['ppl']:.3f}")

    # TTFT, interleaved repeats (the machine is shared: take medians).
    times: dict[str, list[float]] = {label: [] for label, _ in methods}
    for rep in range(repeats):
        for label, r in methods:
            with harness.stopwatch(cpu=None) as sw:  # interleaved across methods, so one call at a time
                if r is None:
                    full_prefill(lm, prompt)
                else:
                    blend(lm, chunks, question, recompute_ratio=r, select_layer=select_layer)
            times[label].append(sw.wall)
        log(f"[{name}] TTFT repeat {rep + 1}/{repeats} done")
    ppl_full = rows["full prefill"]["ppl"]
    t_full = statistics.median(times["full prefill"])
    for label, _ in methods:
        row = rows[label]
        row["dppl_percent"] = 100.0 * (row["ppl"] - ppl_full) / ppl_full
        row["ttft_ms"] = 1e3 * statistics.median(times[label])
        row["ttft_all_ms"] = [1e3 * t for t in times[label]]
        row["speedup_vs_full"] = t_full / statistics.median(times[label])
    return {"text": name, "order": order.tolist(), "context_tokens": n_ctx, "question_tokens": q_tokens,
            "continuation_tokens": c_tokens, "methods": rows}


def markdown(results: list[dict]) -> str:
    labels = list(results[0]["methods"])
    out = []
    head = "| method | recomputed tokens | KL mean (nats) | KL first token | top-1 agree | PPL | ΔPPL % | TTFT ms (median) | speed-up vs full |"
    for res in results:
        out.append(f"\n**{res['text']}** — {len(res['order'])} chunks × {res['context_tokens'] // len(res['order'])} tokens "
                   f"(order {res['order']}), question {res['question_tokens']}, continuation {res['continuation_tokens']}\n")
        out += [head, "|" + "---|" * 9]
        for label in labels:
            m = res["methods"][label]
            out.append(f"| {label} | {m['selected_tokens']} | {m['kl_mean']:.4f} | {m['kl_first']:.4f} | {m['top1']:.3f} | "
                       f"{m['ppl']:.3f} | {m['dppl_percent']:+.2f} | {m['ttft_ms']:.0f} | {m['speedup_vs_full']:.2f}× |")
    if len(results) > 1:
        out.append(f"\n**mean over {len(results)} texts**\n")
        out += ["| method | KL mean | ΔPPL % | TTFT ms | speed-up vs full |", "|---|---|---|---|---|"]
        for label in labels:
            ms = [r["methods"][label] for r in results]
            out.append(f"| {label} | {np.mean([m['kl_mean'] for m in ms]):.4f} | {np.mean([m['dppl_percent'] for m in ms]):+.2f} | "
                       f"{np.mean([m['ttft_ms'] for m in ms]):.0f} | {np.mean([m['speedup_vs_full'] for m in ms]):.2f}× |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--model", dest="model_name", default=None,
                    help="shipped model name or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--texts", default="gpl3,pydoc", help="comma-separated kvcodec.texts names or paths")
    ap.add_argument("--chunks", dest="n_chunks", type=int, default=6)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--question-tokens", type=int, default=32)
    ap.add_argument("--continuation-tokens", type=int, default=128)
    ap.add_argument("--ratios", default="0.05,0.10,0.15,0.30")
    ap.add_argument("--select-layer", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3, help="TTFT timings per method (median reported)")
    ap.add_argument("--seed", type=int, default=0, help="chunk shuffle seed")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (0: torch default). 1 by default: on the shared 2-core box, 2 threads under load "
                         "oversubscribe and make small ops several times slower")
    ap.add_argument("--json", dest="as_json", action="store_true")
    run = harness.cli(ap, argv, case="blend")
    a = run.args
    model_name, texts, n_chunks, chunk_tokens, question_tokens, continuation_tokens, ratios, select_layer, repeats, seed, \
        threads, as_json = (a.model_name, a.texts, a.n_chunks, a.chunk_tokens, a.question_tokens, a.continuation_tokens,
                            a.ratios, a.select_layer, a.repeats, a.seed, a.threads, a.as_json)
    if threads:
        torch.set_num_threads(threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    lm = load_model(model_name) if model_name else load_model()
    ratio_list = [float(x) for x in ratios.split(",") if x.strip()]
    results = [run_text(lm, t.strip(), n_chunks, chunk_tokens, question_tokens, continuation_tokens,
                        ratio_list, repeats, seed, select_layer, log) for t in texts.split(",") if t.strip()]
    env = {"model": model_name or "smollm2 (embedded)", "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
           "platform": platform.platform(), "torch": torch.__version__, "select_layer": select_layer, "repeats": repeats}
    if as_json:
        print(json.dumps({"env": env, "results": results}, indent=2))
    else:
        print(markdown(results))
        print(f"\nModel {env['model']}; CPU, {env['torch_threads']} torch threads, load average at end {env['load_avg'][0]:.2f} "
              f"(shared machine: TTFT is noisy), select layer {select_layer}, {repeats} repeats.")
    run.emit({"env": env, "results": results})


if __name__ == "__main__":
    main()
