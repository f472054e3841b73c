"""Offline editing (issue 37): ``append`` and ``redact`` against a prefill, on held-out texts, both shipped models.

For each model and text, the first ``--tokens`` tokens are the context and the ``--continuation-tokens``
after them are scored: the next-token distributions of the continuation fed after each cache are compared
with those after the reference cache (KL(reference || edit) mean over the positions, nats).

* **append**: the parent is the lossless entry of the first ``tokens - append_tokens`` tokens; the edit
  decodes it and prefills the last ``append_tokens`` over it (:func:`kvcodec.edit.append.append_cache`).
  Reference: one prefill of all ``tokens``. Reported: the edit's time (decode + prefill of the new tokens)
  over the full prefill's, the new tokens' prefill over the cache against their own prefill from scratch,
  the max |K/V| difference and the KL.
* **redact**: the lossless entry of all ``tokens``; the span ``[tokens/3, tokens/3 + span_tokens)`` is removed
  (:func:`kvcodec.edit.redact.redact_cache`) at each ``--ratios`` recompute ratio. Reference: a prefill of the
  edited token ids (what a re-prefill of the edited text costs). Reported: KL, and the repair's time
  (decode included) over the re-prefill's.

* **steer** (``--parts steer``): the key-fact task of :mod:`kvcodec.edit.steer_profile` (four facts of one
  form among distractor paragraphs of held-out texts; the question asks for one; right when the asked value
  is the most likely of the four). Heads are profiled (:func:`kvcodec.edit.steer_profile.profile_layers`) on
  ``--profile-examples`` examples from ``--profile-texts`` and evaluated on ``--eval-examples`` other examples
  from ``--eval-texts`` (other texts, seeds, names and values). Reported: accuracy and mean margin (nats) of
  a plain prefill vs the steered entry (the exact edit: re-prefill under the bias, bias applied to the
  question as the HF loader does), and the steer edit's time over a plain prefill. With ``--auto-spans K``
  the same heads also steer the K sentences :mod:`kvcodec.edit.autospans` chooses without the question;
  reported: their accuracy and margin, how often the asked fact was among them, the scorer's time.

* **promise** (``--parts promise``, issue 57): does an edited entry keep its preset's promise? The parent is a
  ``--preset`` (balanced) entry of the first ``--tokens`` tokens, encoded with the model (rate control), and its
  own KL / top-1 against the exact prefill are reported beside its children. Append: the next
  ``--append-tokens`` tokens, by the default repair (``auto``: a lossy parent's child is prefilled afresh) and by
  the old path (``incremental``: the new tokens over the decoded parent). Redact: the span
  ``[tokens/3, tokens/3 + span_tokens)``, by the default (``prefill``) and by ``blend``. Each child (encoded at the
  parent's preset, as ``kvc edit`` does) is decoded and scored against an **exact prefill of its own ids**: KL and
  top-1 over the ``--continuation-tokens`` after its context (the append child: the tokens after the appended
  ones; the redact child: those after the parent's context), with its bits/element, the promise its log
  records, and the edit's time (one run). A model with no rate model on this machine is refused (the benchmark
  never starts a calibration)::

      python benchmarks/bench_edit.py --parts promise --models smollm2 --tokens 1024 --append-tokens 128 \
          --span-tokens 48 --continuation-tokens 256 --texts apache2,c-stdio,py-argparse,changelog-apt

Timings: each method ``--repeats`` times, interleaved, the minimum reported (the box is shared; the
minimum is the least disturbed run). CPU, ``--threads`` torch threads.

    python benchmarks/bench_edit.py
    python benchmarks/bench_edit.py --models smollm2 --texts apache2 --json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from typing import Any, Callable

import numpy as np
import torch

import harness

from kvcodec.api import encode  # noqa: E402
from kvcodec.edit.append import append_cache  # noqa: E402
from kvcodec.edit.redact import redact_cache  # noqa: E402
from kvcodec.format import KvcReader  # noqa: E402
from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.models.quality import compare_logits, continue_logits  # noqa: E402
from kvcodec.plan.presets import PRESETS  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402


def best(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    out, ts = None, []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t)
    return min(ts), out


def decode(data: bytes) -> Any:
    with KvcReader(data) as r:
        return r.read_cache()


def kl(lm: Any, ref: torch.Tensor, cache: Any, cont: np.ndarray) -> float:
    return float(compare_logits(ref, continue_logits(lm, cache, cont), cont)["kl_mean"])


def run_text(lm: Any, text: str, n: int, n_app: int, span: int, n_cont: int, ratios: list[float], repeats: int,
             log: Callable[[str], None]) -> dict[str, Any]:
    ids = tokenize(lm.tokenizer, load_text(text))
    if len(ids) < n + n_cont:
        raise SystemExit(f"{text}: only {len(ids)} tokens")
    ctx, cont = ids[:n], ids[n:n + n_cont]
    lm.warm_up()
    # -- append
    log(f"{text}: append {n_app} tokens to {n - n_app}")
    parent = capture(lm, token_ids=ctx[:n - n_app])
    pdata = encode(parent, None, preset="lossless").data
    t_full, full = best(lambda: capture(lm, token_ids=ctx), repeats)
    t_dec, dec = best(lambda: decode(pdata), repeats)
    t_new, (child, _) = best(lambda: append_cache(lm, dec, ctx[n - n_app:]), repeats)
    t_alone, _ = best(lambda: capture(lm, token_ids=ctx[n - n_app:]), repeats)
    ref_full = continue_logits(lm, full, cont)
    diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(child.keys + child.values, full.keys + full.values))
    app = {"context_tokens": n - n_app, "appended_tokens": n_app, "full_prefill_s": t_full, "decode_s": t_dec,
           "prefill_new_s": t_new, "new_alone_s": t_alone, "edit_over_full": (t_dec + t_new) / t_full,
           "prefill_new_over_alone": t_new / t_alone, "max_abs_kv_diff": diff, "kl_vs_full": kl(lm, ref_full, child, cont)}
    # -- redact
    a = n // 3
    log(f"{text}: redact tokens [{a}, {a + span})")
    whole = capture(lm, token_ids=ctx)
    wdata = encode(whole, None, preset="lossless").data
    edited = np.concatenate([ctx[:a], ctx[a + span:]])
    t_re, fresh = best(lambda: capture(lm, token_ids=edited), repeats)
    ref_re = continue_logits(lm, fresh, cont)
    red: dict[str, Any] = {"span": [a, a + span], "reprefill_s": t_re, "ratios": {}}
    wdec = decode(wdata)
    for r in ratios:
        t_rep, (ch, info) = best(lambda: redact_cache(lm, decode(wdata), [(a, a + span)], recompute_ratio=r), repeats)
        red["ratios"][f"{r:g}"] = {"kl": kl(lm, ref_re, ch, cont), "edit_s": t_rep, "edit_over_reprefill": t_rep / t_re,
                                   "recomputed_tokens": info["recomputed_tokens"]}
    del wdec
    return {"text": text, "tokens": n, "append": app, "redact": red}


def _scored(lm: Any, data: bytes, ref: torch.Tensor, cont: np.ndarray) -> dict[str, Any]:
    """KL / top-1 of the entry ``data`` against the exact logits ``ref`` over ``cont``, its bits/element and the
    promise its edit log records (None: never edited)."""
    from kvcodec.edit.log import entry_promise
    from kvcodec.accounting import bits_per_element

    with KvcReader(data) as r:
        cache = r.read_cache()
        bits = bits_per_element(len(data), r.header.num_elements)
        edited, promise = entry_promise(r.header.meta)
    q = compare_logits(ref, continue_logits(lm, cache, cont), cont)
    return {"kl": float(q["kl_mean"]), "top1": float(q["top1_agreement"]), "bits_per_element": bits, "edited": edited,
            "promise": promise}


def check_rate_model(lm: Any, preset: str) -> None:
    """Refuse (one line) a lossy preset on a model with no rate model on this machine: encoding would start its
    calibration and rate fit (tens of minutes), which this benchmark must not do behind the caller's back."""
    from kvcodec.calibration.store import calibration_dir

    if PRESETS[preset].lossy and not list(calibration_dir(lm.fingerprint.id).glob("ratemodel-*.json")):
        raise SystemExit(f"{lm.name}: no rate model on this machine yet (kvc calibrate builds it); not starting one")


def run_promise(lm: Any, text: str, n: int, n_app: int, span: int, n_cont: int, preset: str,
                log: Callable[[str], None]) -> dict[str, Any]:
    from kvcodec.edit.append import append
    from kvcodec.edit.redact import redact
    from kvcodec.errors import KvcError

    ids = tokenize(lm.tokenizer, load_text(text))
    if len(ids) < n + n_app + n_cont:
        raise SystemExit(f"{text}: only {len(ids)} tokens, {n + n_app + n_cont} needed")
    lm.warm_up()
    log(f"{text}: {preset} parent of {n} tokens")
    exact = capture(lm, token_ids=ids[:n])
    t = time.perf_counter()
    pdata = encode(exact, None, preset=preset, model=lm).data
    out: dict[str, Any] = {"text": text, "preset": preset, "tokens": n, "encode_s": time.perf_counter() - t}
    out["parent"] = _scored(lm, pdata, continue_logits(lm, exact, ids[n:n + n_cont]), ids[n:n + n_cont])

    def edit(fn: Callable[[], Any], ref: torch.Tensor, cont: np.ndarray) -> dict[str, Any]:
        t = time.perf_counter()
        try:
            res = fn()
        except KvcError as exc:  # a refusal is a result (Gemma's sliding window refuses blend past 512 tokens)
            return {"refused": str(exc)}
        row = _scored(lm, res.data, ref, cont)
        row.update(edit_s=time.perf_counter() - t, repair=res.info.get("repair"), timings=res.timings)
        return row

    new, cont = ids[n:n + n_app], ids[n + n_app:n + n_app + n_cont]
    ref = continue_logits(lm, capture(lm, token_ids=ids[:n + n_app]), cont)
    out["append"] = {"tokens": n_app}
    for repair in ("auto", "incremental"):
        log(f"{text}: append {n_app} tokens, repair={repair}")
        out["append"][repair] = edit(lambda: append(lm, pdata, token_ids=new, repair=repair), ref, cont)
    a = n // 3
    kept, cont = np.concatenate([ids[:a], ids[a + span:n]]), ids[n:n + n_cont]
    ref = continue_logits(lm, capture(lm, token_ids=kept), cont)
    out["redact"] = {"span": [a, a + span]}
    for repair in ("prefill", "blend"):
        log(f"{text}: redact [{a}, {a + span}), repair={repair}")
        out["redact"][repair] = edit(lambda: redact(lm, pdata, token_spans=[(a, a + span)], repair=repair), ref, cont)
    return out


def markdown_promise(model: str, results: list[dict]) -> str:
    def cell(r: dict[str, Any]) -> str:
        if "refused" in r:
            return f"refused: {r['refused']}"
        ok = r["kl"] <= target.kl and r["top1"] >= target.top1
        said = ("not edited" if not r["edited"] else "promise: none" if r["promise"] is None or "none" in r["promise"]
                else f"promise: {r['promise']['preset']}")
        return f"{r['kl']:.4f} / {r['top1']:.3f}{'' if ok else ' ✗'} ({r['bits_per_element']:.2f} b; {said})"

    target = PRESETS[results[0]["preset"]].target
    assert target is not None
    out = [f"**{model}** ({results[0]['preset']}; KL / top-1 against an exact prefill of each entry's own ids)\n",
           "| text | parent | append: auto (default) | append: incremental | redact: prefill (default) | redact: blend |",
           "|---|---|---|---|---|---|"]
    for r in results:
        out.append(f"| {r['text']} | {cell(r['parent'])} | {cell(r['append']['auto'])} | {cell(r['append']['incremental'])} "
                   f"| {cell(r['redact']['prefill'])} | {cell(r['redact']['blend'])} |")
    return "\n".join(out)


def run_steer(lm: Any, a: Any, log: Callable[[str], None]) -> dict[str, Any]:
    from kvcodec.edit.steer import pasta_bias, steer_cache
    from kvcodec.edit.steer_profile import answer_margin, fact_examples, profile_layers

    lm.warm_up()
    from kvcodec.edit.autospans import auto_spans
    from kvcodec.integrations.attn_bias import model_attention_heads

    given = dict(x.split("=") for x in a.layers.split(";") if x.strip()).get(lm.name) if a.layers else None
    t0 = time.perf_counter()
    if given:  # layers chosen by an earlier profiling run (BENCHMARKS.md): skip the 12-minute profile
        layers = sorted(int(x) for x in given.split(","))
        prof = {"layers": layers, "heads": [[la, h] for la in layers for h in range(model_attention_heads(lm))],
                "examples": 0, "given": True}
    else:
        prof_ex = fact_examples(lm.tokenizer, a.profile_texts.split(","), a.profile_examples, seed=1)
        log(f"steer: profiling {lm.fingerprint.num_layers} layers on {len(prof_ex)} examples")
        prof = profile_layers(lm, prof_ex, top=a.top_layers)
    t_prof = time.perf_counter() - t0
    ev = fact_examples(lm.tokenizer, a.eval_texts.split(","), a.eval_examples, seed=2)
    log(f"steer: evaluating heads of layers {prof['layers']} on {len(ev)} examples")
    m0, m1, m2, t_plain, t_steer, t_auto, hits = [], [], [], [], [], [], []
    for ex in ev:
        t = time.perf_counter()
        c = capture(lm, token_ids=ex.context)
        t_plain.append(time.perf_counter() - t)
        m0.append(answer_margin(lm, c, ex))
        if prof["heads"]:
            bias = pasta_bias(lm, prof["heads"], [ex.span], len(ex.context))
            t = time.perf_counter()
            sc = steer_cache(lm, ex.context, bias)
            t_steer.append(time.perf_counter() - t)
            m1.append(answer_margin(lm, sc, ex, bias))
            if a.auto_spans:  # the query-independent scorer chooses the spans (kvcodec.edit.autospans)
                t = time.perf_counter()
                spans = auto_spans(lm, ex.context, a.auto_spans)
                t_auto.append(time.perf_counter() - t)
                hits.append(any(s0 <= ex.span[0] < s1 for s0, s1 in spans))
                bias = pasta_bias(lm, prof["heads"], spans, len(ex.context))
                m2.append(answer_margin(lm, steer_cache(lm, ex.context, bias), ex, bias))
    return {"profile": prof, "profile_s": t_prof, "eval_examples": len(ev),
            "context_tokens_mean": float(np.mean([len(e.context) for e in ev])),
            "accuracy_prefill": float(np.mean([m > 0 for m in m0])), "margin_prefill": float(np.mean(m0)),
            "accuracy_steered": float(np.mean([m > 0 for m in m1])) if m1 else None,
            "margin_steered": float(np.mean(m1)) if m1 else None,
            "steer_over_prefill_time": float(np.sum(t_steer) / np.sum(t_plain)) if t_steer else None,
            "auto_spans": a.auto_spans, "accuracy_auto": float(np.mean([m > 0 for m in m2])) if m2 else None,
            "margin_auto": float(np.mean(m2)) if m2 else None, "auto_hits_asked_fact": float(np.mean(hits)) if hits else None,
            "auto_scorer_over_prefill_time": float(np.sum(t_auto) / np.sum(t_plain)) if t_auto else None,
            "margins": {"prefill": m0, "steered": m1, "auto": m2}}


def markdown_steer(model: str, r: dict[str, Any]) -> str:
    p = r["profile"]
    acc = "n/a (no layer gained)" if r["accuracy_steered"] is None else f"{r['accuracy_steered']:.1%}"
    return (f"**{model}** steer: layers {p['layers']} ({len(p['heads'])} heads, profiled on {p['examples']} examples in "
            f"{r['profile_s']:.0f} s); {r['eval_examples']} eval examples of ~{r['context_tokens_mean']:.0f} tokens: "
            f"accuracy prefill {r['accuracy_prefill']:.1%} (margin {r['margin_prefill']:.2f}) -> steered {acc} "
            f"(margin {r['margin_steered'] if r['margin_steered'] is None else round(r['margin_steered'], 2)}); "
            f"steer edit time / prefill {r['steer_over_prefill_time'] if r['steer_over_prefill_time'] is None else round(r['steer_over_prefill_time'], 2)}"
            + ("" if r.get("accuracy_auto") is None else
               f"; auto spans (top {r['auto_spans']} sentences, asked fact among them in {r['auto_hits_asked_fact']:.1%}): "
               f"accuracy {r['accuracy_auto']:.1%} (margin {r['margin_auto']:.2f}), scorer time / prefill "
               f"{r['auto_scorer_over_prefill_time']:.2f}"))


def markdown(model: str, results: list[dict], target: float) -> str:
    out = [f"**{model}**\n", "| text | append: edit / full prefill | new tokens over cache / alone | max abs K/V diff | KL vs full |",
           "|---|---|---|---|---|"]
    for r in results:
        p = r["append"]
        out.append(f"| {r['text']} | {p['edit_over_full']:.2f} | {p['prefill_new_over_alone']:.2f} | {p['max_abs_kv_diff']:.1e} "
                   f"| {p['kl_vs_full']:.1e} |")
    ratios = list(results[0]["redact"]["ratios"])
    out += ["", "| text | " + " | ".join(f"redact r={x}: KL / time vs re-prefill" for x in ratios) + " |",
            "|---|" + "---|" * len(ratios)]
    for r in results:
        cells = [f"{v['kl']:.4f}{'' if v['kl'] <= target else ' ✗'} / {v['edit_over_reprefill']:.2f}"
                 for v in r["redact"]["ratios"].values()]
        out.append(f"| {r['text']} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--models", default="smollm2,gemma3-270m")
    ap.add_argument("--texts", default="apache2,changelog-apt,py-argparse", help="held-out kvcodec.texts names")
    ap.add_argument("--tokens", type=int, default=448, help="context tokens (under Gemma 3's 512 window: redact needs every token)")
    ap.add_argument("--append-tokens", dest="append_tokens", type=int, default=64)
    ap.add_argument("--span-tokens", dest="span_tokens", type=int, default=48)
    ap.add_argument("--continuation-tokens", dest="continuation_tokens", type=int, default=32)
    ap.add_argument("--ratios", default="0,0.05,0.1,0.2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--parts", default="append,redact,steer", help="which edits to measure (also: promise)")
    ap.add_argument("--preset", default="balanced", help="the promise part's parent preset")
    ap.add_argument("--profile-texts", dest="profile_texts", default="apache2,changelog-apt")
    ap.add_argument("--profile-examples", dest="profile_examples", type=int, default=6)
    ap.add_argument("--eval-texts", dest="eval_texts", default="py-argparse,c-stdio,pydoc-exec")
    ap.add_argument("--eval-examples", dest="eval_examples", type=int, default=24)
    ap.add_argument("--top-layers", dest="top_layers", type=int, default=3)
    ap.add_argument("--layers", default="", help="skip profiling: steered layers per model, 'smollm2=20,23,24;gemma3-270m=11,12,17'")
    ap.add_argument("--auto-spans", dest="auto_spans", type=int, default=4,
                    help="also steer the top K sentences of kvcodec.edit.autospans (0: skip)")
    ap.add_argument("--json", dest="as_json", action="store_true")
    run = harness.cli(ap, argv, case="edit")
    a = run.args
    if a.threads:
        torch.set_num_threads(a.threads)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    ratios = [float(x) for x in a.ratios.split(",") if x.strip()]
    target = float(PRESETS["balanced"].target.kl)  # type: ignore[union-attr]
    parts = {p.strip() for p in a.parts.split(",") if p.strip()}
    by_model: dict[str, list[dict]] = {}
    steered: dict[str, dict] = {}
    promised: dict[str, list[dict]] = {}
    for name in [m.strip() for m in a.models.split(",") if m.strip()]:
        lm = load_model(name)
        if "promise" in parts:
            check_rate_model(lm, a.preset)
            promised[name] = [run_promise(lm, t.strip(), a.tokens, a.append_tokens, a.span_tokens, a.continuation_tokens,
                                          a.preset, log) for t in a.texts.split(",") if t.strip()]
        if parts & {"append", "redact"}:
            by_model[name] = [run_text(lm, t.strip(), a.tokens, a.append_tokens, a.span_tokens, a.continuation_tokens,
                                       ratios, a.repeats, log) for t in a.texts.split(",") if t.strip()]
        if "steer" in parts:
            steered[name] = run_steer(lm, a, log)
    env = {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "load_avg": os.getloadavg(),
           "platform": platform.platform(), "torch": torch.__version__, "kl_target": target}
    if a.as_json:
        print(json.dumps({"env": env, "models": by_model, "steer": steered, "promise": promised}, indent=2))
    else:
        for name, res in promised.items():
            print(markdown_promise(name, res) + "\n")
        for name, res in by_model.items():
            print(markdown(name, res, target) + "\n")
        for name, st in steered.items():
            print(markdown_steer(name, st) + "\n")
        print(f"CPU, {env['torch_threads']} torch thread(s), load average at end {env['load_avg'][0]:.2f} (shared machine); "
              f"minimum of {a.repeats} interleaved runs (the promise part: one run); ✗: outside the preset's promise.")
    run.emit({"env": env, "models": by_model, "steer": steered, "promise": promised})


if __name__ == "__main__":
    main()
