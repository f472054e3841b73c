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

This module runs the sweep: captures, one measurement, resumable rows.  The methods it compares are
:mod:`kvcodec.eval.methods`, its outputs are written by :mod:`kvcodec.eval.report` (whose frontier and table
helpers benchmarks import from here, the name they have always used), and ``kvc eval``'s one-file measurement is
:mod:`kvcodec.eval.fileeval`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from kvcodec.atomic import atomic_write_text, check_output, check_outputs_differ
from kvcodec.errors import KvcError, KvcInputError, json_loads
from kvcodec.api import encode_cache
from kvcodec.format import KvcReader
from kvcodec.digest import token_ids_sha256
from kvcodec.core.kvcache import KVCache
from kvcodec.plan.pipelines import external_bytes
from kvcodec.accounting import bits_per_element, context_elements
from kvcodec.eval.methods import Method, TextCase, select_methods
from kvcodec.eval.report import PLOT_FORMATS, bits_at_kl, pareto, plot_curve, summary_table, write_csv

# bits_at_kl, pareto, plot_curve, summary_table and write_csv are the report's (kvcodec.eval.report): named here
# because benchmarks/ (bench_curve.py, bench_calibration.py) import them from this module
__all__ = ["run_curve", "measure", "load_case", "cached_capture", "default_capture_dir", "charged_bits", "rate_fields",
           "read_kvc_cache", "kv_elements", "code_digest", "bits_at_kl", "pareto", "plot_curve", "summary_table",
           "write_csv"]

SCHEMA = "kvcodec-curve/1"


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
    """K+V elements of the *full* context (pruned caches are charged against the unpruned count):
    :func:`kvcodec.accounting.context_elements`, the one definition."""
    return context_elements(cache)


def charged_bits(row: dict[str, Any], store_docs: int = 1) -> float:
    """bits/element of a row with its external (per-model) calibration charged: all to this file
    (``store_docs=1``) or amortised over a store of ``store_docs`` documents of this size."""
    ext = int(row.get("external_bytes") or 0)
    return float(row["bits_per_element"]) + ext * 8.0 / store_docs / int(row["kv_elements"])


def rate_fields(file_bytes: int, cache: KVCache) -> dict[str, float]:
    bpe = bits_per_element(file_bytes, kv_elements(cache))
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
    from kvcodec.models.quality import continue_logits, evaluate, first_near_tie, greedy_with_margins
    from kvcodec.plan.targets import NEAR_TIE

    if case.exact_logits is None:
        case.exact_logits = continue_logits(lm, case.cache, case.continuation)
        case.exact_greedy, margins = (greedy_with_margins(lm, case.cache, int(case.continuation[0]), greedy_tokens)
                                      if greedy_tokens else ([], []))
        case.near_tie_at = first_near_tie(margins, NEAR_TIE)
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
        encode_cache(to_encode, plan, path, meta={"curve_method": method.key})
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


def check_greedy(lm: Any, n_ctx: int, continuation: int, greedy_tokens: Any,
                 lower: tuple[str, ...] = ("max_tokens", "continuation", "greedy_tokens")) -> None:
    """Refuse greedy tokens the model cannot generate within its context window (``--greedy-tokens 100000000`` ran
    on for as long as anyone let it): the greedy run continues the context by ``greedy_tokens + 1`` tokens."""
    from kvcodec.errors import KvcInputError, is_int
    from kvcodec.models.capture import check_fits

    if not is_int(greedy_tokens):
        raise KvcInputError(f"greedy_tokens must be an integer >= 0, got {greedy_tokens!r}")
    check_fits(lm, n_ctx + max(int(continuation), greedy_tokens + 1), "the context + continuation / greedy tokens",
               lower)


def load_previous(path: str | os.PathLike | None) -> dict[tuple, dict[str, Any]]:
    if path is None or not Path(path).is_file():
        return {}
    try:
        obj = json_loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):  # not UTF-8 (UnicodeDecodeError), not JSON or nested too deep
        return {}
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        return {}
    return {_row_key(r): r for r in obj.get("rows", []) if isinstance(r, dict) and not r.get("error")}



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
    check_greedy(lm, max_tokens, continuation, greedy_tokens)  # before any capture, not after the first method
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

