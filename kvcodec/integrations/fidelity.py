"""A lossy encode of a chunk an engine hands over, checked against what it decodes to; a chunk it does not hold is
stored lossless instead, the decision recorded in the `.kvc`'s meta.

Why: the lossy presets code each head in the calibration's PCA basis around the calibration's mean, keep the
coefficients whose calibrated variance matters at the step, and widen a channel's step when its values pass the
8-bit (16-bit) codes. That is right for the model's KV and wrong for chunks unlike it, which an engine's buffers do
hand over (a zeroed page, a constant fill, values far past the calibration's range, one hot outlier): measured on
SmolLM2 with ``balanced``, an all-zero chunk decoded with errors up to 2.4 (the mean outside the kept
coefficients came back), a constant 3.0 up to 7.8, an outlier of 5,000 spread errors of 32 over its whole head,
values of scale 1e4 errors of 3.8e4. The preset's promise (a KL on the model) holds for none of them, silently.

The check, per (layer, K or V), on the chunk as encoded: the decoded error's RMS at most :data:`STEP_FACTOR`
times the layer's calibrated quantizer step and at most :data:`OWN_FACTOR` times the layer's own RMS. Measured
through the LMCache serde on real chunks, every lossy preset: at most 1.54 steps and 0.72 of their RMS on SmolLM2
(4 x 256 tokens), 1.76 and 0.62 on Gemma 3 270M (2 x 192); the cases above: a constant 3.1 to 26 steps, values
of 1e4 1e4 steps or more, a zero layer (all of a zero chunk, all but one of an outlier's) any error at all. Why
a margin on the own RMS, and no test of the largest error: a plan may zero a tensor its calibration finds
insensitive (``balanced`` on a tiny model), which decodes it to about the calibration's mean, an error RMS of
1.0-1.02x the tensor's own and a largest error of 0.99x its largest value on the model's own keys; those tests at
1x sent the model's own KV to lossless. Without calibrated steps (no PCA basis, no mean to come back) the chunk is
its own measure at 1x: an error RMS no larger than its RMS, no decoded value further off than its largest
magnitude. A chunk that passes keeps its lossy bytes,
unchanged; one that fails is encoded lossless (bit-exact, and small for the degenerate cases: a zero chunk is a
few KB), with meta ``fallback_from`` (the preset) and ``fallback_why`` (the first failing layer).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Mapping

import numpy as np
import torch

from kvcodec.errors import KvcCodecError

log = logging.getLogger("kvcodec.integrations")
STEP_FACTOR = 3.0  # decoded RMS error allowed per layer, in units of its quantizer step (real chunks: <= 1.83)
OWN_FACTOR = 2.0  # ... and in units of the layer's own RMS (real chunks: <= 0.72; a tensor zeroed by design: ~1.02)


def layer_steps_of(preset: str, overrides: Mapping[str, Any] | None, cal: Any) -> np.ndarray | None:
    """The quantizer step of every (layer, K/V) [L, 2] that ``preset`` + ``overrides`` plan without a model (the
    table step: no rate control, no token importance), or None for a preset that is not lossy."""
    from kvcodec.api import preset_info
    from kvcodec.plan.pipelines import layer_steps

    info = preset_info(preset)
    if not info.lossy:
        return None
    over = dict(overrides or {})
    step0 = float(over.get("step0", info.settings["step0"]))
    if over.get("basis", info.settings.get("basis", "pca")) != "pca" or cal is None:
        return None  # no calibrated steps: the checks against the chunk's own values only
    return np.asarray(layer_steps(cal, step0), dtype=np.float64)


def _decoded_errors(cache: Any, data: bytes) -> dict[tuple[int, str], tuple[float, float, float, float]]:
    """(error RMS, largest error, values' RMS, largest value) per (layer, ``"k"``/``"v"``), decoding ``data`` once
    more: for an encode that was not read back (``verify="off"``), whose read-back measured nothing."""
    import kvcodec

    out = {}
    with kvcodec.open(data, max_decoded_ratio=0) as r:  # our own bytes, just written
        for i, k, v in r.iter_layers():
            for kind, got, want in (("k", k, cache.keys[i]), ("v", v, cache.values[i])):
                x = want.to(torch.float64)
                e = got.to(torch.float64) - x
                out[(i, kind)] = (float(e.pow(2).mean().sqrt()), float(e.abs().max()), float(x.pow(2).mean().sqrt()),
                                  float(x.abs().max()))
    return out


def misfit(cache: Any, enc: Any, steps: np.ndarray | None) -> str | None:
    """Why the encode ``enc`` (a :class:`kvcodec.Encoded`) does not hold ``cache`` as its preset promises (None if it
    does): see the module. The errors are the writer's read-back's own (``enc.readback_errors``: its decode of every
    chunk, measured against the input), so the check decodes nothing more; only an encode that was not read back is
    decoded again (1.26-1.30x the LMCache serde's encode CPU-s when every chunk was)."""
    if enc.readback_errors is not None:
        errors = {lk: (s.rms_err, s.max_err, s.rms_x, s.max_x) for lk, s in enc.readback_errors.items()}
    else:
        errors = _decoded_errors(cache, enc.data)
    for (i, kind), (rms_e, max_e, rms_x, max_x) in sorted(errors.items()):
        ki, where = "kv".index(kind), f"layer {i} {kind.upper()}"
        if not (np.isfinite(rms_e) and np.isfinite(max_e)):
            return f"{where} decodes to non-finite values"
        if steps is not None:  # the calibrated step, and the tensor's own RMS with a margin (see the module)
            if rms_e > STEP_FACTOR * float(steps[i, ki]):
                return (f"{where}: error RMS {rms_e:.3g} is {rms_e / float(steps[i, ki]):.3g} steps (the preset "
                        f"allows {STEP_FACTOR:g})")
            if rms_e > OWN_FACTOR * rms_x:
                return f"{where}: error RMS {rms_e:.3g} against values of RMS {rms_x:.3g}"
        elif rms_e > rms_x or max_e > max_x:
            return f"{where}: error up to {max_e:.3g} against values up to {max_x:.3g}"
    return None


def with_fallback(cache: Any, encode_lossy: Callable[[], Any], preset: str, steps: np.ndarray | None,
                  encode_lossless: Callable[[dict[str, Any]], bytes], what: str) -> bytes:
    """The bytes of ``encode_lossy()`` (a :class:`kvcodec.Encoded` of ``cache`` with lossy ``preset``) if it holds
    the chunk, else
    ``encode_lossless(meta)``: the chunk lossless, ``meta`` the two fallback fields to record. A chunk the lossy
    codec refuses (:class:`KvcCodecError`: NaN or inf, values past what its float16 steps can reach) is stored
    lossless the same way: before, such a chunk was not stored at all. ``what`` names the integration in the
    warning."""
    try:
        enc = encode_lossy()
    except KvcCodecError as e:
        why: str | None = f"the lossy codec refused it: {e}"
    else:
        why = misfit(cache, enc, steps)
        if why is None:
            return bytes(enc.data or b"")
    log.warning("%s: a chunk unlike the model's KV is stored lossless, not %s (%s)", what, preset, why)
    return encode_lossless({"fallback_from": preset, "fallback_why": why})
