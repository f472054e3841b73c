"""Which attention function a model runs, chosen per thread: kvcodec's attention variants without a shared switch.

transformers picks a model's attention by the name in its config (``config._attn_implementation``), and every
thread that runs the model reads that one config. kvcodec runs four variants of SDPA for the length of a block:
the scheduled SDPA (:func:`kvcodec.models.sdpa_schedule.fast_sdpa`), the importance tap
(:func:`kvcodec.models.attention_tap.tapped`), the batched answers' GQA-masked SDPA (:mod:`kvcodec.models.quality`)
and H2O's masked reference (:mod:`kvcodec.prune.h2o`). Each used to write its own name into the config and put the
old one back when it ended, so two threads on one model could run each other's variant, and two interleaved blocks
could leave a variant set after both had ended (the first to end restored the name the second had replaced).

Here a block chooses its variant for *this thread* and this model (:func:`use_attention`). While any block is open
on a model, its config names :data:`DISPATCH`, whose function runs the calling thread's innermost variant for that
model, else transformers' own SDPA: the function the name ``"sdpa"`` runs, so a thread outside every block
computes what it did before, to the bit. The last block to close on a model, in whichever thread, gives the config
its own name back. A model's attention modules are matched to it by the config they read (every module that picks
its attention by name holds one).

One pass needs the whole model on another implementation: :func:`whole_model_attention` (``steer --auto``'s eager
pass, for attention weights). It waits until no block is open on the model, and blocks opened meanwhile wait for
it, so no thread's variant is switched away under it.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from kvcodec.errors import KvcInputError

DISPATCH = "kvcodec_attention"

AttentionFn = Callable[..., Any]


@dataclass
class _Open:
    """A model with blocks open on it: its own implementation's name, and the configs its modules read."""

    own: str
    keys: frozenset[int]  # ids of the configs the model's modules hold (the model's own, and any sub-config)
    blocks: int = 0


_lock = threading.Lock()
_turn = threading.Condition(_lock)  # signalled when a model's last block closes or a whole-model switch ends
_whole: dict[int, int] = {}  # id(model config) -> the thread that switched the whole model (whole_model_attention)
_open: dict[int, _Open] = {}  # id(model config) -> its state, while a block is open on the model (the block holds it)
_local = threading.local()  # .chosen: id(a module's config) -> this thread's stack of variants for that model


_keys: "weakref.WeakKeyDictionary[Any, frozenset[int]]" = weakref.WeakKeyDictionary()  # model -> its configs' ids


def _config_ids(model: Any) -> frozenset[int]:
    """The ids of the configs ``model``'s modules read (its own, and any sub-config), walked once per model: a block
    opens per prefill, and the walk costs ~0.5 ms on a 400-module model."""
    keys = _keys.get(model)
    if keys is None:
        keys = _keys[model] = frozenset({id(model.config)} | {id(c) for m in model.modules()
                                                                if (c := getattr(m, "config", None)) is not None})
    return keys


def _register() -> None:
    """Register :data:`DISPATCH` with transformers, with SDPA's mask builder (once per process): every variant wraps
    SDPA, so a model switched to it must get exactly the masks SDPA gets."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    if DISPATCH not in AttentionInterface._global_mapping:
        AttentionInterface.register(DISPATCH, _dispatch)
    if DISPATCH not in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping:
        AttentionMaskInterface.register(DISPATCH, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


def _sdpa(module: Any, *args: Any, **kwargs: Any) -> Any:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward(module, *args, **kwargs)


def _dispatch(module: Any, query: Any, key: Any, value: Any, attention_mask: Any, **kwargs: Any) -> Any:
    chosen = getattr(_local, "chosen", None)
    stack = chosen.get(id(getattr(module, "config", None))) if chosen else None
    fn = stack[-1] if stack else _sdpa
    return fn(module, query, key, value, attention_mask, **kwargs)


def _own(name: str, model_cfg: Any) -> str:
    """The implementation a config naming ``name`` stands for (call with :data:`_lock` held): :data:`DISPATCH` is the
    model's own while its blocks are open, and SDPA's on a copy made meanwhile (its own config, no block of its own,
    as the onboarding twin may be), since the dispatcher runs SDPA for a model with no block open."""
    if name != DISPATCH:
        return name
    st = _open.get(id(model_cfg))
    return st.own if st is not None else "sdpa"


def own_attention(lm: Any, cfg: Any = None) -> str:
    """The attention implementation ``lm``'s config (or ``cfg``, one of its configs) names, kvcodec's blocks aside:
    ``"sdpa"``, ``"eager"``, ... (what a caller that needs an explicit mask asks)."""
    cfg = lm.model.config if cfg is None else cfg
    name = getattr(cfg, "_attn_implementation", None) or getattr(lm.model.config, "_attn_implementation", None) or "eager"
    with _lock:
        return _own(str(name), lm.model.config)


@contextlib.contextmanager
def use_attention(lm: Any, fn: AttentionFn, *, outermost: bool = False) -> Iterator[bool]:
    """Within this block, this thread's forwards of ``lm`` run attention ``fn`` (transformers' SDPA signature; the
    masks are SDPA's), whatever other threads run meanwhile. Yields whether ``fn`` applies.

    ``outermost``: only on a model whose own attention is SDPA, and only where this thread has no variant open on
    it (the scheduled SDPA and the batched answers, which speed SDPA up: on another implementation, or inside
    another variant, they leave the attention as it is). Otherwise ``fn`` applies on any implementation, nested
    blocks included (the importance tap, the H2O reference: their function is the measurement).
    """
    cfg = lm.model.config
    chosen: dict[int, list[AttentionFn]] = _local.__dict__.setdefault("chosen", {})
    me = threading.get_ident()
    with _turn:
        while _whole.get(id(cfg), me) != me:  # another thread runs the whole model on another implementation
            _turn.wait()
        if id(cfg) in _whole and not outermost:
            raise KvcInputError("an attention variant was asked for inside this thread's whole-model switch of the "
                                "same model")
        st = _open.get(id(cfg))
        own = _own(str(cfg._attn_implementation), cfg)
        stack = chosen.get(id(cfg))
        apply = id(cfg) not in _whole and not (outermost and (own != "sdpa" or stack))
        if apply:
            if st is None:
                _register()
                st = _open[id(cfg)] = _Open(own, _config_ids(lm.model))
                cfg._attn_implementation = DISPATCH
            st.blocks += 1
    if not apply:
        yield False
        return
    assert st is not None
    if stack is None:
        stack = []
        for k in st.keys:
            chosen[k] = stack
    stack.append(fn)
    try:
        yield True
    finally:
        stack.pop()
        if not stack:
            for k in st.keys:
                chosen.pop(k, None)
        with _turn:
            st.blocks -= 1
            if st.blocks == 0:
                cfg._attn_implementation = st.own
                del _open[id(cfg)]
                _turn.notify_all()


@contextlib.contextmanager
def whole_model_attention(lm: Any, name: str) -> Iterator[None]:
    """Within this block ``lm`` runs transformers' implementation ``name`` (``"eager"``: attention weights) in every
    thread. It starts once no block of :func:`use_attention` is open on the model (one of this thread's own is a
    one-line error: it would wait for itself), and such blocks wait for it to end."""
    cfg = lm.model.config
    with _turn:
        while id(cfg) in _whole or id(cfg) in _open:
            chosen = getattr(_local, "chosen", None)
            if chosen and id(cfg) in chosen:
                raise KvcInputError(f"cannot switch the model to {name} attention inside one of this thread's "
                                    "attention variants")
            _turn.wait()
        _whole[id(cfg)] = threading.get_ident()
        saved = cfg._attn_implementation
    try:
        lm.model.set_attn_implementation(name)
        yield
    finally:
        try:
            lm.model.set_attn_implementation(saved)
        finally:
            with _turn:
                del _whole[id(cfg)]
                _turn.notify_all()
