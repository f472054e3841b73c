"""``KvcReader.describe()``: what a `.kvc` file holds, as plain data (``kvc info`` renders it).

Why in the library: the CLI only parses, calls and renders; the rules (rates charged against the
unpruned context, the pruning record, which layers use which pipeline) are the library's.
"""

from __future__ import annotations

from typing import Any

from kvcodec.accounting import PruneRecord, bits_per_element, context_tokens


def _stage_str(s: Any) -> str:
    """``name(config)``; a version after the first is named (``rans v2(...)``): two versions read differently."""
    cfg = s.get_config()
    name = s.name if s.version == 1 else f"{s.name} v{s.version}"
    return name + ("(" + ", ".join(f"{k}={v}" for k, v in sorted(cfg.items())) + ")" if cfg else "")


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


def describe(r: Any, path: str) -> dict[str, Any]:
    """Everything ``kvc info`` reports about an open reader, as plain data (JSON-serialisable but for ``meta``)."""
    hd = r.header
    sz = r.sizes()
    elems = hd.num_elements
    # kept fraction: the prune record when the file has one (lingua files hold the pruned text's ids and no
    # positions, so only the record knows the original context), else stored / context tokens of a pruned file
    rec = PruneRecord.from_meta(hd.meta)
    kept: float | None = None
    if rec is not None and rec.kept_fraction is not None:
        kept = rec.kept_fraction
    elif hd.pruned and hd.num_context_tokens:
        kept = hd.num_tokens / hd.num_context_tokens
    orig_ctx = context_tokens(hd.num_context_tokens, hd.meta)
    positions = None
    if hd.pruned:
        positions = "per-token" if hd.blobs[hd.positions_blob].shape == (hd.num_tokens,) else "per-layer-head"
    elif kept is not None:
        positions = (rec.positions if rec is not None else None) or "renumbered"
    ctx_elems = 2 * hd.kv_heads * sum(hd.head_dims) * orig_ctx
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
                  "fingerprint_version": hd.fingerprint.version, "layers": hd.num_layers, "kv_heads": hd.kv_heads, "head_dim": sorted(set(hd.head_dims))},
        "dtype": hd.dtype,
        "context_tokens": hd.num_context_tokens,
        "stored_tokens": hd.num_tokens,
        "layer_tokens": list(hd.layer_tokens) if hd.ragged else None,  # sliding-window layers keep their window only
        "kept_fraction": kept,
        "original_context_tokens": orig_ctx,
        "positions": positions,
        "token_ids": "stored" if hd.token_ids_blob is not None else "hash only",
        "chunks": len(r.entries),
        "codec": hd.codec,
        "pipelines": pipelines,
        "attachments": {n: {"dtype": a.dtype, "shape": list(a.shape), "external": a.blob is None} for n, a in hd.attachments.items()},
        "kv_elements": elems,
        "bits_per_element": bits_per_element(sz["file"], elems),
        "ratio_vs_fp16": elems * 2 / sz["file"],
        "context_kv_elements": ctx_elems,
        "bits_per_context_element": None if kept is None else bits_per_element(sz["file"], ctx_elems),
        "sizes": sz,
        "meta": hd.meta,  # an edited file's edit log is meta["edits"] (spec section 4.5)
        # required feature bit 1 (spec section 4.6): only a loader that applies it may use the K/V
        "attention_bias": None if hd.attention_bias is None else {
            "attention_heads": hd.attention_bias.attention_heads, "biased_heads": len(hd.attention_bias.entries),
            "layers": hd.attention_bias.layers()},
    }
