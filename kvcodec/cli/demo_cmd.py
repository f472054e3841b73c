"""``kvc demo``: the main job on the embedded model, end to end."""

from __future__ import annotations

from pathlib import Path

import click

from kvcodec.cli.options import emit_json, json_option, model_option


@click.command("demo")
@model_option
@click.option("--text", "text_path", default="gpl3", show_default=True, help="Document (file or corpus name).")
# kvcodec.eval.demo.DEMO_TOKENS (not imported here: that module loads torch; tests/eval/test_mainjob.py keeps them equal)
@click.option("--max-tokens", type=click.IntRange(min=1), default=1024, show_default=True, help="Context tokens to capture.")
@click.option("--continuation", type=click.IntRange(min=1), default=256, show_default=True, help="Tokens used to measure quality.")
@click.option("--preset", default="balanced", show_default=True)
@click.option("--out-dir", type=click.Path(file_okay=False), default="kvc-demo", show_default=True)
@click.option("--no-curve", is_flag=True, help="Skip the rate/quality sweep.")
@json_option
def demo_command(model, text_path, max_tokens, continuation, preset, out_dir, no_curve, as_json) -> None:
    """Capture a real document, encode, verify, evaluate, time TTFT and plot the curve."""
    from kvcodec.eval.demo import render, run_main_job

    report = run_main_job(
        model=model, text=text_path, max_tokens=max_tokens, continuation=continuation, preset=preset,
        out_dir=Path(out_dir), curve=not no_curve, log=lambda s: click.echo(f"kvc: {s}", err=True),
    )
    emit_json(report) if as_json else click.echo(render(report))


COMMANDS = [demo_command]
