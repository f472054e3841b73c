"""A model's rate model: the fitted constants of the KL predictor (:mod:`kvcodec.plan.ratecontrol`), stored beside its calibration.

Why a file of its own and not more tensors in the calibration: ``.kvc`` files reference a
calibration by its content sha256, so changing it would orphan every file written before; the
rate model only steers the encoder (no decoder reads it). It is bound to the calibration it was
fitted with (``calibration_sha256``): a rebuilt calibration makes it stale, and a stale or
tampered one is refused in one line, never used.

Format (JSON, ``kvcodec-ratemodel`` version 1)::

    {"format": "kvcodec-ratemodel", "version": 1, "fingerprint_id": ..., "calibration_sha256": ...,
     "alpha": {"near-lossless": a, "balanced": a, "small": a},   # measured / predicted KL at t_ref tokens
     "t_ref": 1024,
     "curve": {"balanced": [[T, g], ...], ...},  # per preset: log growth from t_ref to T tokens (non-decreasing)
     "beta": {"balanced": b, ...},               # per preset: past its last curve point, (tokens / T_last) ** b
     "rival_per_step": g,      # near-lossless: max rival logit gain per unit step0 (linear law)
     "layer_factor": [[fk, fv], ...],  # per layer, K and V: measured / predicted KL of that tensor alone
     "presets_sha256": ...,    # the preset settings it was fitted for (others: refitted)
     "answer_step": {"faithful": {"factor": f, "tried": [...]}},  # the answer probe (kvcodec.onboard.answercheck)
     "chat_factor": {"balanced": {"factor": f, "rows": [...]}},  # chat contexts (kvcodec.onboard.chatfactor)
     "preset_sha256": {"balanced": ..., ...},  # per preset: its settings' digest (a preset added later is
                               # fitted alone and merged; one whose settings changed is refitted)
     "fit": [...]}             # the fit's measurements: KL, and ``dnll`` (the mean NLL change on the real
                               # continuation) from which :meth:`RateModel.dppl_ratio` is derived
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, TypeGuard

import numpy as np

from kvcodec.calibration.record import Calibration
from kvcodec.calibration.store import SHIPPED_DIR, _atomic_write, cache_write_error, calibration_dir
from kvcodec.errors import KvcFormatError, json_loads

RATE_FORMAT = "kvcodec-ratemodel"
RATE_VERSION = 3  # 3: per-(layer, kind) measured sensitivity; 2: per-preset length curves (1: one power law from t_ref)
_MAX_BYTES = 1 << 20
SHORT_EXPONENT = 1.0  # below t_ref tokens (outside the fit): the prediction x (t_ref / tokens) ** this
ALPHA_RANGE = (1e-3, 1e3)  # a fitted alpha outside this is a broken fit or a tampered file
BETA_RANGE = (0.0, 2.0)
CURVE_RANGE = (0.0, 5.0)  # log growth at a curve point: 0 (none) .. e^5 (a broken fit or a tampered file beyond)
ANSWER_FACTOR_RANGE = (1.0 / 64, 1.0)  # the answer probe only ever lowers a step
CHAT_FACTOR_RANGE = (1.0, 16.0)  # the chat factor only ever raises a prediction
LAYER_FACTOR_RANGE = (1.0 / 64, 64.0)  # the fit clips to [1/16, 16]; beyond this a file is broken or tampered
# rows whose KL is below this say nothing of the ratio: their NLL change is the continuation's sampling noise
# (~sqrt(2 KL / tokens)), many times their mean; near-lossless and faithful rows fall below it
DPPL_KL_FLOOR = 1e-3
DPPL_RATIO_RANGE = (0.25, 16.0)  # a pooled ratio outside this is a broken fit or a tampered file: clipped
DPPL_MIN_ROWS = 4
RECIPE_NAMES = ("quick", "thorough")  # kvcodec.onboard.ratefit.RECIPES' names (the record knows no fitter)


@dataclass
class RateModel:
    """The predictor's per-model constants (module docstring)."""

    fingerprint_id: str
    calibration_sha256: str
    alpha: dict[str, float]
    beta: dict[str, float]  # per preset: the growth's log-slope past its curve's last point
    t_ref: int
    rival_per_step: float | None = None
    fit: list[dict[str, Any]] = field(default_factory=list)
    fit_s: float | None = None  # seconds the fit took
    presets_sha256: str = ""  # the preset settings it was fitted for: other settings make it stale
    curve: dict[str, list[list[float]]] = field(default_factory=dict)  # per preset: [[tokens, log growth from t_ref], ...]
    layer_factor: list[list[float]] | None = None  # [L][2]: the calibration's sensitivity x this = the measured one
    # per preset: the digest of the settings its alpha and curve were fitted for. Why per preset: a preset added to
    # the table (or one whose settings change) is fitted alone, at ~1/(1 + presets) of a whole fit, and merged; the
    # others' constants and the per-layer factors stay (empty: a file from before, judged by presets_sha256 alone)
    preset_sha256: dict[str, str] = field(default_factory=dict)
    # per preset that promises answers: the answer probe's record (kvcodec.onboard.answercheck), whose "factor" (<= 1)
    # multiplies the step rate control picks: what keeps the probe's answers identical on this model
    answer_step: dict[str, dict[str, Any]] = field(default_factory=dict)
    # per lossy preset: measured over predicted KL on chat contexts continued by a question and the model's answer
    # (kvcodec.onboard.chatfactor), >= 1; rate control multiplies its prediction by it for a context in the model's chat
    # format (empty: not measured, a file from before: the factor is 1 as it was)
    chat_factor: dict[str, dict[str, Any]] = field(default_factory=dict)
    # which fit measured it (kvcodec.onboard.ratefit.FitRecipe): "quick" (a first use, plain kvc calibrate: two texts,
    # no per-layer factors) or "thorough" (kvc calibrate --thorough, the shipped models; a file from before)
    recipe: str = "thorough"
    # the dtype its prefills and chat answers ran in where that was not the model's own, for any of its measurements (a
    # merged or extended model: any part's; kvcodec.models.compute: bfloat16 on a CPU that computes it natively); None:
    # the model's own throughout. The KLs and answers it measures are always read in the model's own dtype
    prefill_dtype: str | None = None

    def chat(self, preset: str) -> float:
        """The factor rate control's prediction of ``preset`` is multiplied by on a chat context (1: none measured)."""
        rec = self.chat_factor.get(preset)
        return float(rec["factor"]) if rec is not None else 1.0

    def chat_residual(self, preset: str) -> float | None:
        """The worst measured-over-predicted KL among ``preset``'s chat probe rows once its chat factor is applied
        (None: not measured). Why: the factor is the rows' geometric mean, so one row's residual says how far the
        corrected prediction can still be off on a context like it; a KDN turns its encode-time check on where that
        exceeds rate control's margin (:func:`kvcodec.api.check_by_default`)."""
        rec = self.chat_factor.get(preset)
        if rec is None:
            return None
        rows = rec.get("rows")
        ratios = [float(r["kl"]) / float(r["predicted"]) for r in (rows if isinstance(rows, list) else [])
                  if isinstance(r, dict) and _num(r.get("kl")) and _num(r.get("predicted")) and r["predicted"] > 0]
        return max(ratios) / float(rec["factor"]) if ratios else None

    def answer_factor(self, preset: str) -> float:
        """The step factor that keeps ``preset``'s probe answers on this model (1: none measured, or none needed)."""
        rec = self.answer_step.get(preset)
        return float(rec["factor"]) if rec is not None else 1.0

    def dppl_ratio(self) -> float | None:
        """This model's KL-to-ΔPPL ratio: over the fit's rows with KL >= :data:`DPPL_KL_FLOOR`, the summed mean NLL
        change of the real continuation over the summed KL (pooled: one row's NLL change is mostly sampling noise).
        None when the fit did not record NLL changes (a file from before, or too few rows).

        Why: a ΔPPL "in expectation" equals the KL only on text the model itself would write (``E_p[log p/q]``).
        Real text is not drawn from the model, and how far the two part is a property of the model: measured on
        an unseen 0.5B model, ``balanced``'s ΔPPL ran about 2x its KL (issue 57), on SmolLM2 about half. Rate
        control aims at the tighter of the KL and ΔPPL promises with it (:func:`kvcodec.plan.ratecontrol.controlled_plan`).
        """
        rows = [r for r in self.fit if isinstance(r, dict) and _num(r.get("kl")) and _num(r.get("dnll"))
                and r["kl"] >= DPPL_KL_FLOOR]
        if len(rows) < DPPL_MIN_ROWS:
            return None
        kl = sum(float(r["kl"]) for r in rows)
        return float(np.clip(sum(float(r["dnll"]) for r in rows) / kl, *DPPL_RATIO_RANGE))

    def allocated(self, cal: Calibration) -> Calibration:
        """``cal`` with each (layer, kind)'s sensitivity times its measured ``layer_factor`` (the same bases and means,
        so files reference the same calibration): what rate control predicts and allocates steps with.

        Why: the calibration's per-layer sensitivity is a Fisher trace for isotropic noise on other text. Measured
        tensor by tensor at ``balanced``'s step (only that tensor decoded, the rest exact), the KL per unit of the
        codec's own predicted noise differs from it by 0.1-10x across layers, so steps of equal *estimated* slope
        were not of equal real slope. The plans' steps follow the sensitivity (equal slopes), so this re-allocates
        bits across layers and K/V as well as making each layer's prediction right.
        """
        return cal if self.layer_factor is None else allocate(cal, self.layer_factor)

    def factor(self, preset: str, tokens: int) -> float:
        """What multiplies the raw prediction of a ``tokens``-token context: ``alpha[preset]`` times the length
        curve's growth (log-linear in log tokens between its points, ``(tokens / T_last) ** beta`` past the
        last) from ``t_ref`` tokens up; ``alpha[preset] * (t_ref / tokens) ** SHORT_EXPONENT`` below it.

        Why a curve and not one power law: measured over predicted KL grows faster from 2K to 4K tokens than
        from 1K to 2K on both shipped models (the last window's queries stand for the continuation's less
        well as the context grows, and more tokens fall into tokenscale's coarse classes), and a power law
        through 1K and 2K under-predicted 4K by up to 4x. Why a different law below ``t_ref``: short contexts
        are more sensitive per unit of noise than the calibration's 1,024 tokens, and no fit covers them. On
        the tuning text gpl3 the raw prediction was 3.5x, 8.7x and 1.4x under the measured KL at 96, 256 and
        512 tokens. It spends bits on short documents, where bits are few.
        """
        a = self.alpha.get(preset)
        if a is None:  # a preset the fit did not cover: the mean alpha, the steepest curve
            a = math.exp(sum(math.log(v) for v in self.alpha.values()) / len(self.alpha))
            preset = max(self.curve, key=lambda p: self.growth(p, 1 << 16), default=preset)
        t = max(int(tokens), 1)
        if t < self.t_ref:
            return a * (self.t_ref / t) ** SHORT_EXPONENT
        return a * math.exp(self.growth(preset, t))

    def growth(self, preset: str, tokens: int) -> float:
        """log of the length curve of ``preset`` at ``tokens`` >= ``t_ref`` (0 at ``t_ref``; :meth:`factor`)."""
        pts = [(float(self.t_ref), 0.0)] + [(float(T), float(g)) for T, g in self.curve.get(preset, [])]
        t = float(tokens)
        for (t0, g0), (t1, g1) in zip(pts, pts[1:]):
            if t <= t1:
                return g0 + (g1 - g0) * math.log(t / t0) / math.log(t1 / t0)
        t_last, g_last = pts[-1]
        return g_last + self.beta.get(preset, 0.0) * math.log(max(t, t_last) / t_last)

    def to_json(self) -> dict[str, Any]:
        return {"format": RATE_FORMAT, "version": RATE_VERSION, **asdict(self)}

    @classmethod
    def from_json(cls, d: Any, where: str) -> "RateModel":
        def bad(why: str) -> KvcFormatError:
            return KvcFormatError(f"{where}: not a valid rate model ({why}); rebuild it: kvc calibrate --model MODEL --force")

        if not isinstance(d, dict) or d.get("format") != RATE_FORMAT or d.get("version") != RATE_VERSION:
            raise bad("wrong format or version")
        alpha = d.get("alpha")
        if not isinstance(alpha, dict) or not alpha or not all(
                isinstance(k, str) and _num(v) and ALPHA_RANGE[0] <= v <= ALPHA_RANGE[1] for k, v in alpha.items()):
            raise bad("alpha")
        beta, t_ref, rps = d.get("beta"), d.get("t_ref"), d.get("rival_per_step")
        if not (isinstance(beta, dict) and set(beta) <= set(alpha) and all(
                _num(v) and BETA_RANGE[0] <= v <= BETA_RANGE[1] for v in beta.values())):
            raise bad("beta")
        if not (isinstance(t_ref, int) and not isinstance(t_ref, bool) and 1 <= t_ref <= 1 << 24):
            raise bad("t_ref")
        if rps is not None and not (_num(rps) and rps > 0):
            raise bad("rival_per_step")
        fid, sha = d.get("fingerprint_id"), d.get("calibration_sha256")
        if not isinstance(fid, str) or not isinstance(sha, str):
            raise bad("binding")
        curve = d.get("curve", {})
        if not (isinstance(curve, dict) and set(curve) <= set(alpha) and all(_curve_ok(c, t_ref) for c in curve.values())):
            raise bad("curve")
        lf = d.get("layer_factor")
        if lf is not None and not (isinstance(lf, list) and 1 <= len(lf) <= 1024 and all(
                isinstance(r, list) and len(r) == 2 and all(_num(v) and LAYER_FACTOR_RANGE[0] <= v <= LAYER_FACTOR_RANGE[1]
                                                            for v in r) for r in lf)):
            raise bad("layer_factor")
        fit, fit_s, psha = d.get("fit", []), d.get("fit_s"), d.get("presets_sha256", "")
        per = d.get("preset_sha256", {})
        if not (isinstance(per, dict) and set(per) <= set(alpha) and all(isinstance(v, str) for v in per.values())):
            raise bad("preset_sha256")
        ans = d.get("answer_step", {})
        if not (isinstance(ans, dict) and set(ans) <= set(alpha) and all(
                isinstance(v, dict) and _num(v.get("factor")) and ANSWER_FACTOR_RANGE[0] <= v["factor"] <= ANSWER_FACTOR_RANGE[1]
                for v in ans.values())):
            raise bad("answer_step")
        chat = d.get("chat_factor", {})
        if not (isinstance(chat, dict) and set(chat) <= set(alpha) and all(
                isinstance(v, dict) and _num(v.get("factor")) and CHAT_FACTOR_RANGE[0] <= v["factor"] <= CHAT_FACTOR_RANGE[1]
                for v in chat.values())):
            raise bad("chat_factor")
        recipe = d.get("recipe", "thorough")
        if recipe not in RECIPE_NAMES:
            raise bad("recipe")
        cdt = d.get("prefill_dtype")
        if cdt not in (None, "float32", "bfloat16", "float16"):
            raise bad("prefill_dtype")
        return cls(fid, sha, {k: float(v) for k, v in alpha.items()}, {k: float(v) for k, v in beta.items()},
                   int(t_ref), None if rps is None else float(rps), fit if isinstance(fit, list) else [],
                   float(fit_s) if _num(fit_s) else None, psha if isinstance(psha, str) else "",
                   {k: [[float(p[0]), float(p[1])] for p in c] for k, c in curve.items()},
                   None if lf is None else [[float(v) for v in r] for r in lf], dict(per),
                   {k: {**v, "factor": float(v["factor"])} for k, v in ans.items()},
                   {k: {**v, "factor": float(v["factor"])} for k, v in chat.items()}, recipe, cdt)


def allocate(cal: Calibration, layer_factor: list[list[float]]) -> Calibration:
    """``cal`` with each (layer, kind)'s sensitivity times ``layer_factor`` [L][2] (:meth:`RateModel.allocated`); one
    object per (calibration, factors), so its projections are computed once; factors of another shape are one line."""
    key = tuple(map(tuple, layer_factor))
    memo = cal.__dict__.get("_allocated")
    if memo is not None and memo[0] == key:
        return memo[1]
    f = np.asarray(layer_factor, np.float64)
    if f.shape != cal.sensitivity.shape:
        raise KvcFormatError(f"rate model has layer factors {f.shape} for a calibration of {cal.sensitivity.shape}; "
                             "rebuild it: kvc calibrate --model MODEL --force")
    out = replace(cal, sensitivity=(cal.sensitivity.astype(np.float64) * f).astype(np.float32))
    cal.__dict__["_allocated"] = (key, out)
    return out


def _curve_ok(c: Any, t_ref: int) -> bool:
    """A preset's curve: at most 16 ``[tokens, log growth]`` points, lengths ascending from ``t_ref``, growth in range."""
    if not (isinstance(c, list) and len(c) <= 16 and all(
            isinstance(p, list) and len(p) == 2 and _num(p[0]) and _num(p[1]) and CURVE_RANGE[0] <= p[1] <= CURVE_RANGE[1]
            for p in c)):
        return False
    xs = [float(t_ref)] + [float(p[0]) for p in c]
    return all(b > a for a, b in zip(xs, xs[1:]))


def _num(v: Any) -> TypeGuard[int | float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _cal_sha(cal: Calibration) -> str:
    sha = cal.meta.get("content_sha256")
    if not isinstance(sha, str):
        raise KvcFormatError("calibration has no content sha256; rebuild it: kvc calibrate --model MODEL --force")
    return sha


def rate_model_path(cal: Calibration) -> Path:
    """Where the user's rate model of ``cal`` lives (beside the model's calibrations, named by the calibration's sha)."""
    return calibration_dir(str(cal.meta.get("fingerprint_id"))) / f"ratemodel-v{RATE_VERSION}-{_cal_sha(cal)[:16]}.json"


def shipped_rate_model_path(cal: Calibration) -> Path:
    return SHIPPED_DIR / f"{cal.meta.get('fingerprint_id')}.ratemodel.json"


def _read(path: Path, cal: Calibration) -> RateModel:
    if os.path.getsize(path) > _MAX_BYTES:
        raise KvcFormatError(f"{path}: rate model over {_MAX_BYTES} bytes")
    try:
        d = json_loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise KvcFormatError(f"{path}: unreadable rate model ({exc})") from None
    rm = RateModel.from_json(d, str(path))
    if rm.fingerprint_id != cal.meta.get("fingerprint_id") or rm.calibration_sha256 != _cal_sha(cal):
        raise KvcFormatError(f"{path}: rate model was fitted with another calibration; rebuild it: kvc calibrate --model MODEL --force")
    return rm


def presets_sha256(settings: Any) -> str:
    """The digest of the settings a rate model is fitted for (the lossy presets' tables, tokenscale defaults merged in)."""
    import hashlib

    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()


def load_rate_model(cal: Calibration, presets_digest: str | None = None,
                    accept: Callable[[RateModel], bool] | None = None) -> RateModel | None:
    """The rate model fitted with ``cal`` (the user's, else the shipped one) for the settings whose digest is
    ``presets_digest`` (None: any) and that ``accept`` takes (None: any), or None when there is none yet (a stale
    one is not used)."""
    for path in (rate_model_path(cal), shipped_rate_model_path(cal)):
        if path.is_file():
            rm = _read(path, cal)
            if (presets_digest is None or rm.presets_sha256 == presets_digest) and (accept is None or accept(rm)):
                return rm
    return None


def save_rate_model(rm: RateModel, path: Path) -> Path:
    """Write ``rm`` atomically at ``path`` (sorted keys: a deterministic fit gives identical bytes)."""
    text = json.dumps(rm.to_json(), sort_keys=True, indent=1) + "\n"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        _atomic_write(path, lambda tmp: tmp.write_text(text))  # the calibration store's one atomic write
    except OSError as exc:  # a directory where the file goes, a file where its directory goes, a full disk
        raise cache_write_error("rate model", exc) from None
    return path
