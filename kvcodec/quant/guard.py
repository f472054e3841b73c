"""Quality targets checked on every file: a per-file probe on the real model at encode time (a statistical bound, not a proof).

A preset's fixed rate knob (``step0``) was tuned on a few texts; on a text it
has never seen it can miss its promise (issue 15: ``balanced`` gave ΔPPL
+1.39 % on one held-out text). The model is available whenever a lossy preset
encodes (it needs it for calibration and token importance), so the encoder
measures the file it is about to write instead of trusting the knob:

1. split the context: its last ``n`` tokens (the *probe*) are a real
   continuation of the first ``T - n`` tokens, inside the document;
2. encode the *whole* cache at the preset's ``step0``, decode it, and continue
   the decoded cache's first ``T - n`` tokens on the probe with the model
   (a causal model's KV prefix is the prefix's KV, so this is exactly what the
   file's bytes give a reader);
3. compare with the exact prefix on the same probe: mean KL, ΔPPL and, where
   the target asks for it, the greedy continuation;
4. accept when the probe's KL is within ``margin`` x the target and an
   upper confidence bound on ΔPPL is within the target; otherwise shrink
   ``step0`` and repeat.

Why a bound and not a margin on ΔPPL: ΔPPL on a continuation is the mean of
per-token log-likelihood differences, whose spread (about sqrt(2 KL) per
token) makes a 256-token ΔPPL swing by ~0.5 % at balanced's KL whatever the
codec does (issue 15's held-out run: probe ΔPPL within half the target,
continuation +1.05 %). So the probe's per-token differences d_t give
``mean(d) + z * std(d) / sqrt(REF_TOKENS)``: the ΔPPL a ``REF_TOKENS``-token
continuation of similar text would exceed with probability ~2 % (z = 2,
normal approximation). It is a statistical bound, not a proof: a
continuation unlike the document's own tail can still do worse.

The first acceptable ``step0`` is the largest tried, so a text the preset
already suits pays one probe (no extra bits), and a hard text pays bits
until it meets the target. Nothing in the file format changes: the chosen
``step0`` is already in every stage config and in the plan's metadata.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

import logging

log = logging.getLogger("kvcodec.guard")

PROBE_TOKENS = 256  # probe continuation length (tokens inside the context)
REF_TOKENS = 256  # continuation length the ΔPPL promise is stated for (kvc eval's default)
Z = 2.0  # one-sided normal quantile of the ΔPPL bound (~2.3 % exceedance)
MIN_PROBE_TOKENS = 16  # a shorter context is encoded at the preset's knob, unchecked (reported as such)
SHRINK = 0.75  # step0 factor per failed try
MAX_TRIES = 10  # 0.75^9 = 0.075: from balanced's knob down past near-lossless's


@dataclass(frozen=True)
class QualityTarget:
    """What a preset promises on a continuation of the document: mean KL (nats), ΔPPL (%), greedy tokens."""

    kl: float
    dppl_percent: float
    greedy_tokens: int = 0  # >0: that many greedy tokens must be identical to the exact cache's
    margin: float = 0.5  # the probe must meet margin x kl (ΔPPL: a confidence bound, see the module docstring)


def prefix_cache(cache: Any, n: int) -> Any:
    """The cache of the first ``n`` context tokens (a causal model's KV prefix is the prefix's KV)."""
    from ..kvcache import KVCache

    return KVCache([k[:, :n].contiguous() for k in cache.keys], [v[:, :n].contiguous() for v in cache.values],
                   cache.token_ids[:n], cache.fingerprint, None, dict(cache.meta))


def guarded_plan(cache: Any, lm: Any, preset: str, args: dict[str, Any], target: QualityTarget,
                 probe_tokens: int = PROBE_TOKENS, verbose: bool = False) -> Any:
    """The plan of ``preset`` at the largest ``step0`` (from ``args['step0']`` down) whose file meets ``target`` on the probe.

    Returns a :class:`~kvcodec.stages.Plan` whose ``params['guard']``
    records the probe, every try and the encode time the check cost.
    """
    from ..evaluate import compare_logits, continue_logits, greedy
    from .calibrate import get_calibration
    from .codecplan import TOKENSCALE_DEFAULT, decode_bytes, encode_bytes, transform_plan

    t_start = time.perf_counter()
    args = dict(args)
    step0 = float(args.pop("step0"))
    T = int(cache.num_tokens)
    n = min(probe_tokens, T // 4)
    if cache.positions is not None or n < MIN_PROBE_TOKENS:
        plan = transform_plan(cache, step0, lm=lm, preset=preset, **args)
        plan.params["guard"] = {"checked": False, "reason": "pruned cache or context under "
                                f"{4 * MIN_PROBE_TOKENS} tokens: encoded at the preset's step0 unchecked"}
        return plan
    probe = np.asarray(cache.token_ids[T - n:], np.int64)
    exact_prefix = prefix_cache(cache, T - n)
    exact_logits = continue_logits(lm, exact_prefix, probe)
    exact_greedy = greedy(lm, exact_prefix, int(probe[0]), target.greedy_tokens) if target.greedy_tokens else []
    cal = args.pop("cal", None) or get_calibration(lm, fingerprint_id=cache.fingerprint.id, build=True)
    if args.get("tokenscale") is not None and args.get("importance") is None:  # score the context once, not per try
        from .importance import cache_importance

        args["importance"] = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"])
    tries: list[dict[str, Any]] = []
    for i in range(MAX_TRIES):
        plan = transform_plan(cache, step0, cal=cal, lm=lm, preset=preset, **args)
        data = encode_bytes(cache, plan)
        dec = prefix_cache(decode_bytes(data), T - n)
        dec_logits = continue_logits(lm, dec, probe)
        m = compare_logits(exact_logits, dec_logits, probe)
        bound = dppl_bound(exact_logits, dec_logits, probe)
        same = True
        if target.greedy_tokens:
            same = greedy(lm, dec, int(probe[0]), target.greedy_tokens) == exact_greedy
        ok = m["kl_mean"] <= target.margin * target.kl and bound <= target.dppl_percent and same
        tries.append({"step0": step0, "bytes": len(data), "kl_mean": m["kl_mean"], "dppl_percent": m["dppl_percent"],
                      "dppl_bound_percent": bound, "greedy_identical": same if target.greedy_tokens else None, "ok": ok})
        if verbose:
            print(f"guard {preset}: step0={step0:.4g} bytes={len(data)} kl={m['kl_mean']:.3g} "
                  f"dppl={m['dppl_percent']:+.3f}% bound={bound:+.3f}% greedy={same} ok={ok}", flush=True)
        if ok or i == MAX_TRIES - 1:
            plan.params["guard"] = {"checked": True, "met": ok, "target": asdict(target), "probe_tokens": n,
                                    "tries": tries, "check_s": round(time.perf_counter() - t_start, 3)}
            if not ok:  # e.g. a near-tie in the probe's greedy tokens that no step flips back: best effort, said so
                log.warning(f"preset {preset}: no step0 down to {step0:.3g} met its quality target on the context's last "
                            f"{n} tokens (KL <= {target.margin * target.kl:g}, dPPL bound <= {target.dppl_percent:g} %"
                            f"{', identical greedy tokens' if target.greedy_tokens else ''}); encoded at that step")
            return plan
        step0 *= SHRINK
    raise AssertionError("unreachable")


def dppl_bound(exact_logits: Any, dec_logits: Any, tokens: np.ndarray, z: float = Z, ref_tokens: int = REF_TOKENS) -> float:
    """Upper bound (%) on the ΔPPL of a ``ref_tokens``-token continuation like ``tokens``: exp(mean + z sem) - 1."""
    import torch

    tgt = torch.as_tensor(np.asarray(tokens[1:], np.int64))[:, None]
    d = (torch.log_softmax(exact_logits[:-1].double(), -1).gather(1, tgt)
         - torch.log_softmax(dec_logits[:-1].double(), -1).gather(1, tgt))[:, 0]  # nll_decoded - nll_exact per token
    sem = float(d.std()) / float(np.sqrt(ref_tokens)) if d.numel() > 1 else 0.0
    return 100.0 * float(np.expm1(float(d.mean()) + z * sem))
