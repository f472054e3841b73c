"""``kvc edit profile-heads``: which attention heads to steer on a model, found on the key-fact task (issue 57: a
new model could only be profiled from benchmarks/bench_edit.py, and steering unprofiled layers lowers the margin).

Thin: parse, call :func:`kvcodec.edit.steer_profile.profile_heads`, render. Its own module, attached to the ``kvc
edit`` group by :mod:`kvcodec.cli.main`; nothing heavy is imported until it runs.
"""

from __future__ import annotations

from typing import Any

import click

from kvcodec.cli.options import emit_json, json_option, model_option


def _layers(spec: str | None) -> list[int] | None:
    """``"20,23"`` -> [20, 23]; ranges are the library's to check against the model."""
    from kvcodec.errors import KvcInputError

    if spec is None:
        return None
    try:
        return [int(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        raise KvcInputError(f"--layers takes comma-separated layer numbers, got {spec!r:.40}") from None


@click.command("profile-heads")
@model_option
@click.option("--texts", default=None,
              help="Comma-separated texts (kvcodec.texts names or files) to draw the key-fact examples from "
                   "[default: apache2,changelog-apt, held out from the evaluation].")
@click.option("--examples", type=int, default=None, help="Key-fact examples per layer [default: 6].")
@click.option("--top", type=int, default=3, show_default=True, help="Keep at most this many layers (those that gain).")
@click.option("--alpha", type=float, default=None, help="Attention kept on keys outside the span [default: 0.01, PASTA's].")
@click.option("--layers", default=None, help="Profile only these layers, e.g. 18,20,23 [default: every layer].")
@json_option
def profile_heads_command(model: str, texts: str | None, examples: int | None, top: int, alpha: float | None,
                          layers: str | None, as_json: bool) -> None:
    """Profile the model's layers for `kvc edit steer --heads`: each layer steered alone on the key-fact task, the ones
    that raise the answer margin most kept. Minutes on a CPU; progress on stderr (also with --json)."""
    from kvcodec.edit.steer_profile import PROFILE_EXAMPLES, PROFILE_TEXTS, profile_heads
    from kvcodec.models.load import load_model

    chosen = _layers(layers)  # refuse a bad list before loading the model
    kw: dict[str, Any] = {"texts": [t.strip() for t in texts.split(",") if t.strip()] if texts is not None else PROFILE_TEXTS,
                          "examples": PROFILE_EXAMPLES if examples is None else examples, "top": top, "layers": chosen}
    if alpha is not None:
        kw["alpha"] = alpha
    lm = load_model(model)
    res = profile_heads(lm, progress=lambda m: click.echo(f"kvc: {m}", err=True), **kw)
    res = dict(res, model=model)
    if as_json:
        emit_json(res)
        return
    if not res["layers"]:
        click.echo(f"{model}: no layer raised the answer margin when steered alone ({res['examples']} examples, "
                   f"baseline margin {res['baseline_margin']:.2f} nats); steering is not recommended on this model")
        return
    gains = ", ".join(f"{la}: {res['gain_by_layer'][la]:+.2f}" for la in res["layers"])
    click.echo(f"{model}: --heads {res['heads_spec']}")
    click.echo(f"  margin gain per layer (nats) {gains}, over a baseline margin of {res['baseline_margin']:.2f}; "
               f"{res['examples']} examples from {', '.join(res['texts'])}, alpha {res['alpha']:g}, {res['seconds']:.0f} s")


EDIT_COMMANDS = [profile_heads_command]
