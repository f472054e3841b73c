"""RoPE tables shared by the CPU and GPU decoders (spec/codec-v1.md, stage ``rope``).

The tables are computed on the CPU in float64 and rounded once to float32;
every decoder (CPU numpy, numba, Triton) must use exactly these tables, so
re-rotation is bit-identical everywhere.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from kvcodec.core.fingerprint import layer_applies_rope
from kvcodec.errors import KvcCodecError, KvcFormatError


def inv_freq(theta: float, dim: int) -> np.ndarray:
    """float64 [dim/2]: theta ** (-(2i)/dim)."""
    i = np.arange(0, dim, 2, dtype=np.float64)
    return 1.0 / (float(theta) ** (i / float(dim)))


def rope_angles(positions: Any, freqs: np.ndarray) -> np.ndarray:
    """float64 angles [..., 2 * len(freqs)] for ``positions`` [...]: the ONE RoPE table construction.

    angle[p, i] = float64(p) * freqs[i] (float64), the half-table duplicated (HF layout: channels
    j and j + dim/2 share frequency j). The stage's tables (:func:`rope_tables`), the encoder's
    float64 tables (:mod:`kvcodec.codecs.fastencode`) and CacheBlend's re-rotation
    (:mod:`kvcodec.runtime.blend`, per layer from :func:`layer_rope_config`) all take cos/sin of these.
    """
    ang = np.asarray(positions, dtype=np.float64)[..., None] * np.asarray(freqs, dtype=np.float64)
    return np.concatenate([ang, ang], axis=-1)


def rope_tables(positions: np.ndarray, theta: float, dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin float32 [..., dim] for integer ``positions`` [...]: cos/sin of :func:`rope_angles`
    taken in float64 and rounded to float32 (round-to-nearest-even)."""
    if dim <= 0 or dim % 2:
        raise KvcCodecError(f"rope dim must be a positive even number, got {dim}")
    ang = rope_angles(positions, inv_freq(theta, dim))
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def rope_config_from_fingerprint(rope_json: str, head_dim: int, layer: int | None = None) -> dict[str, Any]:
    """The ``rope`` stage config of ``layer`` for a model fingerprint's ``rope`` JSON.

    The JSON is flat (one set of parameters for every layer) or nested per
    layer type (``{"sliding_attention": {...}, "full_attention": {...},
    "layer_types": [...]}``, e.g. Gemma 3: local layers theta 1e4, global
    layers 1e6); the nested form needs ``layer``. Only plain (``default``)
    RoPE without scaling maps to the stage (its tables are a function of
    theta and dim alone); anything else raises KvcCodecError naming the
    feature, and the plan then codes that layer's post-RoPE keys.
    """
    try:
        r = json.loads(rope_json)
    except (TypeError, json.JSONDecodeError) as exc:
        raise KvcFormatError(f"bad rope JSON in fingerprint: {exc}") from None
    if not isinstance(r, dict):
        raise KvcFormatError("bad rope JSON in fingerprint: not an object")
    if not layer_applies_rope(r, layer):
        raise KvcCodecError(f"layer {layer} applies no RoPE (no_rope_layers): its keys are coded as they are")
    nested = {k: v for k, v in r.items() if isinstance(v, dict)}
    if nested:
        types = r.get("layer_types")
        if layer is None:
            raise KvcCodecError("per-layer-type RoPE parameters: the rope stage needs the layer")
        if not isinstance(types, list) or not 0 <= layer < len(types) or not isinstance(types[layer], str) \
                or types[layer] not in nested:
            raise KvcCodecError(f"per-layer-type RoPE parameters name no parameters for layer {layer}")
        r = {"partial_rotary_factor": r.get("partial_rotary_factor"), **nested[types[layer]]}
    theta = r.get("rope_theta")
    rtype = r.get("rope_type", "default")
    if r.get("rope_scaling") not in (None, {}) or rtype not in (None, "default"):
        raise KvcCodecError(f"rope type {rtype!r} / scaling {r.get('rope_scaling')!r} not supported by the rope stage")
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        raise KvcCodecError(f"rope_theta missing or invalid: {theta!r}")
    prf = r.get("partial_rotary_factor")
    dim = int(round(head_dim * float(prf if isinstance(prf, (int, float)) and 0 < prf <= 1 else 1.0)))
    if dim <= 0 or dim % 2:
        raise KvcCodecError(f"partial rotary dim {dim} of head_dim {head_dim} is not a positive even number")
    return {"theta": float(theta), "dim": dim}


def layer_rope_config(fingerprint: Any, layer: int, head_dim: int) -> dict[str, Any] | None:
    """``layer``'s rope stage config, or None where the model's RoPE variant has no rope stage
    (scaled RoPE, ...): the plans then code that layer's keys post-RoPE, losslessly consistent."""
    try:
        return rope_config_from_fingerprint(fingerprint.rope, head_dim, layer)
    except KvcCodecError:
        return None


def positions_for(ctx_positions: np.ndarray | None, layer: int, heads: int, tokens: int, token_start: int) -> np.ndarray:
    """Positions [H, T] (int64) of a chunk: ctx.positions ([T] or [L, H, T]) or arange."""
    if ctx_positions is None:
        p = np.arange(token_start, token_start + tokens, dtype=np.int64)
        return np.broadcast_to(p, (heads, tokens))
    p = np.asarray(ctx_positions)
    if p.ndim == 1 and p.shape[0] == tokens:
        return np.broadcast_to(p.astype(np.int64), (heads, tokens))
    if p.ndim == 3 and p.shape[1:] == (heads, tokens) and 0 <= layer < p.shape[0]:
        return p[layer].astype(np.int64)
    if p.ndim == 2 and p.shape == (heads, tokens):
        return p.astype(np.int64)
    raise KvcFormatError(f"positions of shape {p.shape} do not fit a chunk of {heads} heads x {tokens} tokens")
