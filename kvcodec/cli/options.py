"""Options shared by several commands, so each is spelled one way."""

from __future__ import annotations

import json
from typing import Any

import click

model_option = click.option(
    "--model", "-m", default="smollm2", show_default=True,
    help="'smollm2' (the embedded SmolLM2-135M-Instruct), another shipped model ('gemma3-270m', installed by "
         ".ci/setup) or a local HF model directory.",
)
json_option = click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON on stdout.")


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))
