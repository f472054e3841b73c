"""``kvc capture``: prefill a text on a model and write its raw KV cache."""

from __future__ import annotations

from pathlib import Path

import click

from kvcodec.cli.options import emit_json, json_option, model_option


@click.command("capture")
@model_option
@click.option("--text", "text_path", required=True, help="UTF-8 text file, or a corpus name (gpl3, pydoc, ...).")
@click.option("--max-tokens", type=int, default=None, help="Keep only the first N tokens of the text.")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .h5 or .safetensors.")
@json_option
def capture_command(model: str, text_path: str, max_tokens: int | None, output: str, as_json: bool) -> None:
    """Run prefill on TEXT and write the raw KV cache (HDF5 or safetensors).

    The prefill also observes the token importance the lossy presets read (the attention of the context's last
    queries) and the file keeps it, so `kvc encode` of this capture runs no forward pass over the context."""
    from kvcodec.atomic import check_output
    from kvcodec.models.capture import capture
    from kvcodec.core.kvcache import capture_path, save_capture
    from kvcodec.models.load import load_model
    from kvcodec.plan.presets import capture_window
    from kvcodec.texts import load_text

    check_output(output, inputs=[text_path, model])
    capture_path(output)  # before the prefill that would write it
    text = load_text(text_path)
    lm = load_model(model)
    cache = capture(lm, text=text, max_tokens=max_tokens, score_window=capture_window())
    save_capture(cache, output)
    info = {
        "output": output,
        "bytes": Path(output).stat().st_size,
        "model": model,
        "fingerprint": cache.fingerprint.id,
        "layers": cache.num_layers,
        "kv_heads": cache.fingerprint.num_kv_heads,
        "head_dim": cache.fingerprint.head_dims[0],
        "tokens": cache.num_tokens,
        "dtype": str(cache.dtype).removeprefix("torch."),
        "kv_elements": cache.num_elements,
        "fp16_bytes": cache.nbytes_fp16,
        "attention_window": None if cache.attention is None else cache.attention.window,
    }
    if as_json:
        emit_json(info)
    else:
        click.echo(
            f"captured {info['tokens']} tokens x {info['layers']} layers x {info['kv_heads']} KV heads x "
            f"{info['head_dim']} dims ({info['dtype']}) -> {output} ({info['bytes']:,} bytes; fp16 size {info['fp16_bytes']:,})"
        )


COMMANDS = [capture_command]
