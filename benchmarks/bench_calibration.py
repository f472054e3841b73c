"""Calibration cost per phase, and quality of the presets with a new vs a reference calibration (issue 21).

Builds the model's calibration with :func:`kvcodec.calibration.build.build_calibration`
(timing each phase: corpus captures, moment accumulation, PCA, Fisher
sensitivity), then encodes real 2048-token caches with each preset under both
the new calibration and a reference calibration file (``--reference``, e.g. one
built by an earlier version), and evaluates them against the exact cache on the
following tokens with the library's evaluator (what ``kvc eval`` reports).
Both calibrations are embedded in the encoded bytes (``calibration="embedded"``)
so decoding needs no lookup; the bits/element column counts the `.kvc` without
the embedded bases (what a file referencing the calibration externally holds).

    python benchmarks/bench_calibration.py --reference OLD.safetensors --texts gpl3,lgpl21 --json out.json
    python benchmarks/bench_calibration.py --model /path/to/hf-dir --texts ''     # cost for another model
    python benchmarks/bench_calibration.py --new kvcodec/data/calibration/<id>.safetensors --reference OLD --rate-match

``--new FILE`` evaluates that calibration instead of building one (no cost
table); ``--new shipped`` takes the calibration stored for the model (shipped in
the package for the embedded model). ``--rate-match`` also encodes with the new calibration at 0.85 x the
preset's step0 and reports the new calibration's KL / dPPL interpolated (KL in
log space, linearly in bits/element) at the reference's bits/element: presets
land at slightly different rates under different calibrations, and quality is
only comparable at equal rate.

``--sweep 0.5,0.7,1,1.4,2`` encodes each preset at those multiples of its table step with both calibrations and
reports the bits new / reference at equal KL (each sweep joined log-log; the mean over the KL range both cover,
and the ratio at ``--kl-at``): the comparison for a calibration that moves the rate-quality curve, where one
table step lands each calibration at another point of it.

``--reference-cost`` also times, in the same run, the unit costs of the earlier
recipe (one 2048-token prefill; one 128-token continuation forward over a
2048-token cache, i.e. one noise probe) and reports its estimated total: 4
prefills (3 corpus captures + the query-moment pass) + 2L + 1 probes, the PCA
phase taken as measured for the new recipe.

``--allocate RATEMODEL.json`` compares the calibration (``--new``'s, or the built one) with the per-(layer, kind)
sensitivities that rate model measured (:meth:`kvcodec.calibration.ratemodel.RateModel.allocated`: same bases,
steps allocated by the measured slopes) as "new" against itself unchanged as "reference" (issue 38, lever 1).

``--save PATH`` writes the new calibration file (the shipped one is built by
scripts/build_calibration.py).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import torch

import harness

from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.models.quality import continue_logits, evaluate, greedy  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.calibration import build as C_build
from kvcodec.calibration import record as C_record
from kvcodec.calibration import store as C_store
from kvcodec.plan.presets import get_plan  # noqa: E402
from kvcodec.format import KvcReader, encode_kvc_bytes  # noqa: E402
from kvcodec.plan import pipelines as P  # noqa: E402
from kvcodec.plan.presets import PRESETS  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402


def load_reference(path: Path, fingerprint_id: str) -> C_record.Calibration:
    """A calibration file of this model from any recipe or file version (v1 files predate fingerprint v2).

    Read without the v2 loader's identity checks, which a v1 file cannot pass,
    and bound to this model's id: the caller vouches that it is this model's.
    """
    from safetensors.numpy import load_file

    from kvcodec.errors import KvcError

    try:
        return C_store.load_calibration_file(path, fingerprint_id)  # versions 2 and 3, checked
    except KvcError:
        pass
    t = load_file(str(path))
    return C_record.Calibration(t["pca.basis"], t["pca.mean"], t["pca.eigval"], t["sens.kl_per_mse"],
                         {"fingerprint_id": fingerprint_id, "reference": str(path)}, path)


def reference_cost(lm, timings: dict[str, float], repeats: int = 2) -> dict[str, float]:
    """Unit costs of both recipes measured now, side by side, and the earlier recipe's estimated total.

    Earlier recipe: 4 prefills of 2048 tokens (3 corpus captures + the query-moment pass) + 2L + 1 noise
    probes (a 128-token continuation over the 2048-token cache each). New recipe, for comparison at the
    same moment: 3 prefills of 1024 tokens + the Fisher pass (one forward, SENS_SAMPLES backward passes).
    The PCA/moment phases (no model passes) are added as measured for the new recipe when it was built.
    """
    ids = tokenize(lm.tokenizer, load_text("gpl3"))
    with harness.stopwatch(cpu=None) as sw:
        cache = capture(lm, token_ids=ids[:2048])
    t_pre = sw.wall
    cont = ids[2048:2048 + C_record.SENS_CONTINUATION]
    probe = harness.timeit(lambda: continue_logits(lm, cache, cont), repeats, cpu=None).median
    with harness.stopwatch(cpu=None) as sw:
        small = capture(lm, token_ids=ids[:1024])
    t_pre1k = sw.wall
    with harness.stopwatch(cpu=None) as sw:
        C_build.measure_sensitivity(lm, small, ids[1024:1024 + C_record.SENS_CONTINUATION])
    t_fisher = sw.wall
    n = 2 * lm.fingerprint.num_layers + 1
    rest = timings.get("pca_s", 0.0) + timings.get("moments_s", 0.0)
    out = {"prefill_2048_s": t_pre, "probe_s": probe, "probes": n, "captures_s": 4 * t_pre, "probes_s": n * probe,
           "prefill_1024_s": t_pre1k, "fisher_s": t_fisher, "new_model_passes_s": 3 * t_pre1k + t_fisher}
    out["total_s"] = out["captures_s"] + out["probes_s"] + rest
    out["old_model_passes_s"] = out["captures_s"] + out["probes_s"]
    return out


def quality_rows(lm, cals: dict[str, C_record.Calibration], texts: list[str], presets: list[str], ctx: int, cont: int,
                 rate_match: bool = False, sweep: tuple[float, ...] = (1.0,)) -> list[dict]:
    from kvcodec.models.importance import cache_importance

    rows = []
    for name in texts:
        ids = tokenize(lm.tokenizer, load_text(name))
        cache = capture(lm, token_ids=ids[:ctx])
        follow = ids[ctx : ctx + cont]
        exact_logits = continue_logits(lm, cache, follow)
        exact_greedy = greedy(lm, cache, int(follow[0]), 16)
        imp = cache_importance(lm, cache, window=P.TOKENSCALE_DEFAULT["window"])
        for preset in presets:
            runs = [(label, cal, m) for label, cal in cals.items() for m in sweep]
            if rate_match:
                runs.append(("new@0.85", cals["new"], 0.85))
            for label, cal, scale in runs:
                step0 = PRESETS[preset].settings["step0"] * scale
                plan = get_plan(preset, cache, lm=lm, cal=cal, calibration="embedded", importance=imp, step0=step0)
                data = encode_kvc_bytes(cache, plan, meta={"plan": plan.params})
                emb = sum(a.nbytes for a in plan.attachments.values())
                q = evaluate(lm, cache, KvcReader(data).read_cache(), follow, exact_logits=exact_logits, exact_greedy=exact_greedy)
                row = {"text": name, "preset": preset, "calibration": label, "step_scale": scale,
                       "bits_per_element": (len(data) - emb) * 8 / cache.num_elements, **q.to_json()}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def rate_matched(rows: list[dict]) -> list[dict]:
    """The new calibration's KL (log-linear) and dPPL (linear) interpolated in bits/element at the reference's rate."""
    out = []
    for text in dict.fromkeys(r["text"] for r in rows):
        for preset in dict.fromkeys(r["preset"] for r in rows):
            got = {r["calibration"]: r for r in rows if r["text"] == text and r["preset"] == preset}
            if not {"reference", "new", "new@0.85"} <= set(got):
                continue
            a, b, ref = got["new"], got["new@0.85"], got["reference"]
            t = (ref["bits_per_element"] - a["bits_per_element"]) / (b["bits_per_element"] - a["bits_per_element"])
            out.append({"text": text, "preset": preset, "bits_per_element": ref["bits_per_element"], "t": t,
                        "kl_reference": ref["kl_mean"], "dppl_reference": ref["dppl_percent"],
                        "kl_new": float(np.exp(np.log(a["kl_mean"]) + t * (np.log(b["kl_mean"]) - np.log(a["kl_mean"])))),
                        "dppl_new": a["dppl_percent"] + t * (b["dppl_percent"] - a["dppl_percent"])})
    return out


def equal_kl(rows: list[dict], kl_at: float = 0.01, points: int = 21) -> list[dict]:
    """Bits new / reference at equal KL per (text, preset), from ``--sweep``'s step scales.

    Each calibration's Pareto frontier of (bits, KL) is joined log-log (:func:`kvcodec.eval.curve.bits_at_kl`);
    ``ratio_mean`` is the geometric mean of the bits ratio over ``points`` KL values spanning, evenly in log KL, the
    range both frontiers cover (the codec literature's BD-rate, here over KL), ``ratio_at`` the ratio at
    KL = ``kl_at`` (None outside either range), with the bits there.
    """
    from kvcodec.eval.curve import bits_at_kl, pareto

    out = []
    for text in dict.fromkeys(r["text"] for r in rows):
        for preset in dict.fromkeys(r["preset"] for r in rows):
            sel = [r for r in rows if r["text"] == text and r["preset"] == preset]
            new, ref = (pareto([(r["bits_per_element"], r["kl_mean"]) for r in sel if r["calibration"] == c and r["kl_mean"] > 0])
                        for c in ("new", "reference"))
            if len(new) < 2 or len(ref) < 2:
                continue
            lo = max(min(k for _, k in new), min(k for _, k in ref))
            hi = min(max(k for _, k in new), max(k for _, k in ref))
            if hi <= lo:
                continue
            grid = np.exp(np.linspace(math.log(lo), math.log(hi), points))
            grid[0], grid[-1] = lo, hi  # the ends exactly: exp(log(k)) may miss a frontier point by an ulp
            d = [math.log(n / r) for kl in grid
                 if (n := bits_at_kl(new, float(kl))) is not None and (r := bits_at_kl(ref, float(kl))) is not None]
            a_new, a_ref = bits_at_kl(new, kl_at), bits_at_kl(ref, kl_at)
            out.append({"text": text, "preset": preset, "kl_range": [lo, hi],
                        "ratio_mean": float(np.exp(np.mean(d))),
                        "ratio_at": None if a_new is None or a_ref is None else a_new / a_ref,
                        "kl_at": kl_at, "bits_new_at": a_new, "bits_reference_at": a_ref})
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--reference", default=None, help="reference calibration file to compare quality with")
    ap.add_argument("--new", dest="new_file", default=None,
                    help="evaluate this calibration file instead of building one ('shipped': the one stored for the model)")
    ap.add_argument("--rate-match", action="store_true", help="also compare at the reference's bits/element (needs --reference)")
    ap.add_argument("--sweep", default=None, help="step scales, e.g. 0.5,0.7,1,1.4,2: encode each preset at these x its "
                    "table step with both calibrations and compare bits at equal KL (needs --reference)")
    ap.add_argument("--kl-at", type=float, default=0.01, help="the KL at which --sweep also reports the bits ratio")
    ap.add_argument("--texts", default="gpl3,lgpl21", help="evaluation texts (none: cost only)")
    ap.add_argument("--presets", default="balanced,small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--allocate", default=None, help="a rate model file: compare the calibration with its measured "
                    "per-layer sensitivities (new) against without (reference)")
    ap.add_argument("--save", default=None, help="write the new calibration here")
    ap.add_argument("--reference-cost", action="store_true", help="time both recipes' model passes in this run")
    ap.add_argument("--json", dest="json_out", default=None)
    run = harness.cli(ap, argv, case="calibration")
    args = run.args
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    cfg = lm.model.config.get_text_config()
    timings: dict[str, float] = {}
    if args.new_file == "shipped":
        cal = C_store.load_calibration(lm.fingerprint.id)
        if cal is None:
            raise SystemExit(f"no calibration is stored for {args.model} (kvc calibrate -m {args.model})")
    elif args.new_file:
        cal = C_store.load_calibration_file(Path(args.new_file), lm.fingerprint.id)
    else:
        cal = C_build.build_calibration(lm, timings=timings)
    params = sum(p.numel() for p in lm.model.parameters())
    if timings:
        print(f"\ncalibration of {args.model}: {params / 1e6:.0f}M parameters, {cfg.num_hidden_layers} layers, "
              f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
        print("| phase | seconds |\n|---|---|")
        for k, v in timings.items():
            print(f"| {k[:-2]} | {v:.1f} |")
    ref_cost = reference_cost(lm, timings) if args.reference_cost else None
    if ref_cost:
        vs = (f" vs {timings['total_s']:.0f} s measured for the new recipe ({ref_cost['total_s'] / timings['total_s']:.1f}x)"
              if timings else "")
        print(f"\nearlier recipe, estimated from unit costs measured in this run: prefill of 2048 tokens "
              f"{ref_cost['prefill_2048_s']:.1f} s, one noise probe {ref_cost['probe_s']:.1f} s -> "
              f"{ref_cost['captures_s']:.0f} s captures + {ref_cost['probes_s']:.0f} s for {ref_cost['probes']} probes "
              f"= {ref_cost['total_s']:.0f} s total{vs}")
        print(f"model passes only, same moment: earlier recipe {ref_cost['old_model_passes_s']:.0f} s vs new recipe "
              f"{ref_cost['new_model_passes_s']:.0f} s (3 prefills of 1024 tokens {3 * ref_cost['prefill_1024_s']:.0f} s + "
              f"Fisher pass {ref_cost['fisher_s']:.0f} s): {ref_cost['old_model_passes_s'] / ref_cost['new_model_passes_s']:.1f}x")
    if args.save:
        C_store.write_calibration_file(cal, lm.fingerprint.id, Path(args.save))
    cals = {"new": cal}
    if args.allocate:
        from kvcodec.calibration.ratemodel import RateModel

        rm = RateModel.from_json(json.loads(Path(args.allocate).read_text()), args.allocate)
        if rm.calibration_sha256 != cal.meta.get("content_sha256") or rm.layer_factor is None:
            raise SystemExit(f"{args.allocate}: not fitted with this calibration, or it has no layer factors")
        cals = {"new": rm.allocated(cal), "reference": cal}
    elif args.reference:
        cals["reference"] = load_reference(Path(args.reference), lm.fingerprint.id)
        ref, new = np.log(cals["reference"].sensitivity.ravel()), np.log(cal.sensitivity.ravel())
        print(f"\nsensitivity vs reference: corr(log) {np.corrcoef(ref, new)[0, 1]:.3f}, "
              f"implied step ratio new/ref (after the presets' geometric-mean normalisation) "
              f"{np.exp(-0.5 * ((new - new.mean()) - (ref - ref.mean()))).min():.2f} .. "
              f"{np.exp(-0.5 * ((new - new.mean()) - (ref - ref.mean()))).max():.2f}")
    texts = [t for t in args.texts.split(",") if t]
    rows = quality_rows(lm, cals, texts, args.presets.split(","), args.tokens, args.continuation,
                        rate_match=args.rate_match and "reference" in cals,
                        sweep=tuple(float(x) for x in args.sweep.split(",")) if args.sweep else (1.0,)) if texts else []
    if rows:
        print("\n| text | preset | calibration | bits/el | KL | dPPL % | top-1 |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['text']} | {r['preset']} | {r['calibration']} | {r['bits_per_element']:.3f} | {r['kl_mean']:.4f} | "
                  f"{r['dppl_percent']:+.2f} | {r['top1_agreement']:.3f} |")
    matched = rate_matched(rows) if args.rate_match else []
    if matched:
        print("\nat equal rate (new calibration interpolated to the reference's bits/element):\n")
        print("| text | preset | bits/el | KL reference | KL new | dPPL % reference | dPPL % new |\n|---|---|---|---|---|---|---|")
        for m in matched:
            print(f"| {m['text']} | {m['preset']} | {m['bits_per_element']:.3f} | {m['kl_reference']:.4f} | {m['kl_new']:.4f} | "
                  f"{m['dppl_reference']:+.2f} | {m['dppl_new']:+.2f} |")
    eq = equal_kl(rows, args.kl_at) if args.sweep and "reference" in cals else []
    if eq:
        print(f"\nbits new / reference at equal KL (step scales {args.sweep}):\n")
        print(f"| text | preset | KL range compared | ratio, mean over the range | ratio at KL {args.kl_at:g} | bits at KL {args.kl_at:g}: "
              "reference → new |\n|---|---|---|---|---|---|")
        for e in eq:
            at = "n/a" if e["ratio_at"] is None else f"{e['ratio_at']:.3f}"
            bits = ("n/a" if e["ratio_at"] is None else f"{e['bits_reference_at']:.3f} → {e['bits_new_at']:.3f}")
            print(f"| {e['text']} | {e['preset']} | {e['kl_range'][0]:.2g}–{e['kl_range'][1]:.2g} | {e['ratio_mean']:.3f} | {at} | {bits} |")
        for preset in dict.fromkeys(e["preset"] for e in eq):
            rs = [e["ratio_mean"] for e in eq if e["preset"] == preset]
            print(f"\n{preset}: geometric mean of the per-text ratios {math.exp(np.mean(np.log(rs))):.3f} over {len(rs)} texts")
    doc = {"equal_kl": eq, "rate_matched": matched, "model": args.model, "parameters": params, "layers": int(cfg.num_hidden_layers),
           "timings": timings, "reference_cost": ref_cost, "torch_threads": torch.get_num_threads(), "rows": rows}
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({**doc, "cpu": harness.machine()["cpu"]}, indent=2))
    run.emit(doc)


if __name__ == "__main__":
    main()
