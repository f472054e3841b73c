"""kvcodec's public API, in the spirit of safetensors' two calls: :func:`encode` and :func:`open`.

``encode`` is the whole encode workflow in one place: take a cache (or capture a text on a
model), optionally prune it, resolve the model's calibration once, plan (a preset, overrides,
or a quality target), and write one verified `.kvc` file. ``open`` returns the reader of a
file. Everything else (``kvc encode``, ``kvc ask``, the KDN service, the vLLM connector, the
benchmarks) is built on these and on the packages below them; the CLI only parses, calls
this, and renders the :class:`Encoded` record.

The one door to the encoder (issue 56): :func:`encode_cache` is the step every encode ends in (a cache
and a preset, or a ready plan, in; one verified file or its bytes out), with :func:`make_plan` (the
planner's inputs resolved once: the model where the preset uses one, the calibration, loaded or built once
by :func:`resolve_calibration`) and :func:`capture` (a prefill that observes what the preset's plan reads)
as its front ends. The packages above this one (runtime, integrations, eval, edit, service) encode only
through these, and read the preset table only through :func:`preset_info` / :data:`PRESETS`: a
``forbidden`` contract in pyproject.toml keeps them off ``kvcodec.format.writer`` and
``kvcodec.plan.presets``.

Loading a file straight into an engine lives with the engines: ``kvcodec.load_into`` is
:func:`kvcodec.integrations.hf.load_cache`, which is :func:`open` (with the model check) plus the
transformers cache adapter.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, BinaryIO, Callable, Mapping


from kvcodec.accounting import PruneRecord, bits_per_element, context_elements
from kvcodec.core.kvcache import KVCache
from kvcodec.core.stage import Plan
from kvcodec.errors import KvcInputError, is_int
from kvcodec.format import KvcReader
from kvcodec.plan.presets import BASELINE_PREFIX, DEFAULT_LOSSY, PRESETS, RATE_MODES, PresetInfo, check_overrides, preset_info

__all__ = ["DEFAULT_LOSSY", "PRESETS", "Encoded", "PresetInfo", "capture", "check_overrides", "default_preset", "encode",
           "encode_cache",
           "make_plan", "open", "preset_info", "resolve_calibration",
           "resolve_rate_model"]

Source = KVCache | str | os.PathLike


@dataclass
class Encoded:
    """What :func:`encode` wrote: sizes charged against the unpruned context, the plan, and what chose it."""

    output: str | None  # the path written, None for bytes
    preset: str  # the header's codec name: a preset, "<preset>+config" or "target-kl-<x>" / "target-dppl-<x>"
    size: int  # bytes of the file
    kv_elements: int  # K+V elements of the full, unpruned context: what every rate is charged against
    plan: Plan
    prune: PruneRecord | None = None
    target: dict[str, Any] | None = None  # the rate search's record (--target-kl / --target-dppl)
    data: bytes | None = None  # the file's bytes when no destination was given
    meta: dict[str, Any] = field(default_factory=dict)
    # what the read-back measured of each lossy (layer, "k"/"v")'s decoded error against the cache (ErrorSums); None
    # when nothing was read back (verify="off", an unreadable file object). Integrations check engines' chunks with it
    readback_errors: dict[tuple[int, str], Any] | None = None

    @property
    def bits_per_element(self) -> float:
        return bits_per_element(self.size, self.kv_elements)

    @property
    def ratio_vs_fp16(self) -> float:
        return self.kv_elements * 2 / self.size

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"output": self.output, "preset": self.preset, "bytes": self.size,
                             "kv_elements": self.kv_elements, "bits_per_element": self.bits_per_element,
                             "ratio_vs_fp16": self.ratio_vs_fp16}
        if self.prune is not None:
            d["prune"] = self.prune.to_json()
        if self.target is not None:
            d["target"] = self.target
        for key in ("rate", "check"):  # rate control's choice and the opt-in check's record
            if self.plan.params.get(key) is not None:
                d[key] = self.plan.params[key]
        return d


def encode(
    source: Source | None,
    dest: str | os.PathLike | BinaryIO | None = None,
    *,
    preset: str | None = DEFAULT_LOSSY,
    overrides: dict[str, Any] | None = None,
    model: Any = None,
    text: str | None = None,
    max_tokens: int | None = None,
    prune: Any = None,
    target_kl: float | None = None,
    target_dppl: float | None = None,
    check: bool = False,
    calibration: Any = None,
    chunk_tokens: int | None = None,
    chunk_heads: int | None = None,
    verify: str = "file",
    progress: Callable[[str], None] | None = None,
) -> Encoded:
    """Encode a KV cache into a `.kvc` file (``dest`` a path or binary file) or into bytes (``dest=None``).

    ``source`` is a :class:`~kvcodec.core.kvcache.KVCache` or the path of a raw capture
    (``.h5`` / ``.safetensors``); with ``source=None``, ``text`` (already loaded) is captured on
    ``model`` first (its first ``max_tokens`` tokens). ``model`` is a loaded model, a name or a
    model directory; lossy presets use it for their quality check and token importance, and it
    must be the cache's model. ``preset`` + ``overrides`` choose the codec
    (:func:`kvcodec.plan.presets.get_plan`). Lossy presets with a model choose their step by rate
    control (:mod:`kvcodec.plan.ratecontrol`: the step whose predicted KL is a fixed fraction of the
    preset's promise); ``target_kl`` / ``target_dppl`` (a mean ΔPPL in expectation, taken as the
    KL it corresponds to) replace the promise, within the preset's range (``preset=None``:
    ``balanced``'s settings). ``check`` confirms the step on the document's tail with the real
    model (:mod:`kvcodec.plan.check`). ``prune`` (a
    spec string such as ``"h2o:0.5"`` or a parsed budget) drops tokens first; the rate is still
    charged against the unpruned context. ``calibration`` is the model's calibration; when not
    given for a lossy preset with a model, it is loaded, or built once (minutes, with progress).
    ``verify`` is the writer's read-back policy (``"file"`` or ``"off"``).
    """
    _check_source_dest(source, dest)
    _check_types(preset=preset, overrides=overrides, progress=progress, text=text, max_tokens=max_tokens)
    targeted = target_kl is not None or target_dppl is not None
    if target_kl is not None and target_dppl is not None:
        raise KvcInputError("give only one of target_kl and target_dppl")
    if preset is None and not targeted:
        raise KvcInputError("give a preset (preset=None is balanced's settings at a target_kl / target_dppl)")
    if preset is None:  # a KL promise asked for by itself: the codec whose bits buy KL best (importance-weighted steps)
        preset = "balanced"
    baseline = preset is not None and preset.startswith("baseline:")
    info = None if preset is None or baseline else preset_info(preset)
    overrides = check_overrides(info.name, dict(overrides or {}), "overrides") if info is not None else dict(overrides or {})
    lossy = info is not None and info.lossy
    if targeted and overrides:
        raise KvcInputError("target_kl/target_dppl choose step0 themselves; give a preset, not overrides")
    if targeted and preset is not None and not lossy:
        raise KvcInputError(f"target_kl/target_dppl tune the lossy codec; they cannot be used with preset {preset}")
    budget = _budget(prune)
    say = progress or (lambda msg: None)
    lm = None

    def get_lm() -> Any:
        """The model, loaded on first need: the one given, else the capture's recorded model, else the default."""
        nonlocal lm
        if lm is None:
            from kvcodec.models.load import DEFAULT_MODEL

            fallback = cache.meta.get("model") if cache is not None and not isinstance(source, KVCache) else None
            lm = _model(model if model is not None else str(fallback or DEFAULT_MODEL))
            if cache is not None:
                lm.fingerprint.check_compatible(cache.fingerprint, what="capture")
        return lm

    cache: KVCache | None = None
    if source is None:
        if text is None:
            raise KvcInputError("give a cache or capture path, or text= (and model=) to capture")
        say(f"capturing {'the first ' + str(max_tokens) + ' tokens of ' if max_tokens else ''}the text on the model")
        cache = capture(get_lm(), text=text, max_tokens=max_tokens, preset=preset, overrides=overrides)
    elif isinstance(source, KVCache):
        cache = source
    else:
        from kvcodec.atomic import check_input
        from kvcodec.core.kvcache import load_capture

        check_input(source)
        cache = load_capture(source)
    if model is not None and not isinstance(model, str) and not isinstance(model, os.PathLike):
        get_lm()  # a loaded model costs nothing: check it against the cache now
    _check_against_cache(cache, overrides, chunk_tokens, chunk_heads)
    elems = context_elements(cache)  # the unpruned context's elements: what every rate is charged against
    target = None
    if targeted:
        from kvcodec.plan.presets import target_for

        assert info is not None
        target = target_for(info, target_kl=target_kl, target_dppl=target_dppl)

    if budget is not None:
        from kvcodec.prune import SCORES_META_KEY, H2OBudget, apply_prune

        stored = cache.meta.get(SCORES_META_KEY)
        want_w = "all" if getattr(budget, "window", None) is None else budget.window
        has_scores = isinstance(budget, H2OBudget) and isinstance(stored, dict) and stored.get("window") == want_w
        cache = apply_prune(cache, budget, lm=None if has_scores else get_lm())

    use_model = targeted or (lossy and info is not None and info.uses_model and (model is not None or
                                                                                not isinstance(source, KVCache)))
    plan = make_plan(cache, preset, overrides=overrides, model=get_lm() if use_model else None, calibration=calibration,
                     rate="check" if check else "predict", target=target)
    label = f"{plan.preset}+config" if overrides else str(plan.preset)
    meta: dict[str, Any] | None = None
    if overrides:
        meta = {"config": {"preset": preset, **overrides}}
    if targeted:
        label = f"target-kl-{target_kl:g}" if target_kl is not None else f"target-dppl-{target_dppl:g}"
        meta = {"target": {"kl": target_kl, "dppl_percent": target_dppl, "preset": preset, **plan.params.get("rate", {})}}
    enc = encode_cache(cache, plan, dest, label=label, meta=meta, chunk_tokens=chunk_tokens, chunk_heads=chunk_heads,
                       verify=verify, progress=say)
    # charged against the context before pruning; the prune record only when this call pruned
    return dataclasses.replace(enc, kv_elements=elems, prune=PruneRecord.from_meta(cache.meta) if budget is not None else None,
                               target=None if meta is None else meta.get("target"))


def capture(model: Any, *, text: str | None = None, token_ids: Any = None, max_tokens: int | None = None,
            preset: str | None = DEFAULT_LOSSY, overrides: Mapping[str, Any] | None = None) -> KVCache:
    """The cache of ``text`` (or ``token_ids``, the first ``max_tokens``) on ``model``, made for an encode with
    ``preset`` (+ ``overrides``): the prefill also observes the token importance that preset's plan reads, so the
    encode runs no second forward pass (:func:`kvcodec.models.capture.capture`'s ``score_window``)."""
    from kvcodec.models.capture import capture as prefill
    from kvcodec.plan.presets import score_window

    return prefill(_model(model), text=text, token_ids=token_ids, max_tokens=max_tokens,
                   score_window=score_window(preset, dict(overrides or {})))


def resolve_calibration(model: Any, preset: str, *, build: bool = True) -> Any:
    """The calibration an encode with ``preset`` plans with when ``model`` is at hand, resolved once (per encode,
    or once by a caller that encodes many caches of one model): for a lossy preset, the model's, loaded, or built
    and saved the first time (``build``; minutes, with progress:
    :func:`kvcodec.calibration.build.ensure_calibration`). None otherwise: the planner then loads the cache's
    model's own and refuses, in one line naming ``kvc calibrate``, a model that has none."""
    if model is None or not build or not _lossy(preset):
        return None
    from kvcodec.calibration.build import ensure_calibration

    return ensure_calibration(_model(model))


def resolve_rate_model(model: Any, calibration: Any, progress: bool = True) -> Any:
    """The model's rate model for this preset table (its settings, answer probes and chat factors): the user's or
    the shipped one, else fitted once and saved (minutes, with progress:
    :func:`kvcodec.onboard.ratefit.ensure_rate_model`). The one way callers get it, so every caller asks for the
    same settings and none makes another's stale; resolved here, before planning: the planner never fits."""
    from kvcodec.onboard.ratefit import ensure_rate_model
    from kvcodec.plan.presets import answer_targets, lossy_settings, preset_targets

    return ensure_rate_model(_model(model), calibration, lossy_settings(), progress=progress, answers=answer_targets(),
                             targets=preset_targets())


def default_preset(model: Any) -> tuple[str, str | None]:
    """The preset a knowledge base deposits with when none is named, and why it is not :data:`DEFAULT_LOSSY` (None
    when it is): ``lossless`` for a model whose context window cannot hold what every lossy preset is planned from,
    its calibration and its rate model's fit (:func:`~kvcodec.calibration.build.min_calibration_window`,
    :func:`~kvcodec.onboard.ratefit.min_fit_window`).

    Why a fallback and not the lossy default: neither can ever be built for such a model, so every lossy deposit
    would fail and every answer would be a prefill; lossless entries need neither, and keep the store's answers
    exact at about 1.5x fewer bytes than fp16. Decided from the model's config alone, before any lookup, so the
    entries' codec key never changes between asks. A preset named by the caller is used as named."""
    from kvcodec.calibration.build import min_calibration_window
    from kvcodec.models.capture import max_context
    from kvcodec.onboard.ratefit import min_fit_window

    lm = _model(model)
    window = max_context(lm)
    need = max(min_calibration_window(), min_fit_window())
    if window is None or window >= need:
        return DEFAULT_LOSSY, None
    return "lossless", (f"{lm.name}'s context window of {window} tokens is shorter than the {need} that a lossy "
                        f"preset's calibration and rate model are measured on")


def check_by_default(model: Any, preset: str, calibration: Any = None, overrides: Mapping[str, Any] | None = None) -> str | None:
    """Why a knowledge base's deposits of ``preset`` on ``model`` are checked with the model (``rate="check"``), or
    None where rate control's prediction alone is trusted.

    Why a default of its own (issue 57): a KDN stores chat contexts, and the rate model's chat probe (its contexts
    continued by a question and the model's answer, :mod:`kvcodec.onboard.chatfactor`) measures how far the
    prediction lands from the KL there. The chat factor corrects the mean; a probe row still off by more than rate
    control's margin (``1 / AIM``: it aims at ``AIM`` x the promise) after the factor, or a factor clipped at its
    ceiling, says that on this model predict-only can miss the promise on a context like it. Then every deposit
    pays for the check (a decode and a forward over the context's last 256 tokens) rather than risk a silent miss.
    A preset without rate control, a model without a calibration at hand, or a rate model from before the chat
    probe: None (as before)."""
    from kvcodec.plan.presets import rate_controlled
    from kvcodec.plan.ratecontrol import AIM

    if model is None or not _lossy(preset) or not rate_controlled(preset, "predict", None, **dict(overrides or {})):
        return None
    lm = _model(model)
    cal = calibration if calibration is not None else resolve_calibration(lm, preset)
    if cal is None:
        return None
    rm = resolve_rate_model(lm, cal)
    worst = rm.chat_residual(preset)
    if worst is None:
        return None
    from kvcodec.calibration.ratemodel import CHAT_FACTOR_RANGE

    if rm.chat(preset) >= CHAT_FACTOR_RANGE[1]:
        return f"the chat factor of {preset} reached its ceiling ({rm.chat(preset):g}) on this model's chat probe"
    if worst * AIM > 1.0:
        return (f"a chat probe context measured {worst:.2f}x the corrected prediction of {preset}, beyond rate "
                f"control's margin ({1 / AIM:.2f}x)")
    return None


def make_plan(cache: KVCache, preset: str, *, overrides: Mapping[str, Any] | None = None, model: Any = None,
              calibration: Any = None, rate: str = "predict", importance: Any = None, target: Any = None,
              build_calibration: bool = True, rate_model: Any = None, measure: bool = True) -> Plan:
    """The plan of ``preset`` (a preset name or ``baseline:NAME``) + ``overrides`` for ``cache``, its inputs resolved
    here, once, and handed to the planner as data (:func:`kvcodec.plan.presets.plan_preset`, which looks nothing up,
    fits nothing and runs no model but the opt-in check's):

    * ``model`` is used only where the preset uses one (rate control, token importance; a ``target`` uses it too);
    * ``calibration`` (None: :func:`resolve_calibration` with ``build_calibration``; without a model, the cache's
      model's stored one, or one line naming ``kvc calibrate``);
    * the model's ``rate_model`` where rate control chooses the step (None: :func:`resolve_rate_model`), and this
      context's factor on its prediction (the length factor, times the chat factor on a chat context);
    * ``importance`` ([L, T], precomputed; None: measured here with the model where the preset weighs tokens).

    ``rate``: ``"predict"`` (rate control's predicted step), ``"check"`` (that step confirmed on the document's tail
    with the model, :mod:`kvcodec.plan.check`) or ``"fixed"`` (the preset's table step). ``measure=False`` plans
    without the model (no rate control, no token importance: the table step) while the model still supplies the
    calibration: a steered cache, whose measures would miss its bias. The one way above this module to turn a
    preset into a plan."""
    from kvcodec.plan.presets import plan_preset, preset_args, rate_controlled

    if rate not in RATE_MODES:
        raise KvcInputError(f"rate must be one of {', '.join(RATE_MODES)}, got {rate!r}")
    info = None if isinstance(preset, str) and preset.startswith(BASELINE_PREFIX) else preset_info(preset)
    over = dict(overrides or {}) if info is None else check_overrides(preset, dict(overrides or {}))
    lm = _model(model) if model is not None and info is not None and (info.uses_model or target is not None) else None
    cal = calibration if calibration is not None else resolve_calibration(lm, preset, build=build_calibration)
    if not measure:
        lm = None
    lossy = info is not None and info.lossy
    args = preset_args(preset, over) if lossy else {}
    controlled = lm is not None and lossy and rate_controlled(preset, rate, target, **over)
    rm = rate_model
    if controlled and rm is None and lm is not None:
        if cal is None:  # the model's stored one (checked against the cache when planning): the rate model's basis
            from kvcodec.calibration.store import require_calibration

            cal = require_calibration(lm.fingerprint)
        rm = resolve_rate_model(lm, cal)
    # each input below reads the cache: looked up, then measured, then planned with, in that order
    if lossy and cal is None and args.get("basis", "pca") == "pca":
        from kvcodec.calibration.store import require_calibration

        cal = require_calibration(cache.fingerprint)  # no model at hand: the cache's model's own
    rate_inputs = None
    if controlled:
        from kvcodec.plan.ratecontrol import RateInputs

        factor, chat = rm.factor(preset, int(cache.num_tokens)), 1.0
        if rm.chat_factor.get(preset) is not None:
            from kvcodec.models.chat import is_chat_context

            if is_chat_context(lm, cache.token_ids):  # a question will read this context more than prose does (issue 57)
                chat = rm.chat(preset)
                factor *= chat
        rate_inputs = RateInputs(rm, factor, chat, getattr(lm, "name", None))
    if importance is None and lm is not None and args.get("tokenscale") is not None:
        from kvcodec.models.importance import cache_importance
        from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

        importance = cache_importance(lm, cache, window={**TOKENSCALE_DEFAULT, **args["tokenscale"]}["window"])
    return plan_preset(preset, cache, cal=cal, importance=importance, target=target, rate=rate_inputs,
                       check_model=lm if controlled and rate == "check" else None, **over)


def encode_cache(
    cache: KVCache,
    preset: str | Plan = DEFAULT_LOSSY,
    dest: str | os.PathLike | BinaryIO | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    model: Any = None,
    calibration: Any = None,
    rate: str = "predict",
    importance: Any = None,
    build_calibration: bool = True,
    label: str | None = None,
    meta: Mapping[str, Any] | None = None,
    chunk_tokens: int | None = None,
    chunk_heads: int | None = None,
    attention_bias: Any = None,
    verify: str = "file",
    progress: Callable[[str], None] | None = None,
) -> Encoded:
    """Encode ``cache`` with ``preset`` into a verified `.kvc` at ``dest`` (a path, atomically, or a binary file),
    or into bytes (``dest=None``: :attr:`Encoded.data`). The one way to encode: :func:`encode` (capture, prune,
    targets), the runtime, the engines, the evaluation and the edits all end here.

    ``preset`` is a preset name (planned by :func:`make_plan` with ``overrides``, ``model``, ``calibration``,
    ``rate``, ``importance`` and ``build_calibration``) or a ready :class:`~kvcodec.core.stage.Plan` (a baseline's,
    a target search's: then no planning input may be given). The file: ``label`` is the header's codec name
    (default: the plan's preset), ``meta`` is merged over the cache's, ``chunk_tokens`` / ``chunk_heads`` the chunk
    layout (default: the plan's), ``attention_bias`` the bias a loader must apply (spec/kvc-v1.md 4.6), ``verify``
    the writer's read-back policy (``"file"`` or ``"off"``).

    A cache with an ``attention_bias`` (a steered edit) is planned without the model: its rate control and token
    importance would measure the cache without its bias (a lossy preset then uses its table step, as without a
    model); the model still supplies the calibration.
    """
    if not isinstance(preset, str):
        if overrides or importance is not None or calibration is not None:
            raise KvcInputError("a ready plan takes no planning inputs (overrides, importance, calibration)")
        plan = preset
    else:  # a steered cache (attention_bias) is planned without measuring it: its measures would miss the bias
        plan = make_plan(cache, preset, overrides=overrides, model=model, calibration=calibration, rate=rate,
                         importance=importance, build_calibration=build_calibration, measure=attention_bias is None)
    name = label if label is not None else str(plan.preset)
    # only what is given: an option left out is the plan's own (its chunk layout, its preset name)
    opts: dict[str, Any] = {k: v for k, v in (("chunk_tokens", chunk_tokens), ("chunk_heads", chunk_heads), ("preset", label),
                              ("meta", meta), ("attention_bias", attention_bias)) if v is not None}
    if progress is not None:
        progress(f"encoding with {name}")
    data = None
    from kvcodec.format.readback import ReadBackErrors

    errors = ReadBackErrors()
    if dest is None:
        from kvcodec.format.writer import encode_kvc_bytes

        data = encode_kvc_bytes(cache, plan, verify=verify, errors=errors, **opts)
        n = len(data)
    else:
        from kvcodec.format.writer import write_kvc

        n = write_kvc(cache, dest, plan, verify=verify, errors=errors, **opts)
    return Encoded(output=os.fspath(dest) if isinstance(dest, (str, os.PathLike)) else None, preset=name, size=n,
                   kv_elements=context_elements(cache), plan=plan, prune=PruneRecord.from_meta(cache.meta), data=data,
                   meta=dict(meta or {}), readback_errors=errors.layers if errors.read else None)


def open(source: str | os.PathLike | bytes | Any, *, model: Any = None, **kw: Any) -> KvcReader:  # noqa: A001
    """The reader of a `.kvc` file (a path, bytes, or a range reader); use it as a context manager.

    ``model`` (a loaded model or its fingerprint), when given, is checked against the file's
    fingerprint before anything is decoded: a cache never loads into a different model. ``kw``
    go to :class:`~kvcodec.format.KvcReader` (e.g. ``max_decoded_bytes``, ``attachment_resolver``).
    ``model`` may also be a model name or directory, as :func:`encode` takes it (it is loaded).

    Everything it refuses is one :class:`~kvcodec.errors.KvcError` line (issue 55: a path with a NUL byte, a
    range reader whose ``read`` raises ``OSError``, ``model="smollm2"`` escaped as raw errors).
    """
    if isinstance(source, (str, os.PathLike)) and "\0" in os.fspath(source):
        raise KvcInputError("the path contains a NUL byte")
    unknown = sorted(set(kw) - _READER_OPTIONS)
    if unknown:  # open(path, bogus=1) escaped as TypeError
        raise KvcInputError(f"kvcodec.open takes no option {unknown[0]!r} (it takes model, {', '.join(sorted(_READER_OPTIONS))})")
    try:
        r = KvcReader(source, **kw)
    except OSError as exc:
        from kvcodec.atomic import io_error

        raise io_error(exc, f"reading {source if isinstance(source, (str, os.PathLike)) else type(source).__name__}") from None
    if model is not None:
        try:
            r.check_model(_model(model) if isinstance(model, (str, os.PathLike)) else model)
        except OSError as exc:
            r.close()
            from kvcodec.atomic import io_error

            raise io_error(exc, "reading the file") from None
        except BaseException:
            r.close()
            raise
    return r


#: the keywords :func:`open` passes on to the reader
_READER_OPTIONS = frozenset(("attachment_resolver", "max_decoded_bytes", "max_decoded_ratio", "max_chunk_bytes"))


def _check_against_cache(cache: KVCache, overrides: dict[str, Any], chunk_tokens: Any, chunk_heads: Any) -> None:
    """Settings that cannot mean anything for this cache, refused in one line (issue 55: ``kvc encode
    --chunk-heads 99`` on a 3-head cache and ``--config '{"preset": "balanced", "sink": 100000}'`` on a short
    context were written silently and exited 0)."""
    heads = int(cache.keys[0].shape[0]) if cache.keys else 0
    for name, v, hi in (("chunk_heads", chunk_heads, heads), ("chunk_tokens", chunk_tokens, None)):
        if v is None:
            continue
        if not is_int(v, 1, hi if hi is not None else (1 << 31) - 1):  # 2**70 tokens failed only the read-back
            raise KvcInputError(f"{name} must be an integer in [1, {hi if hi is not None else 'tokens'}]"
                                f"{f' (the cache has {heads} KV heads)' if hi is not None else ''}, got {v!r:.40}")
    n = int(cache.num_context_tokens)
    sink = overrides.get("sink")
    if isinstance(sink, int) and not isinstance(sink, bool) and sink > n:
        raise KvcInputError(f"sink ({sink}) is more tokens than the context has ({n})")


def _check_types(*, preset: Any, overrides: Any, progress: Any, text: Any = None, max_tokens: Any = None) -> None:
    """Arguments of the wrong type, refused in one line before any work (``preset=3``, ``overrides=[1]``,
    ``progress=3``, ``text=3`` / ``b"..."``, ``max_tokens="x"`` escaped as AttributeError / TypeError / ValueError;
    ``max_tokens=2.5`` / ``True`` were taken as numbers)."""
    if text is not None and not isinstance(text, str):
        raise KvcInputError(f"text must be a str (the document, already loaded), got {type(text).__name__}")
    if max_tokens is not None and not is_int(max_tokens, 1):
        raise KvcInputError(f"max_tokens must be a positive integer, got {max_tokens!r:.40}")
    if preset is not None and not isinstance(preset, str):
        raise KvcInputError(f"preset must be a preset name (a str), got {type(preset).__name__}")
    if overrides is not None and not isinstance(overrides, Mapping):
        raise KvcInputError(f"overrides must be a dict of preset settings, got {type(overrides).__name__}")
    if progress is not None and not callable(progress):
        raise KvcInputError(f"progress must be a callable taking one str, got {type(progress).__name__}")


def _check_source_dest(source: Any, dest: Any) -> None:
    """Refuse, in one line and before any work, a source :func:`encode` cannot read and a destination it cannot
    write or must not (issue 55: ``encode(src, src)`` replaced a 6 MB capture with a ``.kvc``; ``bytes`` as
    the source, a read-only or text-mode file object as the destination escaped as raw errors)."""
    import io

    if source is not None and not isinstance(source, (KVCache, str, os.PathLike)):
        raise KvcInputError(f"the source must be a KVCache or the path of a capture, got {type(source).__name__}")
    for p, what in ((source, "source"), (dest, "destination")):
        if isinstance(p, (str, os.PathLike)) and "\0" in os.fspath(p):
            raise KvcInputError(f"the {what} path contains a NUL byte")
    if dest is None or isinstance(dest, (str, os.PathLike)):
        if isinstance(dest, (str, os.PathLike)) and isinstance(source, (str, os.PathLike)):
            from kvcodec.atomic import check_output

            check_output(dest, inputs=[source])
        return
    if getattr(dest, "closed", False) is True:
        raise KvcInputError(f"the destination {type(dest).__name__} is closed")
    if isinstance(dest, io.TextIOBase):
        raise KvcInputError("the destination file is open in text mode; open it in binary mode ('wb')")
    write = getattr(dest, "write", None)
    writable = getattr(dest, "writable", None)
    if not callable(write) or (callable(writable) and not writable()):
        raise KvcInputError(f"the destination {type(dest).__name__} is not writable (open it with 'wb')")


def _model(model: Any) -> Any:
    """A loaded model from a LoadedModel, a model name or a local HF model directory."""
    if hasattr(model, "fingerprint") and hasattr(model, "model"):
        return model
    from kvcodec.models.load import load_model

    return load_model(str(model))


def _lossy(preset: Any) -> bool:
    """Whether ``preset`` names a lossy preset (a baseline is not one: it plans without a calibration)."""
    return not (isinstance(preset, str) and preset.startswith(BASELINE_PREFIX)) and preset_info(preset).lossy


def _budget(prune: Any) -> Any:
    if prune is None:
        return None
    from kvcodec.prune import PruneBudget, parse_prune

    if isinstance(prune, str):
        return parse_prune(prune)
    if not isinstance(prune, PruneBudget):  # prune=3 loaded the model, then failed on it as another model's
        raise KvcInputError(f"prune must be a spec string such as 'h2o:0.5' or a parsed budget, got {type(prune).__name__}")
    return prune
