"""``kvc prune``: prune a raw capture with H2O or LLMLingua-style token dropping."""

from __future__ import annotations

from pathlib import Path

import click

from kvcodec.cli.options import emit_json, json_option

SPEC_HELP = ("h2o:0.25 | h2o:heavy=0.1,recent=0.1[,window=64|all] | lingua:0.5[,segment=200]; "
             "fractions (0.25, 25%) or token counts (512) of the context to KEEP.")


@click.command("prune")
@click.argument("input_path", metavar="IN", type=click.Path(dir_okay=False))
@click.option("--prune", "spec", required=True, help=SPEC_HELP)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .h5 or .safetensors (capture layout).")
@click.option("--model", "-m", default=None, help="Model to score with (default: the one recorded in the capture, else smollm2).")
@click.option("--question", default=None, help="lingua only: rank segments by relevance to this question (LongLLMLingua-style).")
@json_option
def prune_command(input_path: str, spec: str, output: str, model: str | None, question: str | None, as_json: bool) -> None:
    """Prune the exact capture IN and write the pruned cache.

    H2O keeps original positions (per KV head); lingua captures the shorter
    text again (positions renumbered). The spec and kept fraction are
    recorded in the cache's metadata under "prune".
    """
    from kvcodec.atomic import check_input, check_output
    from kvcodec.errors import KvcInputError
    from kvcodec.core.kvcache import capture_path, load_capture, save_capture
    from kvcodec.prune import apply_prune, parse_prune

    budget = parse_prune(spec)  # refuse a bad spec before loading anything
    check_input(input_path)
    check_output(output, inputs=[input_path, model])
    capture_path(output)
    cache = load_capture(input_path)
    if question is not None and budget.method != "lingua":
        raise KvcInputError("--question only applies to lingua pruning")
    lm = None
    if model is not None:
        from kvcodec.models.load import load_model

        lm = load_model(model)
    out = apply_prune(cache, budget, lm=lm, question=question)
    save_capture(out, output)
    rec = out.meta["prune"]
    info = {"input": input_path, "output": output, "method": rec["method"], "spec": rec["spec"],
            "context_tokens": cache.num_context_tokens, "kept_tokens": out.num_tokens,
            "kept_fraction": rec["kept_fraction"], "positions": rec["positions"],
            "per_head": bool(out.positions is not None and out.positions.ndim == 3),
            "bytes": Path(output).stat().st_size}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"{output}: kept {info['kept_tokens']} of {info['context_tokens']} tokens "
                   f"({100 * info['kept_fraction']:.1f} %, {rec['spec']}, positions {rec['positions']}"
                   f"{', per KV head' if info['per_head'] else ''})")


COMMANDS = [prune_command]
