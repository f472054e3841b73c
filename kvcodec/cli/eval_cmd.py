"""``kvc eval`` (quality of one .kvc file) and ``kvc curve`` (rate-quality sweep of all methods)."""

from __future__ import annotations

import click

from kvcodec.cli.options import emit_json, json_option, model_option


@click.command("eval")
@click.argument("kvc_file", type=click.Path(dir_okay=False))
@model_option
@click.option("--text", "text_path", required=True, help="The text the file was made from (UTF-8 file or corpus name).")
@click.option("--continuation", type=click.IntRange(min=1), default=None,
              help="Continuation tokens (those following the cached context in the text) to score [default: up to "
                   "1024, as many as the text has]; dPPL is promised in expectation over >= 2,048 tokens of several "
                   "texts, and a long continuation narrows its interval.")
@click.option("--greedy-tokens", type=click.IntRange(min=0), default=16, show_default=True, help="Greedy tokens compared after the first.")
@json_option
def eval_command(kvc_file: str, model: str, text_path: str, continuation: int | None, greedy_tokens: int,
                 as_json: bool) -> None:
    """Decode KVC_FILE, continue TEXT from it and compare with the exact cache.

    Reports bits per KV element (real file bytes x 8 / K+V elements of the
    context), the ratio vs fp16, and the model's continuation quality:
    mean KL (nats), top-1 agreement, perplexity change with its 95 % interval, and greedy match.
    """
    from kvcodec.atomic import check_input
    from kvcodec.models.capture import tokenize
    from kvcodec.eval.fileeval import eval_kvc_file
    from kvcodec.errors import KvcInputError
    from kvcodec.models.load import load_model
    from kvcodec.texts import load_text

    check_input(kvc_file)
    if greedy_tokens < 0:
        raise KvcInputError(f"--greedy-tokens must be >= 0, got {greedy_tokens}")
    text = load_text(text_path)
    lm = load_model(model)
    r = eval_kvc_file(lm, kvc_file, tokenize(lm.tokenizer, text), continuation, greedy_tokens)
    if as_json:
        emit_json(r)
        return
    click.echo(
        f"{kvc_file}: {r['bits_per_element']:.3f} bits/element ({r['ratio_vs_fp16']:.2f}x vs fp16, "
        f"{r['file_bytes']:,} bytes), {r['stored_tokens']}/{r['context_tokens']} tokens stored\n"
        f"  continuation {r['continuation_tokens']} tokens: KL {r['kl_mean']:.3e} nats, top-1 {r['top1_agreement']:.4f}, "
        f"PPL {r['ppl_exact']:.4f} -> {r['ppl_decoded']:.4f} ({r['dppl_percent']:+.3f} %, 95 % interval "
        f"{r['dppl_ci95_percent'][0]:+.3f} .. {r['dppl_ci95_percent'][1]:+.3f} %), greedy match {r['greedy_match']:.3f}"
    )


def _floats(ctx: click.Context, param: click.Parameter, value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        out = [float(x) for x in value.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {value!r}") from None
    if not out or any(not (v > 0) for v in out):
        raise click.BadParameter("target KL values must be positive")
    return out


@click.command("curve")
@model_option
@click.option("--text", "texts", multiple=True, required=True, help="Text file or corpus name; repeat for several.")
@click.option("--max-tokens", type=click.IntRange(min=1), default=2048, show_default=True, help="Context tokens per text.")
@click.option("--continuation", type=click.IntRange(min=1), default=256, show_default=True, help="Continuation tokens scored per text.")
@click.option("--methods", default="all", show_default=True,
              help="Comma-separated families (kvcodec, kvcodec-kl, fp16, fp16+zstd, int8, kivi, cachegen, h2o, "
                   "real peers hf-quanto and hf-hqq; not in 'all': kvcodec-fixed, kvcodec-embedded, kivi-window) "
                   "or settings (kivi2, cachegen-ctx, kvcodec:NAME, hf-quanto:quanto4-g32-kivi, h2o:0.25). "
                   "Texts: names from kvcodec.texts (HELD_OUT: never tuned on) or paths.")
@click.option("--target-kl", "target_kl", callback=_floats, default=None,
              help="Comma-separated KL targets for the kvcodec-kl family (if the codec has plan_for_target).")
@click.option("--h2o", "h2o_budgets", default=None, help="Semicolon-separated H2O budgets for the h2o family [default: h2o:0.2;h2o:0.35;h2o:0.5;h2o:0.75].")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), default=None,
              help="Write results here; rows already in it are reused (resumable).")
@click.option("--csv", "csv_out", type=click.Path(dir_okay=False), default=None, help="Write results as CSV.")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), default=None, help="Write a PNG plot (KL vs bits/element).")
@click.option("--capture-dir", type=click.Path(file_okay=False), default=None,
              help="Where exact captures are kept between runs [default: $KVCODEC_CACHE/captures].")
@click.option("--greedy-tokens", type=click.IntRange(min=0), default=16, show_default=True)
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="torch CPU threads (on a shared machine 1 is often several times faster than the default).")
@click.option("--no-progress", is_flag=True, help="No progress bar on stderr.")
def curve_command(model: str, texts: tuple[str, ...], max_tokens: int, continuation: int, methods: str,
                  target_kl: list[float] | None, h2o_budgets: str | None, json_out: str | None, csv_out: str | None,
                  plot_out: str | None, capture_dir: str | None, greedy_tokens: int, threads: int | None,
                  no_progress: bool) -> None:
    """Rate-quality curve: every method encoded to a real .kvc, decoded and evaluated, per text.

    Bits per element are real .kvc file bytes x 8 / K+V elements of the full
    context; quality is measured on the CONTINUATION tokens that follow each
    context in its text. The plot has one panel per text (x: bits/element,
    y: mean KL, both log), one line per method family (its Pareto frontier).
    """
    from kvcodec.eval.curve import run_curve
    from kvcodec.eval.report import summary_table
    from kvcodec.errors import KvcInputError

    if threads is not None:
        if threads < 1:
            raise KvcInputError(f"--threads must be >= 1, got {threads}")
        import torch

        torch.set_num_threads(threads)

    res = run_curve(
        model, list(texts), max_tokens=max_tokens, continuation=continuation,
        methods=[m for m in methods.split(",") if m.strip()], target_kls=target_kl,
        h2o_budgets=[b for b in (h2o_budgets or "").split(";") if b.strip()] or None,
        json_out=json_out, csv_out=csv_out, plot_out=plot_out,
        capture_dir=capture_dir if capture_dir is not None else "default",
        greedy_tokens=greedy_tokens, progress=not no_progress,
    )
    click.echo(summary_table(res["rows"]))
    for n in res["notes"]:
        click.echo(f"note: {n}")


COMMANDS = [eval_command, curve_command]
