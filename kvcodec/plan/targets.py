"""What a lossy preset promises on a continuation of its document (:class:`QualityTarget`).

Its own module because the preset table (:mod:`kvcodec.plan.presets`), the rate control
(:mod:`kvcodec.plan.ratecontrol`) and the opt-in encode-time check (:mod:`kvcodec.plan.check`) all name it.

**Promises are stated on stable measures** (issue 33). Mean KL (nats per token) against the exact
cache and top-1 agreement have a per-token spread small enough that a few hundred tokens measure
them; ΔPPL does not: its per-token terms spread by about ``sqrt(2 KL)``, so on 256 tokens it swings
by ~0.5 % at balanced's KL whatever the codec does. A per-file bound on it forced KL 10-20x inside
the KL promise. So ΔPPL is promised *in expectation*: the mean over long continuations (≥ 2,048
tokens over ≥ 5 texts), reported with its confidence interval (``kvc eval``), never enforced on one file.
"""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE = 0.02  # top-2 logit margin under which a greedy token is not promised (fp16 storage moves logits ~0.012)


@dataclass(frozen=True)
class QualityTarget:
    """What a preset promises on a continuation of the document.

    ``kl``: mean KL (nats) against the exact cache, per file; ``top1``: top-1 agreement with the exact
    cache, per file; ``dppl_percent``: mean ΔPPL (%) in expectation over long continuations;
    ``greedy_tokens`` > 0: that many greedy tokens identical to the exact cache's, up to the first
    near-tie, kept by bounding ``rival_gain`` (the largest logit gain of any token over the exact top-1).
    """

    kl: float
    top1: float
    dppl_percent: float
    greedy_tokens: int = 0
    rival_gain: float = 0.0  # >0: the largest rival logit gain is kept under this (0: not bounded)
