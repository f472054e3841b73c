"""What a lossy preset promises on a continuation of its document (:class:`QualityTarget`).

Its own module because both the preset table (:mod:`kvcodec.plan.presets`) and the encode-time quality
check (:mod:`kvcodec.plan.check`) name it, and the presets call the check.
"""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE = 0.02  # top-2 logit margin under which a greedy token is not promised (fp16 storage moves logits ~0.012)


@dataclass(frozen=True)
class QualityTarget:
    """What a preset promises on a continuation of the document: mean KL (nats), ΔPPL (%), greedy tokens."""

    kl: float
    dppl_percent: float
    greedy_tokens: int = 0  # >0: that many greedy tokens identical to the exact cache's, up to the first near-tie
    margin: float = 0.5  # the probe must meet margin x kl (ΔPPL: a confidence bound, see kvcodec.plan.check)
    rival_gain: float = 0.0  # >0: the probe's max_rival_gain must stay under this (0: not checked)
