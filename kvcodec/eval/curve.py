"""Rate-quality sweeps: every method encoded into a real `.kvc`, decoded, evaluated.

For each text: the exact cache is captured once (and kept on disk, keyed by
the model fingerprint and a hash of the context token ids), the exact side of
the evaluation (continuation logits + greedy tokens) is computed once, then
every method/setting is

1. encoded to a real `.kvc` file in a temp dir (its size, in file bytes with
   header, index, side data and all, gives ``bits_per_element`` =
   bytes * 8 / KV elements of the *full* context, so pruned caches are
   charged against the same denominator),
2. read back with the format's reader, and
3. evaluated with :func:`kvcodec.models.quality.evaluate` against the exact cache.

Methods come in families: ``kvcodec`` (the codec's presets), ``kvcodec-kl``
(the codec's ``plan_for_target`` at ``--target-kl`` points), the baselines
(``fp16``, ``fp16+zstd``, ``int8``, ``kivi``, ``cachegen``) and ``h2o`` (H2O
pruning alone, kept tokens stored as fp16).

Results are resumable: rows already present in the JSON output (same model
fingerprint, context tokens, continuation, method and kvcodec source code) are
reused. The code digest is part of the key because a preset's name does not
pin what it does: a row computed by older code is recomputed, never shown as
the current code's result.
"""

from __future__ import annotations

import csv
import functools
import math
import hashlib
import io
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvcodec.models.cachelayout import cache_prefix
from kvcodec.atomic import atomic_path, atomic_write_text, check_output, check_outputs_differ
from kvcodec.errors import KvcError, KvcInputError
from kvcodec.format import KvcReader, write_kvc
from kvcodec.digest import token_ids_sha256
from kvcodec.core.kvcache import KVCache
from kvcodec.calibration.store import default_resolver
from kvcodec.plan.presets import get_plan
from kvcodec.plan import pipelines as codecplan
from kvcodec.plan.pipelines import external_bytes
from kvcodec.plan.presets import PRESETS as _PRESETS

LOSSY_PRESETS = [n for n, p in _PRESETS.items() if p.lossy]

PLOT_FORMATS = (".png", ".svg", ".pdf")  # what --plot writes (matplotlib backends without extra deps)
SCHEMA = "kvcodec-curve/1"
BASELINE_FAMILIES = ("fp16", "fp16+zstd", "int8", "kivi", "cachegen")
# real peer libraries (kvcodec/eval/peers.py): run their own code, skipped with a reason when not installed
PEER_FAMILIES = ("hf-quanto", "hf-hqq", "kvpress")
# kvcodec's lossy presets in another configuration: family -> (keyword arguments of _preset, row note)
_PRESET_VARIANTS: dict[str, tuple[dict[str, Any], str]] = {
    "kvcodec-fixed": ({"rate": "fixed"}, "the preset's table step0, without rate control"),
    "kvcodec-checked": ({"rate": "check"}, "rate control confirmed by the opt-in encode-time check (--check)"),
    "kvcodec-embedded": ({"embedded": True}, "calibration embedded in the file (its bytes are charged to this one file)"),
}
ALL_FAMILIES = ("kvcodec", "kvcodec-kl", *BASELINE_FAMILIES, *PEER_FAMILIES, "h2o")
# not in "all": the lossy presets at their table step0, with the opt-in check, or with an embedded calibration
EXTRA_FAMILIES = ("kvcodec-fixed", "kvcodec-checked", "kvcodec-embedded")
DEFAULT_TARGET_KLS = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2)
DEFAULT_H2O_BUDGETS = ("h2o:0.2", "h2o:0.35", "h2o:0.5", "h2o:0.75")
CSV_FIELDS = (
    "text", "family", "method", "bits_per_element", "ratio_vs_fp16", "file_bytes", "kl_mean", "dppl_percent",
    "top1_agreement", "greedy_match", "ppl_exact", "ppl_decoded", "context_tokens", "stored_tokens",
    "continuation_tokens", "external_bytes", "encode_s", "decode_s", "eval_s", "error",
)


# -- the codec's presets ------------------------------------------------------------------
def codec_presets() -> list[str]:
    """Preset names worth sweeping: ``lossless`` and ``fp16`` (format) and the lossy presets (codec).

    ``raw`` (fp32 as is) and ``zstd`` (lossless minus shuffle) are left out of sweeps.
    """
    return ["lossless", "fp16"] + [n for n in LOSSY_PRESETS if n not in ("lossless", "fp16")]


# -- method registry ----------------------------------------------------------------------
@dataclass
class TextCase:
    """One text: the exact capture and what the evaluation needs from it."""

    name: str
    cache: KVCache
    continuation: np.ndarray
    tokens_sha: str
    exact_logits: Any = None
    exact_greedy: list[int] | None = None
    scores: np.ndarray | None = None  # H2O attention scores, computed on demand
    kvpress_kept: dict[str, np.ndarray] | None = None  # kvpress runner key -> kept indices, computed on demand
    near_tie_at: int | None = None  # first exact greedy step with a top-2 margin under guard.NEAR_TIE (None: none)


@dataclass
class Method:
    family: str
    setting: str
    # (lm, case) -> (cache to encode, plan with .pipelines/.attachments/.preset[/.chunk_tokens])
    build: Callable[[Any, TextCase], tuple[KVCache, Any]] | None
    note: str = ""
    # peers that are not .kvc encoders: (lm, case) -> (the cache the peer attends to, bits it stores)
    roundtrip: Callable[[Any, TextCase], tuple[KVCache, int]] | None = None

    @property
    def key(self) -> str:
        return f"{self.family}/{self.setting}"


@dataclass
class MethodList:
    methods: list[Method] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def _baseline(name: str) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        from kvcodec.plan.baselines import get_baseline_plan

        return case.cache, get_baseline_plan(name, case.cache)

    return build


def _preset(name: str, rate: str = "predict", embedded: bool = False) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        from kvcodec.calibration.build import ensure_calibration
        from kvcodec.plan.presets import preset_info

        cal = ensure_calibration(lm) if lm is not None and preset_info(name).lossy else None
        if embedded:  # the calibration travels inside the file (self-contained; its bytes are in file_bytes)
            return case.cache, get_plan(name, case.cache, lm=lm, cal=cal, calibration="embedded")
        return case.cache, get_plan(name, case.cache, lm=lm, cal=cal, rate=rate)

    return build


TUNE_TOKENS = 256


def _target(kl: float) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    """kvcodec at a KL target, tuned *without* peeking at the evaluation continuation.

    ``plan_for_target`` bisects the rate knob on a cache and a continuation;
    here the cache is the context minus its last TUNE_TOKENS tokens and the
    continuation is those tokens, all inside the context. The knob found is
    then applied to the full cache, which is evaluated on the held-out text
    that follows it.
    """
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        c = case.cache
        n_tune = min(TUNE_TOKENS, c.num_tokens // 4)
        if c.positions is not None or n_tune < 2:
            raise KvcInputError("target-KL tuning needs an unpruned cache of at least 8 tokens")
        tune = cache_prefix(c, c.num_tokens - n_tune, lm)
        _, info = codecplan.plan_for_target(tune, lm, target_kl=kl, continuation=c.token_ids[c.num_tokens - n_tune:])
        plan = codecplan.transform_plan(c, info["step0"], lm=lm, preset=f"target-kl-{kl:g}")
        plan.params = dict(getattr(plan, "params", {}) or {}, tuned_kl=info.get("kl_mean"), tuned_on="context tail")
        return c, plan

    return build


def _hf_quant(name: str) -> Callable[[Any, TextCase], tuple[KVCache, int]]:
    def roundtrip(lm: Any, case: TextCase) -> tuple[KVCache, int]:
        from kvcodec.eval.peers import HFQuantSpec, hf_quantized_roundtrip

        return hf_quantized_roundtrip(case.cache, HFQuantSpec.parse(name))

    return roundtrip


def _kvpress(name: str, every: list[str]) -> Callable[[Any, TextCase], tuple[KVCache, int]]:
    """A kvpress press (real library, own venv): the presses of ``every`` run once per text, in one subprocess."""
    def roundtrip(lm: Any, case: TextCase) -> tuple[KVCache, int]:
        from kvcodec.eval.peers import KvpressSpec, kvpress_indices, kvpress_roundtrip

        spec = KvpressSpec.parse(name)
        if case.kvpress_kept is None or spec.runner_key not in case.kvpress_kept:
            case.kvpress_kept = kvpress_indices(lm, case.cache, [KvpressSpec.parse(n) for n in every])
        return kvpress_roundtrip(case.cache, case.kvpress_kept[spec.runner_key], spec)

    return roundtrip


def _h2o(spec: str) -> Callable[[Any, TextCase], tuple[KVCache, Any]]:
    def build(lm: Any, case: TextCase) -> tuple[KVCache, Any]:
        from kvcodec.plan.baselines import get_baseline_plan
        from kvcodec.prune.budget import parse_prune
        from kvcodec.prune.h2o import attention_scores, h2o_prune

        budget = parse_prune(spec)
        if case.scores is None:
            _, case.scores = attention_scores(lm, case.cache.token_ids, budget.window)
        pruned = h2o_prune(case.cache, case.scores, budget)
        return pruned, get_baseline_plan("fp16", pruned)

    return build


def select_methods(selected: list[str] | None = None, target_kls: list[float] | None = None,
                   h2o_budgets: list[str] | None = None) -> MethodList:
    """Methods for the families/names in ``selected`` (default: all).

    Entries may be families (``kivi``), one setting (``kivi2``, ``kvcodec:NAME``,
    ``h2o:0.25``) or ``all``.
    """
    sel = [s.strip() for s in (selected or ["all"]) if s.strip()]
    if "all" in sel:
        sel = [s for s in sel if s != "all"] + list(ALL_FAMILIES)
    out = MethodList()
    seen: set[str] = set()
    kv_names: list[str] = []  # every kvpress setting selected: their presses run in one subprocess per text

    def add(m: Method) -> None:
        if m.key not in seen:
            seen.add(m.key)
            out.methods.append(m)

    bl_family = {"fp16": ["fp16"], "fp16+zstd": ["fp16+zstd"], "int8": ["int8"], "kivi": ["kivi2", "kivi4"],
                 "cachegen": ["cachegen-lo", "cachegen", "cachegen-hi", "cachegen-ctx-lo", "cachegen-ctx", "cachegen-ctx-hi"],
                 "kivi-window": ["kivi2-window", "kivi4-window"]}
    bl_of = {name: fam for fam, names in bl_family.items() for name in names}
    for s in sel:
        if s in bl_family:
            for name in bl_family[s]:
                add(Method(s, name, _baseline(name)))
        elif s in bl_of:
            add(Method(bl_of[s], s, _baseline(s)))
        elif s == "kvcodec" or s.startswith("kvcodec:"):
            for n in codec_presets() if s == "kvcodec" else [s.split(":", 1)[1]]:
                add(Method("kvcodec", n, _preset(n)))
        elif s.split(":", 1)[0] in _PRESET_VARIANTS:
            fam = s.split(":", 1)[0]
            kw, note = _PRESET_VARIANTS[fam]
            for n in list(LOSSY_PRESETS) if s == fam else [s.split(":", 1)[1]]:
                if n not in LOSSY_PRESETS:
                    raise KvcInputError(f"{fam}: {n!r} is not a lossy preset ({', '.join(LOSSY_PRESETS)})")
                add(Method(fam, n, _preset(n, **kw), note=note))
        elif s == "kvpress" or s.startswith("kvpress:"):
            from kvcodec.eval.peers import DEFAULT_KVPRESS_SPECS, KvpressSpec, kvpress_available

            reason = kvpress_available()
            if reason is not None:
                if not any(n.startswith("kvpress") for n in out.notes):
                    out.notes.append(f"kvpress skipped: {reason}")
                continue
            names = [sp.name for sp in DEFAULT_KVPRESS_SPECS] if s == "kvpress" else [KvpressSpec.parse(s.split(":", 1)[1]).name]
            kv_names.extend(names)
            for n in names:
                add(Method("kvpress", n, None, roundtrip=_kvpress(n, kv_names),
                           note="real library (NVIDIA kvpress 0.5.5, own venv) picks the kept tokens; "
                                "bits = kept fraction x 16, or the QuantizedCache's stored bits of the kept entries"))
        elif s in PEER_FAMILIES or s.split(":", 1)[0] in PEER_FAMILIES:
            from kvcodec.eval.peers import DEFAULT_SPECS, HFQuantSpec, available

            fam = s.split(":", 1)[0]
            backend = fam.removeprefix("hf-")
            reason = available(backend)
            if reason is not None:
                if not any(backend in n for n in out.notes):
                    out.notes.append(f"{fam} skipped: {reason}")
                continue
            specs = [sp for sp in DEFAULT_SPECS if sp.backend == backend] if ":" not in s else [HFQuantSpec.parse(s.split(":", 1)[1])]
            for sp in specs:
                add(Method(fam, sp.name, None, roundtrip=_hf_quant(sp.name),
                           note="real library (transformers QuantizedCache); bits = codes + 16-bit scales/zeros"))
        elif s == "kvcodec-kl":
            for kl in target_kls or DEFAULT_TARGET_KLS:
                add(Method("kvcodec-kl", f"kl<={kl:g}", _target(float(kl)),
                           note=f"rate knob tuned on the context's last {TUNE_TOKENS} tokens, evaluated on the held-out continuation"))
        elif s == "h2o" or s.startswith("h2o:"):
            for spec in ([s] if s.startswith("h2o:") else (h2o_budgets or list(DEFAULT_H2O_BUDGETS))):
                add(Method("h2o", spec, _h2o(spec), note="H2O pruning only; kept tokens stored as fp16"))
        else:
            raise KvcInputError(
                f"unknown method {s!r} (families: {', '.join(ALL_FAMILIES)}; or one of "
                f"{', '.join(bl_of)}, kvcodec:PRESET, h2o:BUDGET)"
            )
    return out


# -- captures ----------------------------------------------------------------------------
def default_capture_dir() -> Path:
    from kvcodec.models.load import cache_root

    return cache_root() / "captures"


def cached_capture(lm: Any, ids: np.ndarray, capture_dir: str | os.PathLike | None) -> KVCache:
    """The exact cache of ``ids``, from ``capture_dir`` when it was captured before (keyed by fingerprint + token hash).

    A stored capture is reused only if it is what :func:`~kvcodec.models.capture.capture` gives now, its
    per-layer token counts included: one stored before the ragged layout (every layer every token)
    would otherwise be measured in place of the sliding-window layers' real, shorter tensors.
    """
    from kvcodec.models.cachelayout import kept_tokens
    from kvcodec.models.capture import capture
    from kvcodec.core.kvcache import load_h5, save_h5

    if capture_dir is None:
        return capture(lm, token_ids=ids)
    d = Path(capture_dir)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"{lm.fingerprint.id[:16]}-{token_ids_sha256(ids)[:24]}.h5"
    if path.is_file():
        try:
            c = load_h5(path)
            layout = tuple(kept_tokens(w, len(ids)) for w in lm.attention_windows)
            if (lm.fingerprint.same_model(c.fingerprint) and np.array_equal(c.token_ids, ids) and c.positions is None
                    and tuple(c.layer_tokens) == layout):
                return c
        except KvcError:
            pass  # a stale or broken entry is recomputed
    c = capture(lm, token_ids=ids)
    save_h5(c, path)
    return c


def load_case(lm: Any, text: str, max_tokens: int, continuation: int, capture_dir: str | os.PathLike | None) -> TextCase:
    from kvcodec.models.capture import select_context, tokenize
    from kvcodec.texts import load_text

    ids = tokenize(lm.tokenizer, load_text(text))
    ctx = select_context(ids, max_tokens, min_follow=continuation)
    cache = cached_capture(lm, ctx, capture_dir)
    cont = ids[len(ctx) : len(ctx) + continuation]
    return TextCase(name=text, cache=cache, continuation=cont, tokens_sha=token_ids_sha256(ctx))


# -- one measurement ----------------------------------------------------------------------
def kv_elements(cache: KVCache) -> int:
    """K+V elements of the *full* context (pruned caches are charged against the unpruned count)."""
    fp = cache.fingerprint
    return 2 * fp.num_kv_heads * sum(fp.head_dims) * cache.num_context_tokens


def charged_bits(row: dict[str, Any], store_docs: int = 1) -> float:
    """bits/element of a row with its external (per-model) calibration charged: all to this file
    (``store_docs=1``) or amortised over a store of ``store_docs`` documents of this size."""
    ext = int(row.get("external_bytes") or 0)
    return float(row["bits_per_element"]) + ext * 8.0 / store_docs / int(row["kv_elements"])


def rate_fields(file_bytes: int, cache: KVCache) -> dict[str, float]:
    bpe = file_bytes * 8 / kv_elements(cache)
    return {"bits_per_element": bpe, "ratio_vs_fp16": 16.0 / bpe, "file_bytes": int(file_bytes), "kv_elements": kv_elements(cache)}


def read_kvc_cache(path: str | os.PathLike, attachment_resolver: Callable[..., Any] | None = None) -> KVCache:
    """Decode a `.kvc` file (``attachment_resolver`` None: the reader's default, the per-model calibration)."""
    with KvcReader(str(path), attachment_resolver=attachment_resolver) as r:
        return r.read_cache()


def measure(lm: Any, case: TextCase, method: Method, workdir: str | os.PathLike, greedy_tokens: int = 16,
            encoded: tuple[Path, Any, float] | None = None) -> dict[str, Any]:
    """Encode, size, decode and evaluate one method on one text.

    ``encoded``: (path, plan, encode seconds) of a file the caller already wrote with this
    method's plan (the demo's own file): it is measured as it is, not encoded a second time.
    """
    from kvcodec.models.quality import continue_logits, evaluate
    from kvcodec.plan.check import first_near_tie, greedy_with_margins

    if case.exact_logits is None:
        case.exact_logits = continue_logits(lm, case.cache, case.continuation)
        case.exact_greedy, margins = (greedy_with_margins(lm, case.cache, int(case.continuation[0]), greedy_tokens)
                                      if greedy_tokens else ([], []))
        case.near_tie_at = first_near_tie(margins)
    if method.roundtrip is not None:
        return dict(_measure_roundtrip(lm, case, method, greedy_tokens), greedy_near_tie_at=case.near_tie_at)
    if encoded is not None:
        path, plan, t_enc = encoded
    else:
        assert method.build is not None
        t0 = time.perf_counter()
        to_encode, plan = method.build(lm, case)
        tag = hashlib.sha256(method.key.encode()).hexdigest()[:12]
        path = Path(workdir) / f"{case.tokens_sha[:12]}-{tag}.kvc"
        write_kvc(to_encode, path, plan, meta={"curve_method": method.key})
        t_enc = time.perf_counter() - t0
    size = path.stat().st_size
    t0 = time.perf_counter()
    decoded = read_kvc_cache(path, getattr(plan, "attachment_resolver", None))
    t_dec = time.perf_counter() - t0
    if encoded is None:
        path.unlink(missing_ok=True)
    t0 = time.perf_counter()
    q = evaluate(lm, case.cache, decoded, case.continuation, greedy_tokens=greedy_tokens,
                 exact_logits=case.exact_logits, exact_greedy=case.exact_greedy)
    t_eval = time.perf_counter() - t0
    row: dict[str, Any] = {"text": case.name, "family": method.family, "method": method.setting}
    row.update(rate_fields(size, case.cache))
    row["external_bytes"] = external_bytes(plan)  # the calibration file(s) a decoder must be sent too
    params = getattr(plan, "params", None) or {}
    for key in ("rate", "check"):  # rate control's choice; the opt-in check's tries, bytes and probe quality
        if params.get(key) is not None:
            row[key] = params[key]
    row.update(q.to_json())
    row.update(context_tokens=case.cache.num_context_tokens, stored_tokens=decoded.num_tokens,
               encode_s=round(t_enc, 3), decode_s=round(t_dec, 3), eval_s=round(t_eval, 3),
               greedy_near_tie_at=case.near_tie_at)
    if method.note:
        row["note"] = method.note
    return row


def _measure_roundtrip(lm: Any, case: TextCase, method: Method, greedy_tokens: int) -> dict[str, Any]:
    """A real peer library: its own quantize/dequantize, bits from what it stores (no .kvc file)."""
    from kvcodec.models.quality import evaluate

    assert method.roundtrip is not None
    t0 = time.perf_counter()
    decoded, bits = method.roundtrip(lm, case)
    t_enc = time.perf_counter() - t0
    t0 = time.perf_counter()
    q = evaluate(lm, case.cache, decoded, case.continuation, greedy_tokens=greedy_tokens,
                 exact_logits=case.exact_logits, exact_greedy=case.exact_greedy)
    t_eval = time.perf_counter() - t0
    n = kv_elements(case.cache)
    row: dict[str, Any] = {"text": case.name, "family": method.family, "method": method.setting,
                           "bits_per_element": bits / n, "ratio_vs_fp16": 16.0 * n / bits, "file_bytes": None,
                           "stored_bits": int(bits), "kv_elements": n, "external_bytes": 0, "real_library": True}
    row.update(q.to_json())
    row.update(context_tokens=case.cache.num_context_tokens, stored_tokens=decoded.num_tokens,
               encode_s=round(t_enc, 3), decode_s=None, eval_s=round(t_eval, 3))
    if method.note:
        row["note"] = method.note
    return row


# -- the sweep ----------------------------------------------------------------------------
@functools.cache
def code_digest() -> str:
    """sha256 (16 hex) of the kvcodec package's Python sources: which code computed a row."""
    root = Path(__file__).resolve().parents[1]  # the kvcodec package (this module is kvcodec/eval/curve.py)
    h = hashlib.sha256()
    for p in sorted(root.rglob("*.py")):
        h.update(p.relative_to(root).as_posix().encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _row_key(row: dict[str, Any]) -> tuple:
    return (row.get("fingerprint"), row.get("tokens_sha256"), row.get("continuation_tokens"), row.get("greedy_tokens"),
            row.get("family"), row.get("method"), row.get("code"))


def load_previous(path: str | os.PathLike | None) -> dict[tuple, dict[str, Any]]:
    if path is None or not Path(path).is_file():
        return {}
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        return {}
    return {_row_key(r): r for r in obj.get("rows", []) if isinstance(r, dict) and not r.get("error")}


def write_csv(rows: list[dict[str, Any]], path: str | os.PathLike) -> None:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(CSV_FIELDS), extrasaction="ignore")
    w.writeheader()
    for r in rows:
        w.writerow(r)
    atomic_write_text(path, buf.getvalue())


def run_curve(
    model: str,
    texts: list[str],
    max_tokens: int = 2048,
    continuation: int = 256,
    methods: list[str] | None = None,
    target_kls: list[float] | None = None,
    h2o_budgets: list[str] | None = None,
    json_out: str | os.PathLike | None = None,
    csv_out: str | os.PathLike | None = None,
    plot_out: str | os.PathLike | None = None,
    capture_dir: str | os.PathLike | None = "default",
    greedy_tokens: int = 16,
    progress: bool = True,
    lm: Any = None,
    cases: dict[str, TextCase] | None = None,
    measured: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Run the sweep; returns (and writes) ``{"schema", "model", "settings", "notes", "rows"}``.

    ``cases`` (text -> :func:`load_case`'s result) and ``measured`` (method key -> the row
    :func:`measure` returned for that method *on that case*) are work the caller has already
    done: ``kvc demo`` captured the document and measured its preset before the sweep, and
    redoing either would only cost minutes.
    """
    from kvcodec.models.load import load_model

    if not texts:
        raise KvcInputError("give at least one --text")
    if continuation < 2:
        raise KvcInputError(f"--continuation must be at least 2, got {continuation}")
    check_outputs_differ([json_out, csv_out, plot_out])
    for p in (json_out, csv_out, plot_out):  # refused before minutes of work, not after
        if p is not None:
            check_output(p, inputs=texts)
    if plot_out is not None and Path(plot_out).suffix.lower() not in PLOT_FORMATS:
        raise KvcInputError(f"--plot {plot_out}: name a {'/'.join(PLOT_FORMATS)} file")
    chosen = select_methods(methods, target_kls, h2o_budgets)
    if not chosen.methods:
        raise KvcInputError("no method to run: " + ("; ".join(chosen.notes) or "empty --methods"))
    if capture_dir == "default":
        capture_dir = default_capture_dir()
    lm = lm or load_model(model)
    previous = load_previous(json_out)
    result: dict[str, Any] = {
        "schema": SCHEMA,
        "model": model,
        "fingerprint": lm.fingerprint.id,
        "settings": {"texts": list(texts), "max_tokens": max_tokens, "continuation": continuation,
                     "greedy_tokens": greedy_tokens, "methods": [m.key for m in chosen.methods]},
        "notes": list(chosen.notes),
        "rows": [],
    }
    for n in chosen.notes:
        print(f"kvc curve: note: {n}", file=sys.stderr)
    from tqdm import tqdm

    total = len(texts) * len(chosen.methods)
    bar = tqdm(total=total, desc="kvc curve", unit="run", file=sys.stderr, disable=not progress, dynamic_ncols=True)
    with tempfile.TemporaryDirectory(prefix="kvc-curve-") as work:
        for text in texts:
            case = None
            for m in chosen.methods:
                bar.set_postfix_str(f"{text} {m.key}")
                if case is None:
                    case = (cases or {}).get(text) or load_case(lm, text, max_tokens, continuation, capture_dir)
                base = {"fingerprint": lm.fingerprint.id, "tokens_sha256": case.tokens_sha,
                        "continuation_tokens": int(case.continuation.size), "greedy_tokens": greedy_tokens,
                        "family": m.family, "method": m.setting, "code": code_digest()}
                row = previous.get(_row_key(base))
                if row is None:
                    try:
                        row = dict(measured[m.key]) if measured and m.key in measured else measure(lm, case, m, work, greedy_tokens)
                    except KvcError as exc:
                        row = {"text": text, "family": m.family, "method": m.setting, "error": str(exc)}
                        print(f"kvc curve: {text} {m.key}: {exc}", file=sys.stderr)
                    except Exception as exc:  # a bug in one method must not sink the sweep: record it, go on
                        row = {"text": text, "family": m.family, "method": m.setting,
                               "error": f"{type(exc).__name__}: {exc}"}
                        print(f"kvc curve: {text} {m.key}: unexpected {type(exc).__name__}: {exc}", file=sys.stderr)
                    row.update({k: v for k, v in base.items() if k not in row})
                    row["fingerprint"], row["tokens_sha256"] = base["fingerprint"], base["tokens_sha256"]
                    row["greedy_tokens"] = greedy_tokens
                else:
                    row = dict(row, text=text, reused=True)
                result["rows"].append(row)
                if json_out is not None:
                    atomic_write_text(json_out, json.dumps(result, indent=2, sort_keys=True, default=float) + "\n")
                bar.update(1)
    bar.close()
    if csv_out is not None:
        write_csv(result["rows"], csv_out)
    if plot_out is not None:
        plot_curve(result, plot_out)
    return result


# -- plotting -----------------------------------------------------------------------------
KL_FLOOR = 1e-7


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points not dominated (fewer-or-equal bits and lower KL), sorted by bits."""
    front: list[tuple[float, float]] = []
    for b, k in sorted(points, key=lambda p: (p[0], p[1])):
        if not front or k < front[-1][1]:
            front.append((b, k))
    return front


def bits_at_kl(front: list[tuple[float, float]], kl: float) -> float | None:
    """Bits of a Pareto frontier of (bits, KL) points at ``kl``, log-log interpolated; None outside its KL range."""
    pts = sorted(front, key=lambda p: p[1])  # increasing KL = decreasing bits
    for (b0, k0), (b1, k1) in zip(pts, pts[1:]):
        if k0 <= kl <= k1:
            if k1 == k0:
                return min(b0, b1)
            t = (math.log(kl) - math.log(k0)) / (math.log(k1) - math.log(k0))
            return math.exp(math.log(b0) + t * (math.log(b1) - math.log(b0)))
    return pts[0][0] if pts and kl == pts[0][1] else None


def plot_curve(result: dict[str, Any], out: str | os.PathLike) -> None:
    """One subplot per text: x = bits/element (log), y = mean KL (log); a line per family (its Pareto frontier)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if not r.get("error") and r.get("bits_per_element")]
    texts = list(dict.fromkeys(r["text"] for r in rows)) or ["(no data)"]
    families = list(dict.fromkeys(r["family"] for r in rows))
    colors = {f: plt.cm.tab10(i % 10) for i, f in enumerate(families)}
    markers = "osD^v<>PX*hp"
    fig, axes = plt.subplots(1, len(texts), figsize=(6.2 * len(texts), 5.2), squeeze=False)
    for ax, text in zip(axes[0], texts):
        for fam in families:
            fr = [r for r in rows if r["text"] == text and r["family"] == fam]
            if not fr:
                continue
            pts = [(float(r["bits_per_element"]), max(float(r["kl_mean"]), KL_FLOOR)) for r in fr]
            front = pareto(pts)
            ax.plot([p[0] for p in front], [p[1] for p in front], "-", color=colors[fam], lw=1.6, alpha=0.85, label=fam)
            for i, (r, (b, k)) in enumerate(zip(fr, pts)):
                on = (b, k) in front
                ax.plot([b], [k], markers[i % len(markers)], color=colors[fam], ms=6,
                        mfc=colors[fam] if on else "none")
                ax.annotate(str(r["method"]), (b, k), textcoords="offset points", xytext=(4, 3), fontsize=6, color=colors[fam])
        ax.set_xscale("log")
        ax.set_yscale("log")
        from matplotlib.ticker import FormatStrFormatter, LogLocator, NullFormatter

        ax.xaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 4.0, 6.0)))
        ax.xaxis.set_major_formatter(FormatStrFormatter("%g"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.axhline(KL_FLOOR, color="0.7", lw=0.6, ls=":")
        ax.set_xlabel("bits per KV element (real .kvc file bytes; log)")
        ax.set_ylabel(f"mean KL(exact || decoded), nats (log; 0 drawn at {KL_FLOOR:g})")
        ax.set_title(f"{text}: {result['settings'].get('max_tokens')} ctx, {result['settings'].get('continuation')} cont. tokens",
                     fontsize=10)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
        ax.legend(fontsize=7, loc="best", title="family (line = Pareto frontier;\nfilled = on frontier)", title_fontsize=6)
    fig.suptitle(f"kvcodec rate vs. quality, model {result.get('model')} (one panel per text)", fontsize=11)
    fig.tight_layout()
    try:
        with atomic_path(out) as tmp:  # the temp name has no image suffix: name the format
            fig.savefig(tmp, dpi=130, format=Path(out).suffix.lstrip(".").lower() or "png")
    finally:
        plt.close(fig)


def summary_table(rows: list[dict[str, Any]]) -> str:
    """Markdown table (text x method) of the measured rows."""
    head = "| text | family | method | bits/elem | ratio vs fp16 | KL (nats) | ΔPPL % | top-1 | greedy |"
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        if r.get("error"):
            lines.append(f"| {r['text']} | {r['family']} | {r['method']} | error: {r['error']} | | | | | |")
            continue
        lines.append(
            f"| {r['text']} | {r['family']} | {r['method']} | {r['bits_per_element']:.3f} | {r['ratio_vs_fp16']:.2f}x | "
            f"{r['kl_mean']:.2e} | {r['dppl_percent']:+.3f} | {r['top1_agreement']:.3f} | {r['greedy_match']:.3f} |"
        )
    return "\n".join(lines)


# -- `kvc eval`: one file against the text it was made from ----------------------------------
EVAL_CONTINUATION = 1024  # kvc eval's default: ΔPPL's interval narrows as 1/sqrt(tokens)


def eval_kvc_file(lm: Any, path: str | os.PathLike, text_ids: np.ndarray, continuation: int | None = None,
                  greedy_tokens: int = 16) -> dict[str, Any]:
    """Quality and rate of one `.kvc` file, continued on the text tokens following its context.

    Checks (each a one-line :class:`KvcError`): the file's model is ``lm``;
    the file's token ids are the text's first tokens; the text has
    ``continuation`` more tokens (None: up to :data:`EVAL_CONTINUATION`, as many as it has). The exact reference cache is recomputed by
    prefill of the file's token ids. A lingua-pruned file (a compressed prompt)
    is compared with the exact cache of its whole original context, both
    continued on the tokens after that context.
    """
    from kvcodec.models.capture import capture
    from kvcodec.errors import KvcInputError as _In
    from kvcodec.models.quality import evaluate

    if continuation is not None and continuation < 2:
        raise _In(f"--continuation must be at least 2, got {continuation}")
    path = Path(path)
    if not path.is_file():
        raise _In(f"no such file: {path}")
    size = path.stat().st_size
    with KvcReader(str(path), attachment_resolver=default_resolver) as r:
        lm.fingerprint.check_compatible(r.fingerprint, what=".kvc file")
        ids = r.token_ids
        n_ctx = int(r.header.num_context_tokens)
        text_ids = np.asarray(text_ids, dtype=np.int64).reshape(-1)
        prune = (r.header.meta or {}).get("prune")
        exact_ids = None
        if isinstance(prune, dict) and prune.get("method") == "lingua":  # a compressed prompt of the text's first tokens
            from kvcodec.prune.lingua import unpack_mask

            n_orig = prune.get("context_tokens")
            n_orig = n_orig if isinstance(n_orig, int) and not isinstance(n_orig, bool) else -1
            orig = text_ids[: max(n_orig, 0)]
            if n_orig < 1 or len(orig) < n_orig or token_ids_sha256(orig) != prune.get("original_ids_sha256"):
                raise _In(f"the text's first {n_orig} tokens are not the context this lingua-pruned file was made from")
            if ids is None or not np.array_equal(orig[unpack_mask(str(prune.get("kept_mask_b64")), n_orig)], ids):
                raise _In("the file's kept tokens are not the kept-token mask of its original context")
            exact_ids, n_ctx = orig, n_orig
        elif ids is None:  # the file stores only a hash of its ids: the text's first tokens must match it
            ids = text_ids[:n_ctx]
            if len(ids) < n_ctx or token_ids_sha256(ids) != r.header.token_ids_sha256:
                raise _In(f"the text's first {n_ctx} tokens are not the tokens this file encodes (hash mismatch)")
        else:
            common = min(len(ids), len(text_ids))
            diff = np.flatnonzero(ids[:common] != text_ids[:common])
            if diff.size:
                raise _In(f"the text differs from the tokens this file encodes at token {int(diff[0])} "
                          f"(file {int(ids[diff[0]])}, text {int(text_ids[diff[0]])})")
            if len(text_ids) < n_ctx:
                raise _In(f"the text has only {len(text_ids)} tokens but the file encodes a {n_ctx}-token context")
        if continuation is None:
            continuation = min(EVAL_CONTINUATION, len(text_ids) - n_ctx)
            if continuation < 2:
                raise _In(f"the text has only {len(text_ids) - n_ctx} tokens after the file's {n_ctx}-token context; "
                          "at least 2 are needed to score a continuation")
        if len(text_ids) < n_ctx + continuation:
            raise _In(f"the text has only {len(text_ids) - n_ctx} tokens after the file's {n_ctx}-token context, "
                      f"fewer than --continuation {continuation}")
        t0 = time.perf_counter()
        decoded = r.read_cache(token_ids=ids)
        t_dec = time.perf_counter() - t0
        preset = r.header.codec if hasattr(r.header, "codec") else None
    exact = capture(lm, token_ids=ids if exact_ids is None else exact_ids)  # lingua: the full original context
    cont = text_ids[n_ctx : n_ctx + continuation]
    t0 = time.perf_counter()
    if exact_ids is None:
        q = evaluate(lm, exact, decoded, cont, greedy_tokens=greedy_tokens)
    else:
        from kvcodec.prune import evaluate_pruned

        q = evaluate_pruned(lm, exact, decoded, cont, greedy_tokens=greedy_tokens)
    t_eval = time.perf_counter() - t0
    out: dict[str, Any] = rate_fields(size, exact)  # charged against the whole (unpruned) context's K+V elements
    out.update(q.to_json())
    out.update(file=str(path), preset=preset, context_tokens=n_ctx, stored_tokens=decoded.num_tokens,
               pruned=decoded.positions is not None or exact_ids is not None, decode_s=round(t_dec, 3), eval_s=round(t_eval, 3),
               greedy_tokens=greedy_tokens)
    return out
