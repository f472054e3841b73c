"""The main job (``kvc demo``): the whole story on one real document.

capture -> encode with a preset -> verify -> eval against the exact cache ->
time-to-first-token of prefill vs loading the `.kvc` -> a small rate/quality
curve (kvcodec presets next to the baselines) written as JSON + PNG.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from .capture import capture, select_context, tokenize
from .curve import eval_kvc_file, run_curve
from .format import KvcReader, get_plan, write_kvc
from .hf import greedy_from, load_cache
from .model import load_model
from .texts import load_text

DEMO_METHODS = ["kvcodec", "fp16+zstd", "int8", "kivi", "cachegen"]
QUESTION = "\n\nIn one sentence, what is this document about?"


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_main_job(
    model: str = "smollm2", text: str = "gpl3", max_tokens: int = 2048, continuation: int = 256,
    preset: str = "balanced", out_dir: Path | None = None, curve: bool = True, repeats: int = 3,
    log: Callable[[str], None] = lambda s: None,
) -> dict[str, Any]:
    out_dir = Path(out_dir or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lm = load_model(model)
    report: dict[str, Any] = {"model": model, "fingerprint": lm.fingerprint.id, "text": text, "preset": preset,
                              "model_load_s": time.perf_counter() - t0}
    all_ids = tokenize(lm.tokenizer, load_text(text))
    ids = select_context(all_ids, max_tokens, min_follow=continuation)
    log(f"capturing {len(ids)} tokens of {text} ...")
    cache = capture(lm, token_ids=ids)

    log(f"encoding with preset {preset} ...")
    path = out_dir / f"{Path(text).name}-{len(ids)}-{preset}.kvc"
    t0 = time.perf_counter()
    plan = get_plan(preset, cache, lm=lm)
    write_kvc(cache, path, plan.pipelines, attachments=plan.attachments, preset=plan.preset)
    report.update(kvc_file=str(path), kvc_bytes=path.stat().st_size, encode_s=time.perf_counter() - t0,
                  kv_elements=cache.num_elements, fp16_bytes=cache.nbytes_fp16, tokens=len(ids))
    with KvcReader(path) as r:
        problems = r.verify()
    report["verify"] = "ok" if not problems else problems[0]

    log("evaluating against the exact cache ...")
    report["quality"] = eval_kvc_file(lm, path, all_ids, continuation=continuation)

    log("timing time-to-first-token ...")
    q = tokenize(lm.tokenizer, QUESTION)

    @torch.inference_mode()
    def by_prefill() -> int:
        return int(lm.model(input_ids=torch.as_tensor(np.concatenate([ids, q])).unsqueeze(0), logits_to_keep=1).logits[0, -1].argmax())

    def by_kvc() -> int:
        loaded = load_cache(path.read_bytes(), lm)
        return greedy_from(lm, loaded.cache, loaded.next_position, q, 1)[0][0]

    t_pre, t_kvc = _median_time(by_prefill, repeats), _median_time(by_kvc, repeats)
    report["ttft"] = {"prefill_s": t_pre, "kvc_s": t_kvc, "speedup": t_pre / t_kvc,
                      "first_token_matches": by_prefill() == by_kvc(), "repeats": repeats,
                      "torch_threads": torch.get_num_threads()}
    if curve:
        log("sweeping the rate/quality curve (kvcodec presets and baselines) ...")
        res = run_curve(model, [text], max_tokens=max_tokens, continuation=continuation, methods=DEMO_METHODS,
                        json_out=out_dir / "curve.json", plot_out=out_dir / "curve.png", lm=lm, progress=False)
        report["curve"] = {"json": str(out_dir / "curve.json"), "png": str(out_dir / "curve.png"),
                           "rows": [{k: r.get(k) for k in ("family", "method", "bits_per_element", "kl_mean", "dppl_percent")}
                                    for r in res["rows"]]}
    return report


def render(report: dict[str, Any]) -> str:
    q, t = report["quality"], report["ttft"]
    bpe = report["kvc_bytes"] * 8 / report["kv_elements"]
    lines = [
        f"model      {report['model']} (fingerprint {report['fingerprint']})",
        f"document   {report['text']}: {report['tokens']} tokens captured",
        f"encoded    {report['preset']}: {report['kvc_bytes']:,} bytes = {bpe:.2f} bits/element "
        f"({report['fp16_bytes'] / report['kvc_bytes']:.1f}x smaller than fp16) in {report['encode_s']:.1f} s -> {report['kvc_file']}",
        f"verify     {report['verify']}",
        f"quality    KL {q['kl_mean']:.4f}, dPPL {q['dppl_percent']:+.2f} %, top-1 {q['top1_agreement']:.3f}, "
        f"greedy match {q['greedy_match']:.2f} ({q['continuation_tokens']} continuation tokens)",
        f"TTFT       prefill {t['prefill_s'] * 1000:.0f} ms vs load .kvc + decode {t['kvc_s'] * 1000:.0f} ms "
        f"= {t['speedup']:.1f}x faster (first token {'identical' if t['first_token_matches'] else 'differs'})",
    ]
    if "curve" in report:
        lines.append(f"curve      {report['curve']['png']} ({report['curve']['json']})")
        lines.append("           method                   bits/el   KL        dPPL %")
        for r in sorted(report["curve"]["rows"], key=lambda r: r["bits_per_element"] or 0):
            lines.append(f"           {r['family'] + ':' + r['method']:<24} {r['bits_per_element']:7.2f}   {r['kl_mean']:.2e}  {r['dppl_percent']:+7.2f}")
    return "\n".join(lines)
