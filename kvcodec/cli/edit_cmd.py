"""``kvc edit {append,redact,steer}``: turn a stored `.kvc` entry into a new, edited one (docs/guide/edit.md).

Thin: parse, call :mod:`kvcodec.edit`, render. The parent is never changed; ``-o`` names the child.
"""

from __future__ import annotations

from typing import Any, Callable

import click

from kvcodec.cli.options import emit_json, json_option, model_option


def _say(as_json: bool) -> Callable[[str], None]:
    return (lambda m: None) if as_json else (lambda m: click.echo(f"kvc: {m} ...", err=True))


def _load(model: str) -> Any:
    from kvcodec.models.load import load_model

    return load_model(model)


def _render(res: Any, as_json: bool) -> None:
    from kvcodec.edit.log import promise_text

    info = res.to_json()
    if as_json:
        emit_json(info)
        return
    t = ", ".join(f"{k.removesuffix('_s')} {v:.2f} s" for k, v in info["timings"].items())
    extra = ""
    if res.op == "redact":
        extra = f", removed {info['removed_tokens']} tokens, recomputed {info['recomputed_tokens']} ({info['repair']})"
    elif res.op == "append":
        extra = f", {info['repair']}: prefilled {info['prefilled_tokens']}"
    elif res.op == "steer":
        extra = f", {info['steered_heads']} heads steered towards {len(info['spans'])} span(s)"
    click.echo(f"{info['output']}: {res.op} -> {info['tokens']} tokens{extra}, {info['size']:,} bytes ({info['preset']}); {t}")
    click.echo(f"  promise: {promise_text(res.promise)}")


def edit_summary(meta: Any) -> dict[str, Any] | None:
    """What ``kvc info --json`` reports of an entry's edit log (None: never edited, so its preset's promise is
    that of any encode): the edits' ops and the entry's promise (:func:`kvcodec.edit.log.entry_promise`). A
    malformed log is reported, not trusted: ``{"error": ...}`` and no promise."""
    from kvcodec.edit.log import entry_promise, parse_log
    from kvcodec.errors import KvcFormatError

    try:
        edited, promise = entry_promise(meta if isinstance(meta, dict) else {})
    except KvcFormatError as exc:
        return {"error": str(exc), "promise": None}
    if not edited:
        return None
    return {"ops": [r.op for r in parse_log(meta)], "promise": promise}


def render_edit(summary: dict[str, Any] | None) -> list[str]:
    """``kvc info``'s lines for an edited entry (none for an entry never edited)."""
    from kvcodec.edit.log import promise_text

    if summary is None:
        return []
    if "error" in summary:
        return [f"edits:       the edit log is invalid ({summary['error']}); no promise is claimed"]
    return [f"edits:       {' -> '.join(summary['ops'])}", f"promise:     {promise_text(summary['promise'])}"]


_preset = click.option("--preset", default=None, help="Preset of the edited entry (default: the parent's).")
_output = click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="The edited entry (a new .kvc).")
_entry = click.argument("entry", metavar="ENTRY.kvc", type=click.Path(dir_okay=False))


@click.group("edit")
def edit_group() -> None:
    """Edit a stored .kvc offline into a new entry (append, redact, steer); the parent is never changed."""


@edit_group.command("append")
@_entry
@click.option("--text", "text", default=None, help="The text to append.")
@click.option("--text-file", "text_file", default=None, type=click.Path(dir_okay=False), help="A UTF-8 file holding it.")
@click.option("--repair", type=click.Choice(["auto", "prefill", "incremental"]), default="auto", show_default=True,
              help="auto: keep the preset's promise (a lossy ENTRY's child is prefilled afresh, an exact one's only "
                   "over its new text); prefill: always prefill the whole child; incremental: always only the new "
                   "text (on a lossy ENTRY the child carries its error and promises nothing).")
@_output
@_preset
@model_option
@json_option
def append_command(entry: str, text: str | None, text_file: str | None, repair: str, output: str, preset: str | None,
                   model: str, as_json: bool) -> None:
    """Extend ENTRY's context with more text (docs/guide/edit.md says what the child promises)."""
    from kvcodec.atomic import check_output
    from kvcodec.edit.append import append
    from kvcodec.errors import KvcInputError

    if (text is None) == (text_file is None):
        raise KvcInputError("give exactly one of --text and --text-file")
    # every file the command reads is an input the child may not replace (-o naming the --text-file, a file of the
    # model directory, was written over)
    check_output(output, inputs=[entry, text_file, model])
    if text_file is not None:
        from kvcodec.texts import load_text

        text = load_text(text_file)
    res = append(_load(model), entry, text=text, dest=output, preset=preset, progress=_say(as_json), repair=repair)
    _render(res, as_json)


@edit_group.command("redact")
@_entry
@click.option("--pattern", default=None, help="A regular expression over the decoded context: every match is removed.")
@click.option("--text", "literal", default=None, help="A literal text: every occurrence is removed.")
@click.option("--tokens", "tokens", multiple=True, help="A token span START:END to remove (repeatable).")
@click.option("--repair", type=click.Choice(["prefill", "blend"]), default="prefill", show_default=True,
              help="prefill: prefill the kept text afresh (nothing in the child depends on what was removed beyond the "
                   "spans' positions); blend: repair the stored K/V CacheBlend-style (faster, without that guarantee).")
@click.option("--ratio", "ratio", default=None, type=float,
              help="With --repair blend: fraction of the kept tokens recomputed (default: kvcodec.edit.redact.DEFAULT_REDACT_RATIO).")
@click.option("--lineage-key-file", "lineage_key_file", default=None, type=click.Path(dir_okay=False),
              help="A file of at least 16 secret bytes: the child names its parent by an HMAC under them (without it, "
                   "the child does not name its parent).")
@_output
@_preset
@model_option
@json_option
def redact_command(entry: str, pattern: str | None, literal: str | None, tokens: tuple[str, ...], repair: str,
                   ratio: float | None, lineage_key_file: str | None, output: str, preset: str | None, model: str,
                   as_json: bool) -> None:
    """Remove spans from ENTRY's context into a new entry (docs/guide/edit.md says what it guarantees)."""
    from kvcodec.atomic import check_input, check_output
    from kvcodec.edit.redact import redact
    from kvcodec.edit.spans import parse_token_span

    spans = [parse_token_span(t) for t in tokens] or None  # refuse a bad span before loading anything
    check_output(output, inputs=[entry, lineage_key_file, model])  # -o naming the lineage key file replaced the key
    lineage = None
    if lineage_key_file is not None:
        lineage = _read_lineage_key(check_input(lineage_key_file))
    res = redact(_load(model), entry, pattern=pattern, text=literal, token_spans=spans, repair=repair,
                 recompute_ratio=ratio, dest=output, preset=preset, progress=_say(as_json), lineage_key=lineage)
    _render(res, as_json)


#: a lineage key is a secret of 16 bytes or more (kvcodec.edit.redact); a file much longer is not one
MAX_LINEAGE_KEY_BYTES = 4096


def _read_lineage_key(path: Any) -> bytes:
    """The bytes of a lineage key file, read up to :data:`MAX_LINEAGE_KEY_BYTES` (a multi-gigabyte file given by
    mistake was read whole into memory) or one line (an unreadable one escaped as PermissionError)."""
    from kvcodec.atomic import io_error
    from kvcodec.errors import KvcInputError

    try:
        with open(path, "rb") as f:
            data = f.read(MAX_LINEAGE_KEY_BYTES + 1)
    except OSError as exc:
        raise io_error(exc, f"reading the lineage key file {path}") from None
    if len(data) > MAX_LINEAGE_KEY_BYTES:
        raise KvcInputError(f"the lineage key file {path} is longer than {MAX_LINEAGE_KEY_BYTES:,} bytes; a lineage key is "
                            "a secret of 16 bytes or more")
    return data


@edit_group.command("steer")
@_entry
@click.option("--pattern", default=None, help="A regular expression over the decoded context: its matches are emphasised.")
@click.option("--text", "literal", default=None, help="A literal text: its occurrences are emphasised.")
@click.option("--tokens", "tokens", multiple=True, help="A token span START:END to emphasise (repeatable).")
@click.option("--auto", "auto", default=None, type=int,
              help="Emphasise the AUTO sentences the model's own attention ranks highest, read without any question "
                   "(kvcodec.edit.autospans; instead of --pattern/--text/--tokens).")
@click.option("--heads", "heads", required=True,
              help="Steered heads, LAYER:HEAD or LAYER:* (every head of the layer), comma-separated; "
                   "see docs/guide/edit.md for the profiled ones.")
@click.option("--alpha", default=None, type=float, help="Attention kept on keys outside the spans (default 0.01, PASTA's).")
@_output
@_preset
@model_option
@json_option
def steer_command(entry: str, pattern: str | None, literal: str | None, tokens: tuple[str, ...], auto: int | None,
                  heads: str, alpha: float | None, output: str, preset: str | None, model: str, as_json: bool) -> None:
    """Emphasise spans of ENTRY's context on chosen attention heads (PASTA): re-prefill under the bias, store both."""
    from kvcodec.atomic import check_output
    from kvcodec.edit.spans import parse_token_span
    from kvcodec.edit.steer import DEFAULT_ALPHA, parse_heads, steer
    from kvcodec.integrations.attn_bias import model_attention_heads

    spans = [parse_token_span(t) for t in tokens] or None
    check_output(output, inputs=[entry, model])
    lm = _load(model)
    res = steer(lm, entry, parse_heads(heads, model_attention_heads(lm)), pattern=pattern, text=literal, token_spans=spans, auto=auto,
                alpha=DEFAULT_ALPHA if alpha is None else alpha, dest=output, preset=preset, progress=_say(as_json))
    _render(res, as_json)


COMMANDS = [edit_group]
