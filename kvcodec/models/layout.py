"""Model-family knowledge in one place: :class:`ModelLayout`, what kvcodec needs to know of a model's layout.

Why one module: capture, the fingerprint, calibration, token importance and CacheBlend each need a
slice of how a family lays out its attention (which config key names the head count, where the
decoder layers and the query projection are, whether a query norm spans one head or all of them,
which layers rotate their keys and how, which layers slide a window). Read in one place, a new
family's quirk is one entry in :data:`FAMILIES` (or one generic rule below) plus one tiny-family
test (tests/models/test_model_families.py), and the consumers never read config keys or module
attributes themselves.

A layout is built

* from a config dict alone (:meth:`ModelLayout.from_config`: the raw ``config.json`` or
  ``config.to_dict()``): head layout (GQA), family name and canonical RoPE. This is what the
  fingerprint records, so its bytes are a function of this reading (never change it for an
  existing family: every fingerprint id, and so every calibration and store key, depends on it);
* from a loaded transformers model (:meth:`ModelLayout.of_model`, cached as ``LoadedModel.layout``):
  the same plus the attention window per layer, the layer types, the attention modules per layer
  and the frequencies of statically scaled RoPE.

What the codec's ``rope`` stage reads is the fingerprint's canonical RoPE JSON
(:func:`canonical_rope`), through :mod:`kvcodec.codecs.rope_tables`, which may not import the
models package; :meth:`ModelLayout.layer_rope` reads the same JSON by the same rules (a test keeps
the two readers equal on every family), so CacheBlend re-rotates exactly what the stage un-rotates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Mapping

from kvcodec.core.fingerprint import layer_applies_rope
from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelNotFoundError, is_int

# --------------------------------------------------------------------------- config names
#: The same quantity under each family's config.json name, first match wins (transformers maps them through a
#: config class's attribute_map; a raw config.json has only the family's own): GPT-2 and friends say
#: n_layer/n_head/n_embd, Falcon n_head_kv, ChatGLM multi_query_group_num. A family whose names are not here gets
#: them in its :data:`FAMILIES` entry (appended after these, so they never change another family's reading).
CONFIG_NAMES: dict[str, tuple[str, ...]] = {
    "layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads", "num_kv_heads", "n_head_kv", "multi_query_group_num"),
    "hidden": ("hidden_size", "n_embd", "d_model"),
}

# q-norm scopes
PER_HEAD = "per_head"  # each query head normalised on its own (Qwen3, Gemma 3)
ALL_HEADS = "all_heads"  # one norm over every query head's projection (OLMo 2)

# where the queries sit in a query projection's output
LEADING = "leading"  # the first heads * head_dim outputs (a separate q_proj, or Phi-3's fused qkv_proj)
PER_HEAD_QKV = "per_head_qkv"  # per head, [q | k | v] of head_dim each (GPT-NeoX's fused query_key_value)


@dataclass(frozen=True)
class Family:
    """How one family deviates from the generic rules (the first entry of :data:`FAMILIES`)."""

    #: extra config names per quantity of :data:`CONFIG_NAMES`, tried after the generic ones
    config_names: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: the attention module's attribute on a decoder layer
    attention: str = "self_attn"
    #: the query projection: the first of these attributes the attention module has. A separate ``q_proj``
    #: (LLaMA, Qwen, Gemma, Mistral, ...) or a fused ``qkv_proj`` whose first ``heads * head_dim`` outputs are
    #: the queries (Phi-3)
    q_proj: tuple[str, ...] = ("q_proj", "qkv_proj")
    #: the query norm the keys meet the queries after (absent: none)
    q_norm: str = "q_norm"
    #: :data:`PER_HEAD` or :data:`ALL_HEADS`; None: read from the norm's size (``heads * head_dim``
    #: weights: all heads, OLMo 2 / OLMoE; else per head, Qwen3 / Gemma 3)
    q_norm_scope: str | None = None
    #: :data:`LEADING` or :data:`PER_HEAD_QKV`: where the queries sit in the query projection's output
    q_order: str = LEADING
    #: the attention's output projection (the calibration's value metric reads its weight)
    o_proj: str = "o_proj"


#: Per-family overrides, keyed by the config's ``model_type``; "" is the generic layout every other family gets.
#: Decoder layers are ``model.get_decoder().layers`` for all of them (LLaMA, Qwen, Gemma, Mistral, Phi-3, OLMo,
#: SmolLM3, ...); families whose blocks live elsewhere (GPT-2 and Falcon: ``.transformer.h``; MPT:
#: ``.transformer.blocks``) are captured, coded, stored and calibrated (with even weights where kvcodec cannot find
#: their attention modules: :mod:`kvcodec.calibration.build`), but not blended (a one-line refusal).
FAMILIES: dict[str, Family] = {
    "": Family(),
    # MPT: config.json says n_layers / n_heads / d_model; multi-head attention (no KV-head count), ALiBi (no RoPE)
    "mpt": Family(config_names={"layers": ("n_layers",), "heads": ("n_heads",)}),
    # GPT-NeoX (Pythia): `attention` with one fused query_key_value, per head [q | k | v], and a `dense` output
    "gpt_neox": Family(attention="attention", q_proj=("query_key_value",), q_order=PER_HEAD_QKV, o_proj="dense"),
    # Phi-1/1.5/2: separate q_proj, a per-head `q_layernorm` when qk_layernorm, and a `dense` output
    "phi": Family(q_norm="q_layernorm", o_proj="dense"),
    # OPT: learned absolute positions, `out_proj` output
    "opt": Family(o_proj="out_proj"),
    # XGLM: config.json says attention_heads; sinusoidal absolute positions, `out_proj` output
    "xglm": Family(config_names={"heads": ("attention_heads",)}, o_proj="out_proj"),
}


def family(model_type: str) -> Family:
    return FAMILIES.get(model_type) or FAMILIES[""]


def text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The text model's config of a config dict (a multimodal config nests it under ``text_config``)."""
    tc = cfg.get("text_config")
    return tc if isinstance(tc, dict) else cfg


def _first(c: Mapping[str, Any], names: tuple[str, ...]) -> Any:
    for k in names:
        if k in c:
            return c[k]
    raise KeyError(names[0])


def _head_layout(c: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """(layers, heads, kv heads, head_dim) from a text config dict, validated."""
    extra = family(str(c.get("model_type") or "")).config_names

    def names(q: str) -> tuple[str, ...]:
        return CONFIG_NAMES[q] + tuple(extra.get(q, ()))

    try:
        n_layers, n_heads = _first(c, names("layers")), _first(c, names("heads"))
        n_kv = next((c[k] for k in names("kv_heads") if c.get(k)), None) or n_heads
        if c.get("multi_query") and not c.get("new_decoder_architecture"):  # multi-query: Falcon (old layout), GPTBigCode
            n_kv = 1
        hidden = None if c.get("head_dim") else _first(c, names("hidden"))
        head_dim = c.get("head_dim") or hidden // n_heads
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        raise KvcModelNotFoundError(f"model config lacks a usable head layout ({exc})") from None
    if not all(is_int(x) and 0 < x <= 65536 for x in (n_layers, n_heads, n_kv, head_dim)) or n_layers > 4096:
        raise KvcModelNotFoundError("model config has an invalid head layout")
    # heads that do not divide the hidden size (no head_dim given) or KV heads that do not divide the query heads: the
    # weights may still fit (MPT's fused projection is 3 x hidden whatever the heads), and the forward pass then fails
    if hidden is not None and hidden % n_heads:
        raise KvcModelNotFoundError(f"model config has an invalid head layout ({n_heads} heads over hidden size {hidden})")
    if n_heads % n_kv:
        raise KvcModelNotFoundError(f"model config has an invalid head layout ({n_heads} query heads in groups over "
                                    f"{n_kv} KV heads)")
    return n_layers, n_heads, n_kv, head_dim


# --------------------------------------------------------------------------- RoPE
def canonical_rope(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """RoPE parameters in one shape whatever the config's vintage (what the fingerprint records).

    transformers >= 5 writes ``rope_parameters`` (possibly nested per layer
    type); older configs have ``rope_theta`` + ``rope_scaling``. The latter is
    flattened into the same dict (``type`` -> ``rope_type``).
    """
    c = text_config(cfg)
    rp = c.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        out = dict(rp)
        if any(isinstance(v, dict) for v in out.values()) and isinstance(c.get("layer_types"), list):
            # nested per layer type: which layer has which parameters is part of the RoPE (the rope stage reads it)
            out["layer_types"] = list(c["layer_types"])
    else:
        out = {}
        if c.get("rope_theta") is not None:
            out["rope_theta"] = c["rope_theta"]
        sc = c.get("rope_scaling")
        if isinstance(sc, dict):
            for k, v in sc.items():
                out["rope_type" if k == "type" else k] = v
        out.setdefault("rope_type", "default")
    if c.get("partial_rotary_factor") is not None and "full_attention" not in out:
        out.setdefault("partial_rotary_factor", c["partial_rotary_factor"])
    if isinstance(c.get("no_rope_layers"), list):
        # SmolLM3, Llama 4: per layer 1 = RoPE, 0 = none (NoPE). Which layers rotate is part of the RoPE: the
        # rope stage must not un-rotate, nor CacheBlend re-rotate, a NoPE layer's keys (kvcodec.codecs.rope_tables)
        out["no_rope_layers"] = list(c["no_rope_layers"])
    return out


def rope_json(cfg: Mapping[str, Any]) -> str:
    """The fingerprint's ``rope`` field: :func:`canonical_rope` as canonical JSON."""
    return json.dumps(canonical_rope(cfg), sort_keys=True, default=str)


# a layer's RoPE kinds (LayerRope.kind)
NOPE = "none"  # the layer applies no RoPE (no_rope_layers): its keys carry no position
PLAIN = "plain"  # theta ** (-2i / dim) over the first ``dim`` channels: what the codec's rope stage models
SCALED = "scaled"  # statically rescaled (linear, llama3, YaRN): still a rotation by position * inv_freq
DYNAMIC = "dynamic"  # frequencies depend on the sequence length (dynamic NTK, LongRoPE, ...): no fixed rotation
ABSENT = "absent"  # the config names no RoPE (learned or absolute positions), or none a rotation can express

#: rescaled RoPE whose frequencies are fixed (transformers computes them once): re-positionable by a rotation
STATIC_SCALED_ROPE = ("linear", "llama3", "yarn")


@dataclass(frozen=True)
class LayerRope:
    """How one layer rotates its keys."""

    kind: str  # NOPE | PLAIN | SCALED | DYNAMIC | ABSENT
    theta: float | None = None  # PLAIN
    dim: int | None = None  # PLAIN: rotary channels (partial rotary: fewer than head_dim)
    rope_type: str | None = None  # SCALED / DYNAMIC: the variant's name
    inv_freq: tuple[float, ...] = ()  # SCALED: transformers' own float64 inverse frequencies for the variant


def _plain_rope(r: Mapping[str, Any], layer: int, head_dim: int) -> tuple[float, int] | None:
    """(theta, rotary dim) of a plain-RoPE layer, None otherwise: mirror of
    :func:`kvcodec.codecs.rope_tables.rope_config_from_fingerprint` (None where it raises KvcCodecError)."""
    nested = {k: v for k, v in r.items() if isinstance(v, dict)}
    if nested:
        types = r.get("layer_types")
        if not isinstance(types, list) or not 0 <= layer < len(types) or not isinstance(types[layer], str) \
                or types[layer] not in nested:
            return None
        r = {"partial_rotary_factor": r.get("partial_rotary_factor"), **nested[types[layer]]}
    theta = r.get("rope_theta")
    if r.get("rope_scaling") not in (None, {}) or r.get("rope_type", "default") not in (None, "default"):
        return None
    if not isinstance(theta, (int, float)) or isinstance(theta, bool) or theta <= 0:
        return None
    prf = r.get("partial_rotary_factor")
    dim = int(round(head_dim * float(prf if isinstance(prf, (int, float)) and 0 < prf <= 1 else 1.0)))
    if dim <= 0 or dim % 2:
        return None
    return float(theta), dim


def _hf_layer_rope(tc: Any, layer: int) -> LayerRope:
    """What a transformers text config says of ``layer``'s RoPE beyond plain: scaled (with transformers'
    own frequencies for the variant), dynamic, or absent. Used where the canonical RoPE has no plain RoPE."""
    params = getattr(tc, "rope_parameters", None)
    types = getattr(tc, "layer_types", None)
    layer_type = None
    if isinstance(params, dict) and isinstance(types, (list, tuple)) and layer < len(types) \
            and isinstance(params.get(types[layer]), dict):
        layer_type, params = types[layer], params[types[layer]]
    rtype = params.get("rope_type", "default") if isinstance(params, dict) else None
    if rtype in (None, "default"):
        return LayerRope(ABSENT)
    if rtype not in STATIC_SCALED_ROPE:
        return LayerRope(DYNAMIC, rope_type=str(rtype))
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    kw = {"layer_type": layer_type} if layer_type is not None else {}
    inv, _ = ROPE_INIT_FUNCTIONS[rtype](tc, None, **kw)
    return LayerRope(SCALED, rope_type=str(rtype), inv_freq=tuple(float(x) for x in inv.detach().cpu().double().numpy()))


# --------------------------------------------------------------------------- windows
def attention_windows(config: Any) -> list[int | None]:
    """Per layer: the window of its sliding-window cache layer (it keeps the last ``window - 1`` tokens;
    a query at position q sees keys at q - window < k <= q), or None for a layer that keeps every token.

    Read the way transformers itself builds a cache for the model (``get_layer_types_and_kwargs``
    and its layer-type -> layer-class table), so there is no model-specific code here: a layer whose
    cache class is ``DynamicSlidingWindowLayer`` (sliding-window and chunked attention) slides, every
    other attention layer keeps all tokens, and cache layer types without per-token K/V (linear
    attention, convolution states, ...) are refused naming the type.
    """
    from kvcodec.models.hfimport import cache_utils

    cu = cache_utils()  # first, so transformers' cache classes import without hqq's cost (kvcodec/models/hfimport.py)
    cfg = config.get_text_config(decoder=True)
    types, kwargs = cu.get_layer_types_and_kwargs(cfg)
    if isinstance(kwargs, Mapping):  # transformers < 5.19: one dict of keyword arguments for every layer
        kwargs = [kwargs] * len(types)
    n = int(cfg.num_hidden_layers)
    if len(types) != n:
        raise KvcInputError(f"the model has {n} layers but {len(types)} of them have a KV cache "
                            "(shared KV layers are not supported)")
    out: list[int | None] = []
    for i, (t, kw) in enumerate(zip(types, kwargs)):
        cls = cu.DYNAMIC_LAYER_TYPE_MAPPING.get(t)
        if cls is cu.DynamicSlidingWindowLayer:
            w = kw.get("sliding_window")
            if not isinstance(w, int) or isinstance(w, bool) or w < 2:
                raise KvcInputError(f"layer {i} ({t}) has sliding window {w!r}; a window of at least 2 is needed")
            out.append(w)
        elif cls is cu.DynamicLayer:
            out.append(None)
        else:
            raise KvcInputError(f"layer {i} has cache layer type {t!r}, which holds no per-token K/V; "
                                "kvcodec supports full and sliding-window attention layers only")
    return out


# --------------------------------------------------------------------------- the layout
@dataclass(frozen=True)
class AttentionLayout:
    """One decoder layer's attention: attribute names of its modules (None: the layer has none)."""

    module: str | None  # the attention module, on the decoder layer
    q_proj: str | None  # the query projection (or fused projection), on the attention module
    q_norm: str | None  # the query norm, on the attention module
    q_norm_scope: str | None  # PER_HEAD | ALL_HEADS, with q_norm
    o_proj: str | None  # the output projection, on the attention module
    q_order: str = LEADING  # LEADING | PER_HEAD_QKV: where the queries sit in q_proj's output


def _decoder_layers(model: Any) -> Any | None:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    return getattr(decoder, "layers", None)


def _attention_layout(fam: Family, layer: Any, q_width: int) -> AttentionLayout:
    att = getattr(layer, fam.attention, None)
    if att is None:
        return AttentionLayout(None, None, None, None, None)
    q_proj = next((n for n in fam.q_proj if getattr(att, n, None) is not None), None)
    norm = getattr(att, fam.q_norm, None)
    scope = None
    if norm is not None:
        w = getattr(norm, "weight", None)
        scope = fam.q_norm_scope or (ALL_HEADS if w is not None and w.numel() == q_width else PER_HEAD)
    return AttentionLayout(fam.attention, q_proj, fam.q_norm if norm is not None else None, scope,
                           fam.o_proj if hasattr(att, fam.o_proj) else None, fam.q_order)


@dataclass(frozen=True)
class ModelLayout:
    """What kvcodec knows of one model's layout (see the module doc). Consumers read this, not the config."""

    family: str  # the config's model_type ("unknown" if it has none)
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads: kv head h serves query heads h*g .. h*g+g-1 (g = group), HF repeat_kv
    head_dim: int
    rope: str  # canonical RoPE JSON (the fingerprint's rope field)
    # from a loaded model only (of_model); None / () from a config dict
    windows: tuple[int | None, ...] | None = None  # per layer: sliding window, None = every token (attention_windows)
    layer_types: tuple[str, ...] | None = None  # the config's layer_types (keys per-type RoPE and masks)
    has_layers: bool = False  # whether the decoder layers are where kvcodec drives them (get_decoder().layers)
    attention: tuple[AttentionLayout, ...] = ()  # per layer, when has_layers
    hf_rope: tuple[LayerRope, ...] = ()  # per layer: the config's non-plain RoPE (see layer_rope)

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size; 1 = multi-head attention)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "ModelLayout":
        """The layout a config dict alone gives (raw ``config.json`` or ``config.to_dict()``): GQA and RoPE."""
        c = text_config(cfg)
        n_layers, n_heads, n_kv, head_dim = _head_layout(c)
        return cls(family=str(c.get("model_type") or "unknown"), num_layers=n_layers, num_heads=n_heads,
                   num_kv_heads=n_kv, head_dim=head_dim, rope=rope_json(cfg))

    @classmethod
    def of_model(cls, model: Any, cfg: Mapping[str, Any]) -> "ModelLayout":
        """The layout of a loaded transformers causal LM; ``cfg`` is the config dict its fingerprint reads."""
        base = cls.from_config(cfg)
        tc = model.config.get_text_config(decoder=True)
        types = getattr(tc, "layer_types", None)
        layers = _decoder_layers(model)
        fam = family(base.family)
        attention = tuple(_attention_layout(fam, layer, base.num_heads * base.head_dim) for layer in layers) \
            if layers is not None else ()
        r = json.loads(base.rope)
        hf_rope = tuple(LayerRope(PLAIN) if _plain_rope(r, i, base.head_dim) is not None else _hf_layer_rope(tc, i)
                        for i in range(base.num_layers))
        return cls(family=base.family, num_layers=base.num_layers, num_heads=base.num_heads,
                   num_kv_heads=base.num_kv_heads, head_dim=base.head_dim, rope=base.rope,
                   windows=tuple(attention_windows(model.config)),
                   layer_types=tuple(types) if isinstance(types, (list, tuple)) else None,
                   has_layers=layers is not None, attention=attention, hf_rope=hf_rope)

    # -- RoPE per layer
    def layer_rope(self, layer: int) -> LayerRope:
        """How ``layer`` rotates its keys: NoPE and plain RoPE from the canonical RoPE by the codec's rules,
        anything else from the model's config (a layout built from a config dict alone says ABSENT there).

        Raises KvcFormatError where ``no_rope_layers`` does not say whether the layer rotates (as the codec does).
        """
        r = json.loads(self.rope)
        if not isinstance(r, dict):
            raise KvcFormatError("bad rope JSON in fingerprint: not an object")
        if not layer_applies_rope(r, layer):
            return LayerRope(NOPE)
        plain = _plain_rope(r, layer, self.head_dim)
        if plain is not None:
            return LayerRope(PLAIN, theta=plain[0], dim=plain[1])
        return self.hf_rope[layer] if layer < len(self.hf_rope) else LayerRope(ABSENT)

    # -- modules (of a loaded model; None where the layout has none)
    def decoder_layers(self, model: Any) -> Any | None:
        """The decoder layers (``get_decoder().layers``), or None for layouts without them (GPT-2, Falcon, MPT)."""
        return _decoder_layers(model) if self.has_layers else None

    def attention_module(self, model: Any, layer: int) -> Any | None:
        name = self.attention[layer].module if layer < len(self.attention) else None
        layers: Any = _decoder_layers(model)
        return getattr(layers[layer], name) if name is not None else None

    def query(self, model: Any, layer: int) -> tuple[Any | None, Any | None, str | None, str]:
        """(query projection, query norm, its scope, where the queries sit in its output) of ``layer``: the
        projection's first ``num_heads * head_dim`` outputs (:data:`LEADING`: the whole output of a separate
        q_proj) or each head's first ``head_dim`` of its ``[q | k | v]`` (:data:`PER_HEAD_QKV`), normalised by the
        norm if there is one. All None (and :data:`LEADING`) where the layout has no decoder layers."""
        if not self.has_layers or layer >= len(self.attention):
            return None, None, None, LEADING
        a, att = self.attention[layer], self.attention_module(model, layer)
        proj = getattr(att, a.q_proj) if a.q_proj is not None else None
        norm = getattr(att, a.q_norm) if a.q_norm is not None else None
        return proj, norm, a.q_norm_scope, a.q_order

    def output_projection(self, model: Any, layer: int) -> Any | None:
        """The attention's output projection of ``layer`` (its weight: [hidden, heads * head_dim]), or None."""
        import torch

        if not self.has_layers or layer >= len(self.attention):
            return None
        a, att = self.attention[layer], self.attention_module(model, layer)
        proj = getattr(att, a.o_proj, None) if att is not None and a.o_proj is not None else None
        # a Linear's weight is [out, in] over the heads' outputs; anything else (GPT-2's Conv1D is [in, out]) is
        # not read as one
        ok = isinstance(proj, torch.nn.Linear) and int(proj.weight.shape[1]) == self.num_heads * self.head_dim
        return proj if ok else None
