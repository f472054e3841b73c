"""Rate control on held-out texts (issue 33): do the lossy presets keep their promises, how well does the KL
predictor predict, and what does an encode cost against the prefill it follows?

For each model, held-out text (``kvcodec.texts.HELD_OUT``: nothing was tuned or fitted on them) and
context length: prefill the context (its CPU-seconds are the yardstick), capture it the encode path's way
(the same prefill observing the token importance the plan reads, ``capture(score_window=)``; its cost
over the plain prefill is reported too: that is where the importance is paid), then for each
lossy preset encode it the default way (``kvcodec.encode``'s path: rate control, no model forward
beyond token importance, the writer's read-back), read the file back, continue it on the
``--continuation`` tokens that follow the context in the text, and compare with the exact cache.

Reported per row: bits per element (real file bytes over the K+V elements), measured mean KL and
top-1 agreement on the continuation, the rate control's predicted KL, their ratio, the encode's CPU
seconds (plan + write + read-back; capture excluded) and its throughput in MB of fp16 KV per CPU-second (the codec
alone, one thread: issue 33's >= 50 MB/s target), the plain prefill's and the capture's. Per (model, preset): the
fraction of rows whose KL lies in [0.3, 1] x the target, the worst ratios, the minimum top-1, and
the mean ΔPPL over all continuation tokens of all texts with its 95 % confidence interval (tokens
pooled: the promise is in expectation). The calibration is amortised: its bytes are not charged
(they are per model, shared by every file; ``kvc calibrate`` reports them).

``--threads`` (default 1) sizes torch, BLAS and numba alike, so encode and prefill CPU-seconds compare like
for like. Each model's first encode is preceded by an untimed warm-up encode (numba's cached kernels
load, imports): the rows are what every later document costs.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import harness  # noqa: E402

harness.pin_threads(sys.argv[1:])  # before numpy and torch load: their pools size themselves at import

import numpy as np  # noqa: E402


def _row(lm, cache, cont, exact, preset, cal, prefill_cpu, n_first):
    import torch

    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.models.quality import continue_logits
    from kvcodec.api import make_plan
    from kvcodec.plan.presets import PRESETS

    with harness.stopwatch() as sw:
        plan = make_plan(cache, preset, model=lm, calibration=cal)
        data = encode_kvc_bytes(cache, plan, chunk_tokens=plan.chunk_tokens, preset=preset)
    dec = KvcReader(data).read_cache()
    with torch.inference_mode():
        got_all = continue_logits(lm, dec, cont)
    lp_all_e = torch.log_softmax(exact.double(), -1)
    lp_all_d = torch.log_softmax(got_all.double(), -1)
    kl_tok = (lp_all_e.exp() * (lp_all_e - lp_all_d)).sum(-1).clamp_min(0)
    kl_windows = [float(kl_tok[i:i + n_first].mean()) for i in range(0, len(cont), n_first)]
    # the promise's figures: the first window (--continuation tokens), whatever --windows adds after it
    exact, got, cont = exact[:n_first], got_all[:n_first], cont[:n_first]
    lp_e, lp_d = lp_all_e[:n_first], lp_all_d[:n_first]
    kl = kl_windows[0]
    top1 = float((exact.argmax(-1) == got.argmax(-1)).double().mean())
    tgt = torch.as_tensor(np.asarray(cont[1:], np.int64))[:, None]
    d = (lp_e[:-1].gather(1, tgt) - lp_d[:-1].gather(1, tgt))[:, 0].numpy()
    elems = sum(k.numel() + v.numel() for k, v in zip(cache.keys, cache.values))
    fp16_mb = elems * 2 / 1e6  # the cache as fp16: what "MB/s of fp16 KV" counts
    rate = plan.params["rate"]
    target = PRESETS[preset].target
    return {"preset": preset, "bits_per_element": len(data) * 8 / elems, "bytes": len(data), "step0": rate["step0"],
            "kl": kl, "predicted_kl": rate["predicted_kl"], "measured_over_predicted": kl / rate["predicted_kl"],
            "kl_over_target": kl / target.kl, "top1": top1, "dppl_terms": d.tolist(),
            "encode_cpu_s": sw.cpu, "encode_wall_s": sw.wall, "encode_over_prefill_cpu": sw.cpu / prefill_cpu,
            "fp16_mb": fp16_mb, "encode_mb_s_per_core": fp16_mb / sw.cpu, "kl_windows": kl_windows}


def _chat_context(lm, text: str, T: int, n_cont: int):
    """A ``kvc ask`` context of about ``T`` tokens and its continuation (issue 57, ``--chat``).

    The context is what ``KnowledgeBase`` stores for one document: the model's own chat prefix (system turn,
    user-turn opener, special tokens) and the document cut to fill ``T`` tokens, ending as a stored document does
    (``doc_ids``: ``"\\n\\n"``). The continuation is what follows it when the entry is used, as the rate model's
    chat factor measures it (:func:`kvcodec.onboard.chatfactor.chat_continuation`): the question turn and the model's
    own greedy answer from the exact cache, ``n_cont`` tokens in all (not stopped at EOS)."""
    from kvcodec.models.capture import tokenize
    from kvcodec.models.chat import ChatFormat
    from kvcodec.onboard.chatfactor import CHAT_QUESTION, chat_continuation

    chat = ChatFormat.for_tokenizer(lm.tokenizer)
    body = tokenize(lm.tokenizer, text)[:max(1, T - len(chat.prefix) - 2)]
    doc = lm.tokenizer.decode(body.tolist(), skip_special_tokens=True).rstrip() + "\n\n"
    ids = np.concatenate([chat.prefix, tokenize(lm.tokenizer, doc)])
    q = chat.question_ids(CHAT_QUESTION)
    return ids, chat_continuation(lm, ids, max(1, n_cont - len(q)))[:n_cont]


def _summary(rows, presets):
    from kvcodec.plan.presets import PRESETS

    out = {}
    for model in sorted({r["model"] for r in rows}):
        for preset in presets:
            rs = [r for r in rows if r["model"] == model and r["preset"] == preset]
            if not rs:
                continue
            t = PRESETS[preset].target
            d = np.concatenate([np.asarray(r["dppl_terms"]) for r in rs])
            half = 1.96 * d.std(ddof=1) / math.sqrt(len(d)) if len(d) > 1 else float("nan")
            ratios = [r["measured_over_predicted"] for r in rs]
            inside = [0.3 <= r["kl_over_target"] <= 1.0 for r in rs]
            s = {"rows": len(rs), "kl_target": t.kl, "kl_inside_0.3_1_of_target": f"{sum(inside)}/{len(rs)}",
                 "kl_over_target_min": min(r["kl_over_target"] for r in rs),
                 "kl_over_target_max": max(r["kl_over_target"] for r in rs),
                 "measured_over_predicted_geomean": float(np.exp(np.mean(np.log(ratios)))),
                 "measured_over_predicted_min": min(ratios), "measured_over_predicted_max": max(ratios),
                 "top1_min": min(r["top1"] for r in rs), "top1_promise": t.top1,
                 "dppl_percent_mean": 100 * math.expm1(float(d.mean())),
                 "dppl_percent_ci95": [100 * math.expm1(float(d.mean()) - half), 100 * math.expm1(float(d.mean()) + half)],
                 "dppl_tokens": int(len(d)), "dppl_promise_percent": t.dppl_percent,
                 "bits_per_element_by_tokens": {str(T): float(np.mean([r["bits_per_element"] for r in rs if r["tokens"] == T]))
                                                for T in sorted({r["tokens"] for r in rs})},
                 "encode_over_prefill_cpu_by_tokens": {str(T): float(np.median([r["encode_over_prefill_cpu"] for r in rs
                                                                                 if r["tokens"] == T]))
                                                       for T in sorted({r["tokens"] for r in rs})},
                 "encode_mb_s_per_core_by_tokens": {str(T): float(np.median([r["encode_mb_s_per_core"] for r in rs
                                                                             if r["tokens"] == T]))
                                                    for T in sorted({r["tokens"] for r in rs})},
                 "capture_over_prefill_cpu_by_tokens": {str(T): float(np.median([r["capture_over_prefill_cpu"] for r in rs
                                                                                  if r["tokens"] == T]))
                                                        for T in sorted({r["tokens"] for r in rs})}}
            out[f"{model}/{preset}"] = s
    return out


def markdown(rows, model: str, preset: str) -> str:
    """The per-row table BENCHMARKS.md shows for one model and preset (``--report-from`` renders a saved result)."""
    lines = ["| text | tokens | bits/el | KL | predicted | ratio | KL / target | top-1 | encode / prefill CPU-s | encode MB/s |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["model"] == model and r["preset"] == preset:
            lines.append(f"| {r['text']} | {r['tokens']} | {r['bits_per_element']:.3f} | {r['kl']:.3g} | {r['predicted_kl']:.3g} | "
                         f"{r['measured_over_predicted']:.2f} | {r['kl_over_target']:.2f} | {r['top1']:.3f} | "
                         f"{r['encode_cpu_s']:.2f} / {r['prefill_cpu_s']:.1f} = {r['encode_over_prefill_cpu']:.2f} | "
                         f"{r['encode_mb_s_per_core']:.0f} |")
    return "\n".join(lines)


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"needs an integer >= 1, not {text!r}")
    return n


def main(argv=None) -> None:
    from kvcodec.texts import HELD_OUT

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--texts", default=",".join(HELD_OUT))
    ap.add_argument("--tokens", default="1024,2048,4096", help="context lengths")
    ap.add_argument("--continuation", type=int, default=320)
    ap.add_argument("--windows", type=_positive, default=1,
                    help="also score the next windows of --continuation tokens (kl_windows per row; the promise's "
                         "figures stay the first window's): how much of a row's KL is the text that follows it")
    ap.add_argument("--presets", default="near-lossless,balanced,small")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--chat", action="store_true",
                    help="contexts as kvc ask stores them (the model's chat prefix + the document) continued by the "
                         "question turn and the model's greedy answer (issue 57); ΔPPL is then not reported (the "
                         "continuation is the model's own)")
    ap.add_argument("--report-from", default=None, help="print the tables of this saved result (JSON) and exit")
    run = harness.cli(ap, argv, case="rate")
    a = run.args
    if a.report_from:
        doc = json.loads(Path(a.report_from).read_text())["results"]
        for model in dict.fromkeys(r["model"] for r in doc["rows"]):
            for preset in dict.fromkeys(r["preset"] for r in doc["rows"]):
                print(f"\n`{preset}` ({model}):\n\n{markdown(doc['rows'], model, preset)}")
        return
    import torch

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.models.capture import capture, max_context, prefill, tokenize
    from kvcodec.models.load import load_model
    from kvcodec.models.quality import continue_logits
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.api import make_plan
    from kvcodec.api import resolve_rate_model
    from kvcodec.plan.presets import score_window
    from kvcodec.texts import load_text

    torch.set_num_threads(a.threads)
    presets = [p for p in a.presets.split(",") if p]
    rows, skipped = [], []
    for model in [m for m in a.models.split(",") if m]:
        lm = load_model(model)
        cal = ensure_calibration(lm)
        resolve_rate_model(lm, cal)  # fitted once (or shipped): not an encode's cost
        window = max_context(lm)
        warm = capture(lm, token_ids=tokenize(lm.tokenizer, load_text("gpl3"))[:256])
        for preset in presets:  # untimed: one-time loads (numba kernels, imports), not a document's cost
            plan = make_plan(warm, preset, model=lm, calibration=cal)
            encode_kvc_bytes(warm, plan, chunk_tokens=plan.chunk_tokens, preset=preset)
        for name in [t for t in a.texts.split(",") if t]:
            ids0 = ids = tokenize(lm.tokenizer, load_text(name))
            for T in [int(x) for x in a.tokens.split(",") if x]:
                n_cont = a.continuation * a.windows
                if a.chat and len(ids0) >= T:
                    ids, cont_ids = _chat_context(lm, load_text(name), T, n_cont)
                    ids, T = np.concatenate([ids, cont_ids]), len(ids)
                else:
                    ids = ids0
                if len(ids) < T + n_cont or (window and T + n_cont > window):
                    skipped.append({"model": model, "text": name, "tokens": T, "why": f"{len(ids)} tokens in the text"})
                    continue
                with harness.stopwatch() as pf:  # the yardstick: a plain prefill of the context
                    prefill(lm, ids[:T])
                with harness.stopwatch() as sw:  # the encode path's capture: that prefill, observing the importance
                    cache = capture(lm, token_ids=ids[:T], score_window=score_window("balanced"))
                cont = np.asarray(ids[T:T + n_cont], np.int64)
                with torch.inference_mode():
                    exact = continue_logits(lm, cache, cont)
                for preset in presets:
                    r = _row(lm, cache, cont, exact, preset, cal, pf.cpu, a.continuation)
                    if a.chat:
                        r["dppl_terms"] = []  # the model's own greedy answer: its NLL change is not a ΔPPL of text
                    r.update(model=model, text=name, tokens=T, chat=a.chat, prefill_cpu_s=pf.cpu, capture_cpu_s=sw.cpu,
                             capture_over_prefill_cpu=sw.cpu / pf.cpu)
                    rows.append(r)
                    print(f"{model} {name} {T} {preset}: {r['bits_per_element']:.3f} b/el KL {r['kl']:.3g} "
                          f"(pred {r['predicted_kl']:.3g}, x{r['measured_over_predicted']:.2f}, {r['kl_over_target']:.2f} of target) "
                          f"top1 {r['top1']:.3f} encode {r['encode_cpu_s']:.1f} CPU-s = {r['encode_over_prefill_cpu']:.2f}x prefill"
                          + (f" KL by window {', '.join(f'{k:.3g}' for k in r['kl_windows'])}" if a.windows > 1 else ""),
                          file=sys.stderr, flush=True)
    summary = _summary(rows, presets)
    for k, s in summary.items():
        print(k, {kk: v for kk, v in s.items()}, file=sys.stderr)
    for r in rows:
        r["dppl_terms"] = None if not r.get("dppl_terms") else len(r["dppl_terms"])
    run.emit({"rows": rows, "skipped": skipped, "summary": summary, "finished": time.time()})


if __name__ == "__main__":
    main()
