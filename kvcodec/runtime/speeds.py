"""The adaptive client's estimators: prefill and per-level decode speed (priors, then an EMA of what this process
measured), per store URL bandwidth samples, and their harmonic mean (``spec/levels-v1.md`` §6).

Why a module of its own: the estimates outlive one stream (``SPEEDS`` is process-wide, so the next document is
planned with what the last one measured) and are the only state the streamer's decisions read besides the
manifest; :mod:`kvcodec.runtime.stream`'s docstring says why each estimator is what it is.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from kvcodec.store.levels import LEVEL_RANK


@dataclass
class Priors:
    """Speeds assumed before this process has measured any (replaced by measurements).

    Defaults are this project's 2-vCPU Xeon with SmolLM2-135M (README: 2048
    tokens prefilled in 13 s; a 2048-token balanced `.kvc` decoded in 0.82 s).
    """

    prefill_s_per_token: float = 13.0 / 2048
    decode_s_per_token: dict[str, float] = field(default_factory=lambda: {lv: 0.82 / 2048 for lv in LEVEL_RANK})
    first_token_s: float = 0.05  # the question's last-token logits and argmax beyond its prefill


class Speeds:
    """Process-wide measured speeds (EMA), per store URL bandwidth history."""

    def __init__(self, priors: Priors | None = None, alpha: float = 0.5) -> None:
        self.priors = priors or Priors()
        self.alpha = alpha
        self.prefill: float | None = None
        self.decode: dict[str, float] = {}
        self.bw: dict[str, list[float]] = {}
        self._lock = threading.Lock()

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new

    def prefill_spt(self) -> float:
        return self.prefill if self.prefill is not None else self.priors.prefill_s_per_token

    def decode_spt(self, level: str) -> float:
        return self.decode.get(level, self.priors.decode_s_per_token.get(level, 0.82 / 2048))

    def saw_prefill(self, tokens: int, seconds: float) -> None:
        if tokens > 0:
            with self._lock:
                self.prefill = self._ema(self.prefill, seconds / tokens)

    def saw_decode(self, level: str, tokens: int, seconds: float) -> None:
        if tokens > 0:
            with self._lock:
                self.decode[level] = self._ema(self.decode.get(level), seconds / tokens)


SPEEDS = Speeds()


def harmonic_mean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x > 0]
    return len(xs) / sum(1.0 / x for x in xs) if xs else None

