"""Size / quality of kvcodec's lossy presets on real caches (issue 4 table).

    python benchmarks/bench_codec.py                       # presets x DEFAULT_BENCH_TEXTS
    python benchmarks/bench_codec.py --texts gpl3 --sweep 0.05,0.1,0.2   # rate frontier
    python benchmarks/bench_codec.py --calibration embedded --basis hadamard ...
    python benchmarks/bench_codec.py --texts gpl3 --sweep 0.3,0.4 --tokenscale '{"max_log2": 2}'   # sweep with tokenscale
    python benchmarks/bench_codec.py --no-tokenscale        # presets with uniform per-token steps

Presets with ``tokenscale`` score the context once per text (one extra
prefill, included in no timing column) and reuse the importance for all runs.

Captures (``--tokens`` 2048-token contexts + ``--continuation`` 256-token continuations) are cached in
$KVC_BENCH_CACHE (default /tmp/kvc-cache). Bits/element = real `.kvc` bytes x 8
/ KV elements; "+ext" also counts the external per-model calibration bytes
(amortised over one file, i.e. the worst case).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np
import torch

import harness
from common import CACHE_DIR
from kvcodec.atomic import atomic_write_text  # noqa: E402
from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.models.quality import continue_logits, evaluate, greedy  # noqa: E402
from kvcodec.core.kvcache import load_h5, save_h5  # noqa: E402
from kvcodec.models.load import load_model  # noqa: E402
from kvcodec.format import KvcReader, encode_kvc_bytes  # noqa: E402
from kvcodec.plan import pipelines as P  # noqa: E402
from kvcodec.calibration.build import ensure_calibration  # noqa: E402
from kvcodec.plan.presets import PRESETS  # noqa: E402
from kvcodec.accounting import bits_per_element  # noqa: E402
from kvcodec.texts import DEFAULT_BENCH_TEXTS, load_text  # noqa: E402


def get_capture(lm, name: str, ctx: int = 2048, cont: int = 256):
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    h5, cn = CACHE_DIR / f"{name}-{ctx}.h5", CACHE_DIR / f"{name}-{ctx}-cont.npy"
    if h5.exists() and cn.exists() and len(np.load(cn)) >= cont:
        c = load_h5(h5)
        if c.fingerprint.same_model(lm.fingerprint):
            return c, np.load(cn)[:cont]
    ids = tokenize(lm.tokenizer, load_text(name))
    c = capture(lm, token_ids=ids[:ctx])
    save_h5(c, h5)
    np.save(cn, ids[ctx : ctx + cont])
    return c, ids[ctx : ctx + cont]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--texts", default=",".join(DEFAULT_BENCH_TEXTS))
    ap.add_argument("--presets", default="near-lossless,balanced,small")
    ap.add_argument("--sweep", default="", help="comma-separated step0 values instead of presets")
    ap.add_argument("--calibration", default="external", choices=["external", "embedded"])
    ap.add_argument("--basis", default="pca", choices=["pca", "hadamard"])
    ap.add_argument("--group", type=int, default=None)
    ap.add_argument("--sink", type=int, default=None)
    ap.add_argument("--deadzone", type=float, default=None)
    ap.add_argument("--tokenscale", default="", help="JSON tokenscale options for --sweep runs (default: off)")
    ap.add_argument("--no-tokenscale", action="store_true", help="drop tokenscale from the presets")
    ap.add_argument("--greedy", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=2048, help="context tokens")
    ap.add_argument("--continuation", type=int, default=256, help="tokens scored after the context")
    ap.add_argument("--json", default="")
    run = harness.cli(ap, argv, case="codec")
    a = run.args
    torch.set_num_threads(int(os.environ.get("KVC_THREADS", "1")))
    lm = load_model()
    cal = ensure_calibration(lm)
    rows = []
    for text in a.texts.split(","):
        cache, cont = get_capture(lm, text, a.tokens, a.continuation)
        ex_logits = continue_logits(lm, cache, cont)
        ex_greedy = greedy(lm, cache, int(cont[0]), a.greedy) if a.greedy else None
        ts_sweep = json.loads(a.tokenscale) if a.tokenscale else None
        runs = [(f"step0={s}", {"step0": float(s), "tokenscale": ts_sweep}) for s in a.sweep.split(",") if s] or \
            [(p, dict(PRESETS[p].settings)) for p in a.presets.split(",")]
        importance = None
        for label, args in runs:
            args.update({k: v for k, v in (("group", a.group), ("sink", a.sink), ("deadzone", a.deadzone)) if v is not None})
            if a.no_tokenscale:
                args.pop("tokenscale", None)
            if args.get("tokenscale") is not None:
                if importance is None:
                    from kvcodec.models.importance import cache_importance

                    importance = cache_importance(lm, cache, window={**P.TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"])
                args["importance"] = importance
            with harness.stopwatch(cpu=None) as sw_enc:
                plan = P.transform_plan(cache, cal=cal, calibration=a.calibration, basis=a.basis, preset=label, **args)
                data = encode_kvc_bytes(cache, plan, meta={"plan": plan.params})
            with harness.stopwatch(cpu=None) as sw_dec:
                dec = KvcReader(data).read_cache()
            t_enc, t_dec = sw_enc.wall, sw_dec.wall
            q = evaluate(lm, cache, dec, cont, greedy_tokens=a.greedy, exact_logits=ex_logits, exact_greedy=ex_greedy)
            ext = P.external_bytes(plan)
            row = {"text": text, "preset": label, "basis": a.basis, "calibration": a.calibration if a.basis == "pca" else "none",
                   "bytes": len(data), "bits_per_element": bits_per_element(len(data), cache.num_elements),
                   "bits_per_element_with_ext": bits_per_element(len(data) + ext, cache.num_elements), "ext_bytes": ext,
                   "kl": q.kl_mean, "dppl_percent": q.dppl_percent, "top1": q.top1_agreement, "greedy": q.greedy_match,
                   "encode_s": t_enc, "decode_s": t_dec, **{k: v for k, v in plan.params.items() if k not in ("basis", "calibration")}}
            rows.append(row)
            print(f"{text:7s} {label:14s} {row['bits_per_element']:.3f} b/e (+ext {row['bits_per_element_with_ext']:.3f})  KL {q.kl_mean:.2e}  "
                  f"dPPL {q.dppl_percent:+.3f}%  top1 {q.top1_agreement:.3f}  greedy {q.greedy_match:.2f}  enc {t_enc:.2f}s dec {t_dec:.2f}s", flush=True)
    if a.json:
        atomic_write_text(a.json, json.dumps(rows, indent=1, default=str))
    run.emit({"rows": rows})


if __name__ == "__main__":
    main()
