"""The lossy transform-codec plans (what ``kvcodec.plan.presets.get_plan`` builds for near-lossless, balanced,
small) and quality-targeted rate search.

A plan maps every (layer, kind) to a codec :class:`~kvcodec.core.stage.Pipeline`
plus the attachments the pipelines need. The lossy presets are transform
codecs::

    keys:   rope -> keep(sink) -> transform(pca, k) -> quantize(step) -> rans
    values:         keep(sink) -> transform(pca, k) -> quantize(step) -> rans

with one rate knob ``step0``: the quantizer step of (layer, kind) is
``step0 / sqrt(w[l, kind] / wref)`` where ``w`` is the measured KL-per-MSE
sensitivity from the model calibration (equal weighted distortion slopes =
the rate-distortion optimum for entropy-coded uniform quantizers; under rate control, the calibration's
estimate times the rate model's per-layer factor measured at the operating point,
:meth:`kvcodec.calibration.ratemodel.RateModel.allocated`), and the
transform keeps only the PCA coefficients whose calibration variance is not
negligible at that step (reverse water-filling: coefficients far below the
step cost no bits and are dropped).
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np

from kvcodec.errors import KvcCodecError, KvcInputError
from kvcodec.lru import BoundedLRU
from kvcodec.core.stage import EncoderInputs, ExternalAttachment, Pipeline, Plan
from kvcodec.calibration.record import Calibration
from kvcodec.calibration.store import require_calibration
from kvcodec.plan.importance import token_multipliers
from kvcodec.codecs.rope_tables import layer_rope_config
from kvcodec.codecs.keep import KeepStage, keep_dtype
from kvcodec.codecs.quantize import QuantizeStage, WideQuantizeStage
from kvcodec.codecs.rope import RopeStage
from kvcodec.codecs.transform import TransformStage
from kvcodec.codecs.tokenscale import TokenClasses, TokenScaleStage

# token-importance-weighted quantization (tokenscale stage): importance = mean a^2 over the last
# `window` context queries, floored (`floor`, below); classes of `log2_step` (log2 of the step
# multiplier) from `min_log2` up.
TOKENSCALE_DEFAULT: dict[str, Any] = {"window": 512, "bits": 4, "log2_step": 0.5, "min_log2": -2.0, "power": 0.25,
                                       "max_log2": 2.0, "kinds": "kv", "floor": 0.02}
# Why a floor: the last `window` queries stand for the continuation's, and at long contexts they miss
# tokens a continuation returns to. Coded at the coarsest class, such tokens cost KL 0.49 (small) and
# 0.016 (balanced) on pydoc-exec at 4,096 tokens against 0.025 and 0.006 with 2 % of the importance
# spread uniformly (BENCHMARKS.md "Rate control"): a prior that every coded token may be read.
KEEP_VAR_FRACTION = 0.02  # drop a PCA coefficient when its variance < this x step^2


def layer_steps(cal: Calibration, step0: float) -> np.ndarray:
    """Quantizer step per (layer, kind) [L, 2] from the global knob and measured sensitivities."""
    w = np.maximum(cal.sensitivity.astype(np.float64), 1e-12)
    wref = math.exp(float(np.log(w).mean()))
    return step0 / np.sqrt(w / wref)


def kept_coefficients(cal: Calibration, steps: np.ndarray, group: int, frac: float = KEEP_VAR_FRACTION) -> np.ndarray:
    """Coefficients kept per (layer, kind) [L, 2]: max over heads of #(eigval >= frac * step^2), rounded up to ``group``."""
    L, _, H, D = cal.eigval.shape
    k = np.zeros((L, 2), np.int64)
    for l in range(L):
        for ki in range(2):
            n = int((cal.eigval[l, ki] >= frac * steps[l, ki] ** 2).sum(axis=-1).max())
            k[l, ki] = min(D, max(group, -(-n // group) * group))
    return k


_CLASSES: BoundedLRU[tuple[list[np.ndarray], np.ndarray]] = BoundedLRU(2)


def token_classes(importance: np.ndarray, sink: int, opts: dict[str, Any]) -> tuple[list[np.ndarray], np.ndarray]:
    """tokenscale's class of every token [T] per layer (sink tokens class 0) and the class -> multiplier table,
    from per-(layer, token) ``importance`` [L, T] and the full tokenscale options ``opts``.

    Read-only arrays, remembered by the importance's digest: rate control predicts with the very classes
    the plan then codes with, and computing them is a bisection per layer."""
    imp = np.ascontiguousarray(importance, np.float64)
    key = (hashlib.sha1(imp.tobytes()).hexdigest(), imp.shape, int(sink), tuple(sorted(opts.items())))
    hit = _CLASSES.get(key)
    if hit is not None:
        return hit
    classes: list[np.ndarray] = []
    table = np.ones(1, np.float32)
    for l in range(imp.shape[0]):
        c, table = token_multipliers(imp[l], sink, n_classes=1 << opts["bits"], log2_step=opts["log2_step"],
                                     min_log2=opts["min_log2"], power=opts["power"], max_log2=opts["max_log2"],
                                     floor=opts.get("floor", 0.0))
        cl = np.concatenate([np.zeros(min(sink, imp.shape[1]), np.uint8), c])
        cl.flags.writeable = False
        classes.append(cl)
    table.flags.writeable = False
    _CLASSES.put(key, (classes, table))
    return classes, table


# rans v2 (spec/rans-v2.md) with a table chosen per block of 128 tokens from a bank shared by the chunk's
# contexts: the same symbols in 9-10 % fewer bits than v1 on balanced / small, 1.4 % on near-lossless
# (benchmarks/BENCHMARKS.md, "Entropy contexts"); it changes bits only, never the decoded cache
RANS_BLOCKS = 128


def transform_plan(cache: Any, step0: float, sink: int = 4, group: int = 8, cal: Calibration | None = None,
                   calibration: str = "external", basis: str = "pca", preset: str = "custom", deadzone: float = 0.0,
                   lm: Any = None, tokenscale: dict[str, Any] | None = None, importance: np.ndarray | None = None,
                   max_bits: int = 8, rans_blocks: int = RANS_BLOCKS) -> Plan:
    """The transform-codec plan at rate knob ``step0``.

    ``cal``: the model's calibration, an input a PCA plan requires (resolved by its caller, once:
    :func:`kvcodec.plan.presets.get_plan`, :func:`kvcodec.api.make_plan`; never looked up here).
    ``calibration``: "external" (reference the per-model calibration by sha256),
    "embedded" (store the truncated bases in the file) or "none" (Hadamard).
    ``max_bits`` over 8 codes with ``quantize`` v2 (16-bit codes as two byte planes; the
    fused fast decoders take only v1, so such files decode stage by stage). ``rans_blocks`` > 0 codes the
    symbols with ``rans`` v2, a bank of tables shared by a chunk's contexts, one chosen per block of that many
    tokens (spec/rans-v2.md; :data:`RANS_BLOCKS` by default); 0 codes them with v1's table per context.
    """
    from kvcodec.codecs.rans import RansBankStage, RansStage

    fp = cache.fingerprint
    D = fp.head_dims[0]
    if any(d != D for d in fp.head_dims):
        raise KvcCodecError("transform presets need one head_dim for all layers")
    if basis == "pca":
        if cal is None:
            raise KvcInputError("a PCA plan needs the model's calibration (cal=): plan through kvcodec.api.make_plan, "
                                "which resolves it, or pass kvcodec.calibration.store.require_calibration(fingerprint)")
        cal.check_for(fp)  # also a calibration handed in by the caller: never encode with another model's
        steps = layer_steps(cal, step0)
        ks = kept_coefficients(cal, steps, group)
    else:
        steps = np.full((fp.num_layers, 2), float(step0))
        ks = np.full((fp.num_layers, 2), D, np.int64)
    attachments: dict[str, Any] = {}
    if basis == "pca":
        assert cal is not None
        if calibration == "embedded":
            attachments = cal.truncated(ks)
        elif calibration == "external":
            attachments = {n: ExternalAttachment.of(a) for n, a in cal.attachments.items()}
        else:
            raise KvcInputError(f"calibration must be 'external' or 'embedded' for a PCA plan, got {calibration!r}")
    g = group
    ts_classes: list[np.ndarray] | None = None
    ts_table: np.ndarray | None = None
    ts_opts: dict[str, Any] | None = None
    if tokenscale is not None:
        ts_opts = dict(TOKENSCALE_DEFAULT)
        ts_opts.update(tokenscale)
        if importance is None and lm is not None:
            from kvcodec.models.importance import cache_importance

            importance = cache_importance(lm, cache, window=ts_opts["window"])
        if importance is not None and np.shape(importance) == (fp.num_layers, cache.num_tokens):
            ts_classes, ts_table = token_classes(importance, sink, ts_opts)
        else:
            ts_opts = None

    def pipes(layer: int, kind: str) -> Pipeline:
        ki = 0 if kind == "k" else 1
        st: list[Any] = []
        rope_cfg = layer_rope_config(fp, layer, D) if kind == "k" else None  # None: unsupported variant, post-RoPE keys
        if rope_cfg is not None:
            st.append(RopeStage(**rope_cfg))
        if sink:
            st.append(KeepStage(sink=sink, recent=0, dtype=keep_dtype((cache.keys if kind == "k" else cache.values)[layer])))
        st.append(TransformStage(basis=basis, k=int(ks[layer, ki]), attachment="pca"))
        if ts_classes is not None and ts_opts is not None and kind in ts_opts["kinds"]:
            st.append(TokenScaleStage(bits=ts_opts["bits"]))
        step = float(np.float32(steps[layer, ki]))
        st.append(QuantizeStage(mode="step", step=step, max_bits=max_bits, deadzone=deadzone) if max_bits <= 8
                  else WideQuantizeStage(step=step, max_bits=max_bits, deadzone=deadzone))
        st.append(RansBankStage(channel_group=g, block_tokens=rans_blocks) if rans_blocks else RansStage(channel_group=g))
        return Pipeline(st)

    def inputs(layer: int, kind: str) -> EncoderInputs:
        """Layer ``layer``'s token classes (the encoder input of its tokenscale stage; none without one)."""
        if ts_classes is None or ts_table is None or ts_opts is None or kind not in ts_opts["kinds"]:
            return {}
        return {"tokenscale": TokenClasses(ts_classes[layer], ts_table, sink)}

    params = {"step0": step0, "sink": sink, "group": group, "calibration": calibration if basis == "pca" else "none",
              "basis": basis, "deadzone": deadzone,
              "tokenscale": ts_opts, "rans_blocks": rans_blocks}
    if max_bits != 8:  # recorded only where it differs: files of 8-bit plans keep their bytes
        params["max_bits"] = max_bits
    return Plan(pipes, attachments, preset, params, encoder_inputs=inputs)


# --------------------------------------------------------------------------- measure
def external_bytes(plan: Any) -> int:
    """Bytes of the per-model calibration a plan's file depends on but does not hold (0 if none): the calibration
    files that must be shipped with it (:func:`kvcodec.calibration.store.shipped_bytes`)."""
    from kvcodec.calibration.store import shipped_bytes

    ext = {n: a for n, a in (getattr(plan, "attachments", None) or {}).items() if not isinstance(a, np.ndarray)}
    return shipped_bytes(ext) if ext else 0


def plan_for_target(cache: Any, lm: Any, target_kl: float | None = None, target_dppl: float | None = None,
                    continuation: np.ndarray | None = None, iters: int = 7, lo: float = 0.005, hi: float = 1.0,
                    verbose: bool = False, **kw: Any) -> tuple[Plan, dict[str, Any]]:
    """Largest ``step0`` (fewest bits) whose decoded cache meets the quality target, by bisection on log(step0).

    Quality is measured with the real model on ``continuation`` (tokens that
    follow the cache). Returns (plan, {"step0", "kl_mean", "dppl_percent", "bytes"}).
    """
    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.models.quality import compare_logits, continue_logits

    if (target_kl is None) == (target_dppl is None):
        raise KvcInputError("give exactly one of target_kl or target_dppl")
    if continuation is None or len(continuation) < 2:
        raise KvcInputError("plan_for_target needs a continuation of at least 2 tokens")
    continuation = np.asarray(continuation, np.int64)
    exact = continue_logits(lm, cache, continuation)
    cal = kw.pop("cal", None) or require_calibration(cache.fingerprint)
    if kw.get("tokenscale") is not None and kw.get("importance") is None:  # score the context once, not per probe
        from kvcodec.models.importance import cache_importance

        kw["importance"] = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **kw["tokenscale"]}["window"])

    def measure(step0: float) -> tuple[bool, dict[str, Any]]:
        plan = transform_plan(cache, step0, cal=cal, lm=lm, preset="target", **kw)
        dec, nbytes = roundtrip(cache, plan)  # the pipelines' own round trip: no container, nothing stored
        m = compare_logits(exact, continue_logits(lm, dec, continuation), continuation)
        ok = m["kl_mean"] <= target_kl if target_kl is not None else abs(m["dppl_percent"]) <= (target_dppl or 0.0)
        info = {"step0": step0, "kl_mean": m["kl_mean"], "dppl_percent": m["dppl_percent"], "payload_bytes": nbytes}
        if verbose:
            print(f"plan_for_target: step0={step0:.4g} payload bytes={nbytes} kl={m['kl_mean']:.3g} dppl={m['dppl_percent']:+.3f}% ok={ok}", flush=True)
        return ok, info

    ok_lo, best = measure(lo)
    if not ok_lo:
        raise KvcInputError(f"quality target not reachable even at step0={lo} (kl={best['kl_mean']:.3g}, dppl={best['dppl_percent']:+.3f}%)")
    a, b = math.log(lo), math.log(hi)
    for _ in range(iters):
        mid = 0.5 * (a + b)
        ok, info = measure(math.exp(mid))
        if ok:
            a, best = mid, info
        else:
            b = mid
    plan = transform_plan(cache, best["step0"], cal=cal, lm=lm, preset="target", **kw)
    return plan, best
