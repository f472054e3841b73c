"""``kvc encode`` / ``decode`` / ``info`` / ``verify``: the `.kvc` container on the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvcodec.cli.options import emit_json, json_option


def _printable(x: Any) -> Any:
    """``x`` with every string's control and format characters (newline, ESC, BEL, bidi overrides) escaped: a
    file's writer, codec or meta strings are the file's, and one holding "\\nmodel: ..." printed a forged line
    in `kvc info` (and an ANSI sequence reached the terminal)."""
    import unicodedata

    if isinstance(x, str):
        return "".join(c if unicodedata.category(c) not in ("Cc", "Cf") else ascii(c)[1:-1] for c in x)
    if isinstance(x, dict):
        return {_printable(k): _printable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_printable(v) for v in x)
    return x


def render_info(d: dict[str, Any]) -> str:
    from kvcodec.core.fingerprint import FINGERPRINT_VERSION

    d = _printable(d)
    sz = d["sizes"]
    m = d["model"]
    lines = [
        f"file:        {d['file']} ({d['bytes']:,} bytes, .kvc {d['version']}, written by {d['writer'] or '?'})",
        f"model:       {m['architecture']}, fingerprint {m['fingerprint']} ({m['layers']} layers, {m['kv_heads']} KV heads, head_dim {'/'.join(map(str, m['head_dim']))})"
        + (f" [fingerprint v{m['fingerprint_version']}: identity unproven, models refuse it; re-encode]"
           if m["fingerprint_version"] != FINGERPRINT_VERSION else ""),
    ]
    tok = f"tokens:      {d['context_tokens']:,} context, {d['stored_tokens']:,} stored"
    if d["kept_fraction"] is not None:
        orig = d.get("original_context_tokens")
        of = f" of {orig:,}" if orig is not None and orig != d["context_tokens"] else ""
        tok += f" (kept {100 * d['kept_fraction']:.1f}%{of}, {d['positions']} positions)"
    if d.get("layer_tokens"):
        lt = d["layer_tokens"]
        tok += f" (sliding-window layers keep their window: {sum(t < d['stored_tokens'] for t in lt)} layers store {min(lt):,})"
    lines.append(tok + f"; token ids {d['token_ids']}")
    lines.append(f"tensors:     {d['dtype']}, {2 * m['layers']} tensors in {d['chunks']} chunks")
    lines.append(f"codec:       {d['codec'] or '(none given)'}")
    for p in d["pipelines"]:
        lines.append(f"  pipeline {p['id']}: {p['pipeline']}  [K layers {p['k_layers'] or '-'}; V layers {p['v_layers'] or '-'}]")
    for n, a in d["attachments"].items():
        lines.append(f"  attachment {n}: {a['dtype']}{tuple(a['shape'])}{' (external)' if a['external'] else ''}")
    from kvcodec.cli.edit_cmd import render_edit

    lines += render_edit(d.get("edit"))  # an edited entry's edits and promise (spec/kvc-v1.md 4.5)
    lines.append(
        f"size:        {d['bytes']:,} bytes = {d['bits_per_element']:.3f} bits per KV element "
        f"({d['kv_elements']:,} elements); ratio vs fp16 {d['ratio_vs_fp16']:.2f}x"
    )
    if d.get("bits_per_context_element") is not None:
        lines.append(f"             = {d['bits_per_context_element']:.3f} bits per element of the unpruned context "
                     f"({d['context_kv_elements']:,} elements)")
    b = sz["blobs"]
    lines.append(
        f"overhead:    header {sz['header']:,} B, index {sz['index']:,} B, footer {sz['footer']} B, token ids {b['token_ids']:,} B, "
        f"positions {b['positions']:,} B, attachments {b['attachments']:,} B, padding {sz['padding']:,} B"
    )
    lines.append("per layer:   bytes K / V (bits per element K / V)")
    per_tensor = d["kv_elements"] // (2 * m["layers"]) if m["layers"] else 1
    for i, lv in enumerate(sz["layers"]):
        lines.append(
            f"  {i:4d}  {lv['k']:>12,} / {lv['v']:<12,} ({lv['k'] * 8 / per_tensor:.3f} / {lv['v'] * 8 / per_tensor:.3f})"
        )
    return "\n".join(lines)


PRUNE_HELP = "h2o:0.25 | h2o:heavy=0.1,recent=0.1 | lingua:0.5"


def _positive(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    if value is not None and not value > 0:
        raise click.BadParameter(f"must be positive, got {value}")
    return value


#: the largest --config file read (a preset and its overrides take a few hundred bytes)
MAX_CONFIG_FILE = 1 << 20


def parse_codec_config(value: str) -> tuple[str, dict[str, Any]]:
    """(preset, overrides) of ``--config``: a JSON object, inline or in a file, checked by :func:`kvcodec.plan.presets.parse_config`."""
    from kvcodec.errors import KvcInputError, json_loads
    from kvcodec.plan.presets import parse_config

    text = value
    if not value.lstrip().startswith("{"):
        src = Path(value)
        try:
            is_file = src.is_file()
        except (OSError, ValueError):  # a name too long for a file (inline JSON) escaped as OSError
            is_file = False
        if is_file:  # a file that is not UTF-8 escaped as UnicodeDecodeError; one of any size was read whole
            try:
                with open(src, "rb") as f:
                    raw = f.read(MAX_CONFIG_FILE + 1)
            except OSError as exc:
                raise KvcInputError(f"cannot read the --config file {value}: {exc.strerror or exc}") from None
            if len(raw) > MAX_CONFIG_FILE:
                raise KvcInputError(f"the --config file {value} is larger than {MAX_CONFIG_FILE:,} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise KvcInputError(f"the --config file {value} is not UTF-8 text") from None
    try:
        cfg = json_loads(text)
    except ValueError as exc:
        raise KvcInputError(f"--config is neither a JSON object nor a JSON file ({str(exc)[:200]})") from None
    return parse_config(cfg, "--config")


@click.command("encode")
@click.argument("input_path", metavar="[IN]", required=False, type=click.Path(dir_okay=False))
@click.option("-o", "--output", default=None, type=click.Path(dir_okay=False),
              help="Output .kvc file (written atomically). Required unless --levels.")
@click.option("--levels", default=None,
              help="Multi-level entry (spec/levels-v1.md): encode --text as `kvc ask --doc` sees it, every chunk at each "
                   "of these presets (e.g. small,balanced,near-lossless), and put it in --store under one logical key.")
@click.option("--store", "store_url", default=None, help="--levels: the store URL (default: the user cache).")
@click.option("--namespace", default="default", show_default=True, help="--levels: the store namespace.")
@click.option("--level-chunk-tokens", type=click.IntRange(min=256), default=256, show_default=True,
              help="--levels: tokens per streamed chunk (a multiple of 256).")
@click.option("--preset", default="lossless", show_default=True,
              help="lossless | zstd | raw | fp16, or a lossy preset (near-lossless, faithful, balanced, small).")
@click.option("--config", "config", default=None,
              help='A preset and parameter overrides as JSON (inline or a file), e.g. \'{"preset": "balanced", "step0": 0.25}\'.')
@click.option("--prune", "prune_spec", default=None, help=PRUNE_HELP)
@click.option("--model", "-m", default=None,
              help="Model for capture, pruning, lossy presets and quality targets: 'smollm2' or a local HF model directory "
                   "[default: the model recorded in the capture, else smollm2]. Must be the capture's model.")
@click.option("--target-kl", type=float, default=None, callback=_positive,
              help="Promise this mean KL (nats) instead of the preset's: rate control aims under it (lossy presets; "
                   "default preset balanced; within the preset's range).")
@click.option("--target-dppl", type=float, default=None, callback=_positive,
              help="Promise this mean perplexity change (percent, in expectation) instead; taken as the KL it corresponds to.")
@click.option("--check", is_flag=True, default=False,
              help="Confirm the rate control's step on the document's tail with the model (forward passes; lowers the "
                   "step if the probe misses, and warns when the prediction was far off).")
@click.option("--text", "text_path", default=None, help="Without IN: the text to capture (UTF-8 file or corpus name).")
@click.option("--max-tokens", type=int, default=None, help="Without IN: capture only the first N tokens of --text.")
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=None, help="Tokens per chunk (default: one chunk per layer and K/V).")
@click.option("--chunk-heads", type=click.IntRange(min=1), default=None, help="KV heads per chunk (default: all).")
@json_option
def encode_command(input_path: str | None, output: str | None, levels: str | None, store_url: str | None,
                   namespace: str, level_chunk_tokens: int, preset: str, config: str | None, prune_spec: str | None,
                   model: str | None, target_kl: float | None, target_dppl: float | None, check: bool,
                   text_path: str | None, max_tokens: int | None, chunk_tokens: int | None, chunk_heads: int | None,
                   as_json: bool) -> None:
    """Encode a raw capture (IN.h5 / IN.safetensors), or capture --text on --model and encode it, into a .kvc file.

    --prune drops tokens first (H2O keeps original positions per KV head;
    lingua re-captures the shorter text). Bits per element are always
    charged against the K+V elements of the full, unpruned context.
    Lossy presets choose their quantizer step by rate control: the step whose
    KL, predicted from the codec's own noise and the model's calibrated
    sensitivities, is a fixed fraction of the preset's promise (no model
    forward pass beyond token importance). --target-kl / --target-dppl change
    the promise; --check confirms it with the model on the document's tail.
    --config names a preset and overrides its plan's parameters.
    """
    from kvcodec.atomic import check_output
    from kvcodec.errors import KvcInputError
    from kvcodec.plan.presets import preset_info
    from kvcodec.texts import load_text

    preset_given = click.get_current_context().get_parameter_source("preset") not in (
        click.core.ParameterSource.DEFAULT, None)
    if levels is not None:
        if input_path is not None or output is not None or preset_given or config or prune_spec or \
                target_kl is not None or target_dppl is not None or chunk_tokens or chunk_heads or max_tokens:
            raise KvcInputError("--levels encodes --text (and --model) into --store; it takes none of IN, -o, "
                                "--preset, --config, --prune, --target-*, --max-tokens, --chunk-tokens, --chunk-heads")
        _encode_levels(text_path, levels, store_url, namespace, level_chunk_tokens, model, as_json)
        return
    if output is None:
        raise KvcInputError("give -o OUT.kvc (or --levels to write a multi-level entry into a store)")
    if store_url is not None or click.get_current_context().get_parameter_source("namespace") == \
            click.core.ParameterSource.COMMANDLINE:
        raise KvcInputError("--store and --namespace apply to --levels")
    overrides: dict[str, Any] = {}
    if config is not None:
        if preset_given:
            raise KvcInputError("give either --preset or --config (which names its preset), not both")
        preset, overrides = parse_codec_config(config)
        preset_given = True
    if input_path is None:
        if text_path is None:
            raise KvcInputError("give a capture IN.h5, or --text (and --model) to capture and encode in one step")
        if max_tokens is not None and max_tokens < 1:
            raise KvcInputError(f"--max-tokens must be at least 1, got {max_tokens}")
    elif max_tokens is not None:
        raise KvcInputError("--max-tokens applies to --text captures; IN is already a capture")
    budget = None
    if prune_spec is not None:
        from kvcodec.prune import parse_prune

        budget = parse_prune(prune_spec)  # refuse a bad spec before loading anything
    lossy = preset_info(preset, "--preset").lossy  # refuse a bad name before loading a model for it
    targeted = target_kl is not None or target_dppl is not None
    if target_kl is not None and target_dppl is not None:
        raise KvcInputError("give only one of --target-kl and --target-dppl")
    if targeted:
        if overrides:
            raise KvcInputError("--target-kl/--target-dppl choose step0 themselves; give them --preset, not --config overrides")
        if preset_given and not lossy:
            raise KvcInputError(f"--target-kl/--target-dppl tune the lossy codec; they cannot be used with --preset {preset}")
    if text_path is not None and input_path is not None:
        raise KvcInputError("give a capture IN or --text to capture, not both")
    if check and not (lossy or targeted):
        raise KvcInputError(f"--check confirms a lossy preset's step; --preset {preset} is not lossy")

    check_output(output, inputs=[input_path, text_path, config, model])  # before minutes of capture/encode work
    from kvcodec import api

    enc = api.encode(
        input_path, output, preset=preset if (preset_given or not targeted) else None, overrides=overrides, model=model,
        text=load_text(text_path) if text_path is not None else None, max_tokens=max_tokens, prune=budget,
        target_kl=target_kl, target_dppl=target_dppl, check=check, chunk_tokens=chunk_tokens, chunk_heads=chunk_heads)
    info = {"input": input_path if input_path is not None else text_path, **enc.to_json()}
    if as_json:
        emit_json(info)
        return
    extra = ""
    if enc.prune is not None:
        rec = enc.prune.to_json()
        extra += f"; pruned {rec['spec']}, kept {100 * rec['kept_fraction']:.1f}% of {rec['context_tokens']:,} tokens"
    rate = enc.plan.params.get("rate")
    if rate is not None:
        extra += f"; step0 {rate['step0']:.4g}, predicted KL {rate['predicted_kl']:.3g} (aim {rate['aim_kl']:.3g})"
        if "predicted_step0" in rate:
            extra += f"; checked on the tail: {rate['check_tries']} tries from step0 {rate['predicted_step0']:.4g}"
    chk = enc.plan.params.get("check")
    if chk is not None and chk.get("checked"):
        last = chk["tries"][-1]
        extra += (f"; checked on the last {chk['probe_tokens']} tokens: KL {last['kl_mean']:.3g}, top-1 {last['top1']:.3f}"
                  f"{'' if chk['met'] else ' (target not met)'}")
    click.echo(f"{output}: {enc.size:,} bytes, {enc.bits_per_element:.3f} bits per KV element, "
               f"ratio vs fp16 {enc.ratio_vs_fp16:.2f}x (preset {enc.preset}{extra})")


def _encode_levels(text_path: str | None, levels: str, store_url: str | None, namespace: str, chunk_tokens: int,
                   model: str | None, as_json: bool) -> None:
    """``kvc encode --levels``: the multi-level entry of a document, as ``kvc ask --doc`` builds its context."""
    from kvcodec.models.capture import check_fits
    from kvcodec.errors import KvcInputError
    from kvcodec.runtime.knowledge import KnowledgeBase, read_docs
    from kvcodec.models.load import DEFAULT_MODEL, load_model
    from kvcodec.store.levels import parse_levels
    from kvcodec.runtime.level_encode import encode_levels

    names = parse_levels(levels)  # refuse bad names before loading anything
    if text_path is None:
        raise KvcInputError("--levels needs --text (the document)")
    if chunk_tokens < 256 or chunk_tokens % 256:
        raise KvcInputError(f"--level-chunk-tokens must be a positive multiple of 256, got {chunk_tokens}")
    docs = read_docs([text_path])
    # the knowledge base only tokenizes here: its levels are named, so it takes no default preset (nor its warning)
    kb = KnowledgeBase(load_model(model or DEFAULT_MODEL), store_url, preset="lossless", namespace=namespace)
    ids, _ = kb.context_ids(docs)
    check_fits(kb.lm, len(ids), "the document")
    say = (lambda m: None) if as_json else (lambda m: click.echo(f"kvc: {m} ...", err=True))
    info = encode_levels(kb.lm, kb.store, ids, names, chunk_tokens=chunk_tokens, namespace=namespace, progress=say)
    info["store"] = kb.store.url
    if as_json:
        emit_json(info)
        return
    click.echo(f"{info['key']}: {info['tokens']:,} tokens in {info['chunks']} chunks of {chunk_tokens} -> {kb.store.url}")
    for lv, d in info["levels"].items():
        click.echo(f"  {lv:14s} {d['bytes']:>12,} bytes  {d['bits_per_element']:6.3f} bits/element  encode {d['encode_s']:.1f} s")


@click.command("decode")
@click.argument("input_path", metavar="IN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .h5 or .safetensors (capture layout).")
@click.option("--backend", type=click.Choice(["cpu", "gpu", "auto"]), default=None, help="Decode backend (default $KVCODEC_BACKEND or auto).")
@json_option
def decode_command(input_path: str, output: str, backend: str | None, as_json: bool) -> None:
    """Decode a .kvc file back into a raw capture (same layout as kvc capture)."""
    from kvcodec.atomic import check_input, check_output
    from kvcodec.format import read_kvc
    from kvcodec.core.kvcache import capture_path, save_capture

    check_output(output, inputs=[check_input(input_path)])
    capture_path(output)  # after the checks on what the output is: those say more (onto the input, a device)
    cache = read_kvc(input_path, backend=backend)
    save_capture(cache, output)
    info = {"input": input_path, "output": output, "layers": cache.num_layers, "tokens": cache.num_tokens,
            "dtype": str(cache.dtype).removeprefix("torch."), "bytes": Path(output).stat().st_size}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"{output}: {info['layers']} layers x {info['tokens']} tokens ({info['dtype']}), {info['bytes']:,} bytes")


@click.command("info")
@click.argument("path", type=click.Path(dir_okay=False))
@json_option
def info_command(path: str, as_json: bool) -> None:
    """Describe a .kvc file: model, tokens, codec, sizes and overheads (no decoding)."""
    from kvcodec.atomic import check_input
    from kvcodec.cli.edit_cmd import edit_summary
    from kvcodec.format import KvcReader

    with KvcReader(check_input(path)) as r:
        d = r.describe(path)
    d["edit"] = edit_summary(d["meta"])
    if as_json:
        emit_json(d)
    else:
        click.echo(render_info(d))


@click.command("verify")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--backend", type=click.Choice(["cpu", "gpu", "auto"]), default=None, help="Decode backend.")
@click.option("--max-decoded", "max_decoded", default=None,
              help="Refuse a file declaring more decoded K/V than this (default: $KVCODEC_MAX_DECODED_BYTES, else 16G).")
@click.option("--max-decoded-ratio", type=float, default=None,
              help="Refuse a file declaring more than this many times its size in decoded K/V (0: no limit; "
                   "default: $KVCODEC_MAX_DECODED_RATIO, else 256).")
@json_option
def verify_command(path: str, backend: str | None, max_decoded: str | None, max_decoded_ratio: float | None,
                   as_json: bool) -> None:
    """Check structure, every CRC32C and padding byte, and decode every chunk. Exit 0 only if clean.

    The declared decoded size is checked against the limits before anything is decoded, and chunks
    are decoded one at a time: memory stays within ~3x the largest chunk (spec/kvc-v1.md §9).
    """
    from kvcodec.atomic import check_input
    from kvcodec.errors import KvcFormatError
    from kvcodec.format import KvcReader
    from kvcodec.store.options import parse_size

    limit = parse_size(max_decoded) if max_decoded is not None else None
    check_input(path)
    try:
        r = KvcReader(path, max_decoded_bytes=limit, max_decoded_ratio=max_decoded_ratio)
    except KvcFormatError as exc:
        problems, chunks, size = [str(exc)], None, None
    else:
        with r:
            problems, chunks, size = r.verify(backend=backend), len(r.entries), r.size
    if as_json:
        emit_json({"file": path, "ok": not problems, "problems": problems, "chunks": chunks, "bytes": size})
    if problems:  # with --json too: the JSON on stdout, the one error line on stderr (it exited 3 silently)
        more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise KvcFormatError(f"{path}: {problems[0]}{more}")
    if as_json:
        return
    click.echo(f"OK {path}: {size:,} bytes, {chunks} chunks, all CRC32C, padding and decodes verified")


COMMANDS = [encode_command, decode_command, info_command, verify_command]
