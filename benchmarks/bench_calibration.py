"""Calibration cost per phase, and quality of the presets with a new vs a reference calibration (issue 21).

Builds the model's calibration with :func:`kvcodec.quant.calibrate.build_calibration`
(timing each phase: corpus captures, moment accumulation, PCA, Fisher
sensitivity), then encodes real 2048-token caches with each preset under both
the new calibration and a reference calibration file (``--reference``, e.g. one
built by an earlier version), and evaluates them against the exact cache on the
following tokens with the library's evaluator (what ``kvc eval`` reports).
Both calibrations are embedded in the encoded bytes (``calibration="embedded"``)
so decoding needs no lookup; the bits/element column counts the `.kvc` without
the embedded bases (what a file referencing the calibration externally holds).

    python benchmarks/bench_calibration.py --reference OLD.safetensors --texts gpl3,lgpl21 --json out.json
    python benchmarks/bench_calibration.py --model /path/to/hf-dir --texts gpl3   # cost for another model

``--save PATH`` writes the new calibration file (the shipped one is built by
scripts/build_calibration.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvcodec.capture import capture, tokenize  # noqa: E402
from kvcodec.evaluate import continue_logits, evaluate, greedy  # noqa: E402
from kvcodec.model import load_model  # noqa: E402
from kvcodec.quant import calibrate as C  # noqa: E402
from kvcodec.quant import presets as P  # noqa: E402
from kvcodec.texts import load_text  # noqa: E402


def load_reference(path: Path, fingerprint_id: str) -> C.Calibration:
    """A calibration file of this model from any recipe or file version (v1 files predate fingerprint v2).

    Read without the v2 loader's identity checks, which a v1 file cannot pass,
    and bound to this model's id: the caller vouches that it is this model's.
    """
    from safetensors.numpy import load_file

    t = load_file(str(path))
    return C.Calibration(t["pca.basis"], t["pca.mean"], t["pca.eigval"], t["sens.kl_per_mse"],
                         {"fingerprint_id": fingerprint_id, "reference": str(path)}, path)


def quality_rows(lm, cals: dict[str, C.Calibration], texts: list[str], presets: list[str], ctx: int, cont: int) -> list[dict]:
    from kvcodec.quant.importance import cache_importance

    rows = []
    for name in texts:
        ids = tokenize(lm.tokenizer, load_text(name))
        cache = capture(lm, token_ids=ids[:ctx])
        follow = ids[ctx : ctx + cont]
        exact_logits = continue_logits(lm, cache, follow)
        exact_greedy = greedy(lm, cache, int(follow[0]), 16)
        imp = cache_importance(lm, cache, window=P.TOKENSCALE_DEFAULT["window"])
        for preset in presets:
            for label, cal in cals.items():
                plan = P.get_plan(preset, cache, lm=lm, cal=cal, calibration="embedded", importance=imp)
                data = P.encode_bytes(cache, plan)
                emb = sum(a.nbytes for a in plan.attachments.values())
                q = evaluate(lm, cache, P.decode_bytes(data), follow, exact_logits=exact_logits, exact_greedy=exact_greedy)
                row = {"text": name, "preset": preset, "calibration": label,
                       "bits_per_element": (len(data) - emb) * 8 / cache.num_elements, **q.to_json()}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--reference", default=None, help="reference calibration file to compare quality with")
    ap.add_argument("--texts", default="gpl3,lgpl21", help="evaluation texts (none: cost only)")
    ap.add_argument("--presets", default="balanced,small")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--continuation", type=int, default=256)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--save", default=None, help="write the new calibration here")
    ap.add_argument("--json", dest="json_out", default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lm = load_model(args.model)
    cfg = lm.model.config.get_text_config()
    timings: dict[str, float] = {}
    cal = C.build_calibration(lm, timings=timings)
    params = sum(p.numel() for p in lm.model.parameters())
    print(f"\ncalibration of {args.model}: {params / 1e6:.0f}M parameters, {cfg.num_hidden_layers} layers, "
          f"torch threads {torch.get_num_threads()}, load average {os.getloadavg()[0]:.1f}")
    print("| phase | seconds |\n|---|---|")
    for k, v in timings.items():
        print(f"| {k[:-2]} | {v:.1f} |")
    if args.save:
        C.write_calibration_file(cal, lm.fingerprint.id, Path(args.save))
    cals = {"new": cal}
    if args.reference:
        cals["reference"] = load_reference(Path(args.reference), lm.fingerprint.id)
        ref, new = np.log(cals["reference"].sensitivity.ravel()), np.log(cal.sensitivity.ravel())
        print(f"\nsensitivity vs reference: corr(log) {np.corrcoef(ref, new)[0, 1]:.3f}, "
              f"implied step ratio new/ref (after the presets' geometric-mean normalisation) "
              f"{np.exp(-0.5 * ((new - new.mean()) - (ref - ref.mean()))).min():.2f} .. "
              f"{np.exp(-0.5 * ((new - new.mean()) - (ref - ref.mean()))).max():.2f}")
    texts = [t for t in args.texts.split(",") if t]
    rows = quality_rows(lm, cals, texts, args.presets.split(","), args.tokens, args.continuation) if texts else []
    if rows:
        print(f"\n| text | preset | calibration | bits/el | KL | dPPL % | top-1 |\n|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['text']} | {r['preset']} | {r['calibration']} | {r['bits_per_element']:.3f} | {r['kl_mean']:.4f} | "
                  f"{r['dppl_percent']:+.2f} | {r['top1_agreement']:.3f} |")
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({
            "model": args.model, "parameters": params, "layers": int(cfg.num_hidden_layers), "timings": timings,
            "torch_threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
