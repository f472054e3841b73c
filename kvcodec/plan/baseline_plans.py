"""The baselines' plans: ``kvcodec.plan.presets.get_plan("baseline:NAME", cache)`` builds them here.

The plan is the one :class:`~kvcodec.core.stage.Plan` type:
``.pipelines`` (one :class:`~kvcodec.core.stage.Pipeline` per (layer, kind),
keyed ``(layer, "k"|"v")`` and callable as ``pipelines(layer, kind)``, which
is what ``write_kvc`` takes), ``.attachments`` (none), ``.preset`` (the
baseline's name) and ``.chunk_tokens`` (the whole tensor: KIVI's fp16 window
is "the most recent 128 tokens of the context", so a (layer, kind) tensor
must be one chunk).

Baselines:

=============  ==============================================================
``fp16``       cast to fp16, raw
``fp16+zstd``  cast to fp16, raw, zstd (level 3)
``int8``       per-token int8 (absmax per (head, token), fp16 scale), raw
``kivi2``      KIVI 2-bit laid out as KIVI's code does after prefill: K per
               channel / V per token, groups of 32, fp16 scale + zero,
               bit-packed; fp16: the last ``T % 128`` keys and the last 128
               values
``kivi4``      same with 4 bits
``kivi2-window`` / ``kivi4-window``
               the first reimplementation: last 128 keys *and* values fp16
               (overcharges KIVI's keys; kept for comparison)
``cachegen``   CacheGen as shipped in LMCache: per-token scale over all heads
               and channels; K 32 bins in layers 0-9 and 16 after, V 32 bins
               in layers 0-1 and 16 after -- kept *literally* (LMCache's
               hard-coded split for 32-layer models) unless
               ``split="proportional"`` (then 10/32 and 2/32 of the layers);
               per-256-token-chunk, per-channel 33-entry int16 CDF; range
               coder
``cachegen-hi`` / ``cachegen-lo``
               the same codec with all bin counts doubled / halved (not a
               shipped setting: extra points for rate-distortion curves)
``cachegen-ctx``, ``cachegen-ctx-hi``, ``cachegen-ctx-lo``
               the same quantizer with one CDF table per context (as the
               CacheGen authors' artifact builds it) instead of LMCache's
               per-256-token tables, at the three bin levels above

All of these are reimplementations: neither KIVI nor CacheGen ships an
installable library. Real libraries (HF QuantizedCache with quanto / HQQ) run
their own code in :mod:`kvcodec.eval.peers`.
=============  ==============================================================
"""

from __future__ import annotations

from typing import Any, Callable

from kvcodec.errors import KvcInputError
from kvcodec.core.stage import Pipeline, Plan, Stage, stage_from_json
from kvcodec.codecs.lossless import Cast
from kvcodec.codecs import baselines as bl
BASELINES = ("fp16", "fp16+zstd", "int8", "kivi2", "kivi4", "kivi2-window", "kivi4-window", "cachegen", "cachegen-hi",
             "cachegen-lo", "cachegen-ctx", "cachegen-ctx-hi", "cachegen-ctx-lo")


class PipelineTable(dict):
    """``{(layer, kind): Pipeline}`` that is also the ``(layer, kind) -> Pipeline`` callable write_kvc takes."""

    def __call__(self, layer: int, kind: str) -> Pipeline:
        return self[(layer, kind)]


def _lossless(name: str) -> Stage:
    return stage_from_json({"name": name, "version": 1, "config": {}})


def cachegen_bins(layer: int, kind: str, num_layers: int, split: str = "literal", scale: float = 1.0) -> int:
    """Bins LMCache's CacheGen uses for (layer, kind)."""
    k_cut, v_cut = 10, 2
    if split == "proportional":
        k_cut, v_cut = round(10 * num_layers / 32), max(1, round(2 * num_layers / 32))
    elif split != "literal":
        raise KvcInputError(f"cachegen split must be 'literal' or 'proportional', got {split!r}")
    hi = layer < (k_cut if kind == "k" else v_cut)
    bins = int(round((32 if hi else 16) * scale))
    return max(4, bins + (bins % 2))


def get_baseline_plan(name: str, cache: Any, **kw: Any) -> Plan:
    """Plan encoding ``cache`` (a KVCache) with baseline ``name``.

    Keyword options: ``zstd_level`` (fp16+zstd), ``residual`` and ``group``
    (KIVI), ``split`` (cachegen: "literal" or "proportional").
    """
    if name not in BASELINES:
        raise KvcInputError(f"unknown baseline {name!r} (known: {', '.join(BASELINES)})")
    L = cache.num_layers
    make: Callable[[int, str], list[Stage]]
    meta: dict[str, Any] = {"baseline": name}
    if name == "fp16":
        make = lambda l, k: [Cast("float16"), _lossless("raw")]  # noqa: E731
    elif name == "fp16+zstd":
        level = int(kw.get("zstd_level", 3))
        make = lambda l, k: [  # noqa: E731
            Cast("float16"), _lossless("raw"), stage_from_json({"name": "zstd", "version": 1, "config": {"level": level}})
        ]
    elif name == "int8":
        make = lambda l, k: [bl.Int8TokenStage(), _lossless("raw")]  # noqa: E731
    elif name.startswith("kivi"):
        bits = int(name[4])
        layout = "window" if name.endswith("-window") else "code"
        group, residual = int(kw.get("group", 32)), int(kw.get("residual", 128))
        meta.update(bits=bits, group=group, residual=residual, layout=layout)
        make = lambda l, k: [bl.KiviStage(bits, "key" if k == "k" else "value", group, residual, layout)]  # noqa: E731
    else:
        split = kw.get("split", "literal")
        level = name.removeprefix("cachegen").removeprefix("-ctx")
        scale = {"": 1.0, "-hi": 2.0, "-lo": 0.5}[level]
        chunk = max(1, cache.num_tokens) if name.startswith("cachegen-ctx") else 256  # one table per context vs LMCache's 256
        meta.update(split=split, bins_scale=scale, table_tokens=chunk)
        # LMCache keeps all CDFs in one tensor sized for the largest bin count (+1): 33 entries as shipped.
        entries = max(cachegen_bins(l, k, L, split, scale) for l in range(L) for k in ("k", "v")) + 1
        meta.update(cdf_entries=entries)
        make = lambda l, k: [bl.CacheGenStage(bins=cachegen_bins(l, k, L, split, scale), chunk_tokens=chunk,  # noqa: E731
                                              cdf_entries=entries)]
    pipelines = PipelineTable({(l, k): Pipeline(make(l, k)) for l in range(L) for k in ("k", "v")})
    return Plan(pipelines=pipelines, preset=f"baseline:{name}", chunk_tokens=cache.num_tokens, meta=meta)
