"""``kvc encode`` / ``decode`` / ``info`` / ``verify``: the `.kvc` container on the command line."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import click

from .options import emit_json, json_option


def _stage_str(s: Any) -> str:
    cfg = s.get_config()
    return s.name + ("(" + ", ".join(f"{k}={v}" for k, v in sorted(cfg.items())) + ")" if cfg else "")


def pipeline_str(p: Any) -> str:
    return " -> ".join(_stage_str(s) for s in p.stages)


def _ranges(xs: list[int]) -> str:
    out, start = [], None
    for i, x in enumerate(xs):
        if start is None:
            start = x
        if i + 1 == len(xs) or xs[i + 1] != x + 1:
            out.append(str(start) if start == x else f"{start}-{x}")
            start = None
    return ",".join(out)


def info_dict(r: Any, path: str) -> dict[str, Any]:
    """Everything ``kvc info`` reports, as plain data."""
    hd = r.header
    sz = r.sizes()
    elems = hd.num_elements
    use: dict[int, dict[str, list[int]]] = {}
    for e in r.entries:
        use.setdefault(e.pipeline, {"k": [], "v": []})
        lst = use[e.pipeline][e.kind]
        if not lst or lst[-1] != e.layer:
            lst.append(e.layer)
    pipelines = [
        {"id": i, "pipeline": pipeline_str(p), "stages": p.to_json(),
         "k_layers": _ranges(use.get(i, {}).get("k", [])), "v_layers": _ranges(use.get(i, {}).get("v", []))}
        for i, p in enumerate(hd.pipelines)
    ]
    return {
        "file": path,
        "bytes": sz["file"],
        "version": f"{hd.version[0]}.{hd.version[1]}",
        "writer": hd.writer,
        "model": {"architecture": hd.fingerprint.architecture, "fingerprint": hd.fingerprint.id,
                  "layers": hd.num_layers, "kv_heads": hd.kv_heads, "head_dim": sorted(set(hd.head_dims))},
        "dtype": hd.dtype,
        "context_tokens": hd.num_context_tokens,
        "stored_tokens": hd.num_tokens,
        "kept_fraction": hd.num_tokens / hd.num_context_tokens if hd.pruned and hd.num_context_tokens else None,
        "positions": None if not hd.pruned else ("per-token" if hd.blobs[hd.positions_blob].shape == (hd.num_tokens,) else "per-layer-head"),
        "token_ids": "stored" if hd.token_ids_blob is not None else "hash only",
        "chunks": len(r.entries),
        "codec": hd.codec,
        "pipelines": pipelines,
        "attachments": {n: {"dtype": a.dtype, "shape": list(a.shape), "external": a.blob is None} for n, a in hd.attachments.items()},
        "kv_elements": elems,
        "bits_per_element": sz["file"] * 8 / elems,
        "ratio_vs_fp16": elems * 2 / sz["file"],
        "sizes": sz,
        "meta": hd.meta,
    }


def render_info(d: dict[str, Any]) -> str:
    sz = d["sizes"]
    m = d["model"]
    lines = [
        f"file:        {d['file']} ({d['bytes']:,} bytes, .kvc {d['version']}, written by {d['writer'] or '?'})",
        f"model:       {m['architecture']}, fingerprint {m['fingerprint']} ({m['layers']} layers, {m['kv_heads']} KV heads, head_dim {'/'.join(map(str, m['head_dim']))})",
    ]
    tok = f"tokens:      {d['context_tokens']:,} context, {d['stored_tokens']:,} stored"
    if d["kept_fraction"] is not None:
        tok += f" (kept {100 * d['kept_fraction']:.1f}%, {d['positions']} positions)"
    lines.append(tok + f"; token ids {d['token_ids']}")
    lines.append(f"tensors:     {d['dtype']}, {2 * m['layers']} tensors in {d['chunks']} chunks")
    lines.append(f"codec:       {d['codec'] or '(none given)'}")
    for p in d["pipelines"]:
        lines.append(f"  pipeline {p['id']}: {p['pipeline']}  [K layers {p['k_layers'] or '-'}; V layers {p['v_layers'] or '-'}]")
    for n, a in d["attachments"].items():
        lines.append(f"  attachment {n}: {a['dtype']}{tuple(a['shape'])}{' (external)' if a['external'] else ''}")
    lines.append(
        f"size:        {d['bytes']:,} bytes = {d['bits_per_element']:.3f} bits per KV element "
        f"({d['kv_elements']:,} elements); ratio vs fp16 {d['ratio_vs_fp16']:.2f}x"
    )
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


@click.command("encode")
@click.argument("input_path", metavar="IN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .kvc file (written atomically).")
@click.option("--preset", default="lossless", show_default=True, help="lossless | zstd | raw, or a lossy preset.")
@click.option("--chunk-tokens", type=int, default=None, help="Tokens per chunk (default: one chunk per layer and K/V).")
@click.option("--chunk-heads", type=int, default=None, help="KV heads per chunk (default: all).")
@json_option
def encode_command(input_path: str, output: str, preset: str, chunk_tokens: int | None, chunk_heads: int | None, as_json: bool) -> None:
    """Encode a raw capture (IN.h5 / IN.safetensors) into a .kvc file."""
    from kvcodec.errors import KvcInputError
    from kvcodec.format import get_plan, write_kvc
    from kvcodec.kvcache import load_capture

    if not Path(input_path).is_file():
        raise KvcInputError(f"no such file: {input_path}")
    cache = load_capture(input_path)
    plan = get_plan(preset, cache)  # lossy presets may need the model: they load it themselves
    n = write_kvc(cache, output, plan.pipelines, attachments=plan.attachments or None,
                  chunk_tokens=chunk_tokens, chunk_heads=chunk_heads, preset=plan.preset)
    elems = cache.num_elements
    info = {"input": input_path, "output": output, "preset": plan.preset, "bytes": n, "kv_elements": elems,
            "bits_per_element": n * 8 / elems, "ratio_vs_fp16": cache.nbytes_fp16 / n}
    if as_json:
        emit_json(info)
    else:
        click.echo(f"{output}: {n:,} bytes, {info['bits_per_element']:.3f} bits per KV element, "
                   f"ratio vs fp16 {info['ratio_vs_fp16']:.2f}x (preset {plan.preset})")


@click.command("decode")
@click.argument("input_path", metavar="IN", type=click.Path(dir_okay=False))
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False), help="Output .h5 or .safetensors (capture layout).")
@click.option("--backend", type=click.Choice(["cpu", "gpu", "auto"]), default=None, help="Decode backend (default $KVCODEC_BACKEND or auto).")
@json_option
def decode_command(input_path: str, output: str, backend: str | None, as_json: bool) -> None:
    """Decode a .kvc file back into a raw capture (same layout as kvc capture)."""
    from kvcodec.format import read_kvc
    from kvcodec.kvcache import save_capture

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
    from kvcodec.format import KvcReader

    with KvcReader(path) as r:
        d = info_dict(r, path)
    if as_json:
        emit_json(d)
    else:
        click.echo(render_info(d))


@click.command("verify")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option("--backend", type=click.Choice(["cpu", "gpu", "auto"]), default=None, help="Decode backend.")
@json_option
def verify_command(path: str, backend: str | None, as_json: bool) -> None:
    """Check structure, every CRC32C and padding byte, and decode every chunk. Exit 0 only if clean."""
    from kvcodec.errors import KvcFormatError
    from kvcodec.format import KvcReader

    try:
        r = KvcReader(path)
    except KvcFormatError as exc:
        problems, chunks, size = [str(exc)], None, None
    else:
        with r:
            problems, chunks, size = r.verify(backend=backend), len(r.entries), r.size
    if as_json:
        emit_json({"file": path, "ok": not problems, "problems": problems, "chunks": chunks, "bytes": size})
        if problems:
            sys.exit(KvcFormatError.exit_code)
        return
    if problems:
        more = f" (+{len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise KvcFormatError(f"{path}: {problems[0]}{more}")
    click.echo(f"OK {path}: {size:,} bytes, {chunks} chunks, all CRC32C, padding and decodes verified")


COMMANDS = [encode_command, decode_command, info_command, verify_command]
