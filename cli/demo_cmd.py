"""``kvc demo``: the main job on the embedded model, end to end."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import click

from .options import emit_json, json_option, model_option


@click.command("demo")
@model_option
@click.option("--text", "text_path", default="gpl3", show_default=True, help="Document to capture.")
@click.option("--max-tokens", type=int, default=2048, show_default=True)
@click.option("--out-dir", type=click.Path(file_okay=False), default=None, help="Keep outputs here (default: a temp dir).")
@json_option
def demo_command(model: str, text_path: str, max_tokens: int, out_dir: str | None, as_json: bool) -> None:
    """Capture a real document's KV cache and report what was captured."""
    from kvcodec.capture import capture
    from kvcodec.kvcache import load_h5, save_h5
    from kvcodec.model import load_model
    from kvcodec.texts import load_text

    out = Path(out_dir or tempfile.mkdtemp(prefix="kvc-demo-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lm = load_model(model)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache = capture(lm, text=load_text(text_path), max_tokens=max_tokens)
    t_prefill = time.perf_counter() - t0
    h5 = out / "capture.h5"
    save_h5(cache, h5)
    back = load_h5(h5)
    report = {
        "model": model,
        "text": text_path,
        "tokens": cache.num_tokens,
        "layers": cache.num_layers,
        "kv_heads": cache.fingerprint.num_kv_heads,
        "head_dim": cache.fingerprint.head_dims[0],
        "fingerprint": cache.fingerprint.id,
        "capture_file": str(h5),
        "capture_bytes": h5.stat().st_size,
        "fp16_bytes": cache.nbytes_fp16,
        "model_load_s": round(t_load, 3),
        "prefill_s": round(t_prefill, 3),
        "roundtrip_exact": all((a == b).all().item() for a, b in zip(cache.keys + cache.values, back.keys + back.values)),
    }
    if as_json:
        emit_json(report)
        return
    click.echo(f"model        {model} (fingerprint {report['fingerprint']}), loaded in {t_load:.2f} s")
    click.echo(f"document     {text_path}: {report['tokens']} tokens, prefill {t_prefill:.2f} s")
    click.echo(f"KV cache     {report['layers']} layers x {report['kv_heads']} KV heads x {report['head_dim']} dims x K,V")
    click.echo(f"size         fp16 {report['fp16_bytes'] / 2**20:.2f} MiB; capture file {report['capture_bytes'] / 2**20:.2f} MiB ({h5})")
    click.echo(f"round trip   {'exact' if report['roundtrip_exact'] else 'MISMATCH'}")


COMMANDS = [demo_command]
