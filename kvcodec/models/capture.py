"""Run prefill on a real model and keep the KV cache it produces."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvcodec.errors import KvcInputError
from kvcodec.core.kvcache import KVCache, as_token_ids
from kvcodec.models.load import LoadedModel
from kvcodec.models.sdpa_schedule import fast_sdpa


def tokenize(tokenizer: Any, text: str) -> np.ndarray:
    """Token ids of ``text`` exactly as capture and eval see them (no special tokens)."""
    if not text or not text.strip():
        raise KvcInputError("the text is empty")
    try:  # a lone surrogate (argv bytes that are not UTF-8, a JSON "\ud800") reached the tokenizer as a TypeError
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise KvcInputError(f"the text is not Unicode text: character {exc.start} is a lone surrogate (bytes that are "
                            "not UTF-8?)") from None
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return np.asarray(ids, dtype=np.int64)


def select_context(ids: np.ndarray, max_tokens: int | None, min_follow: int = 0) -> np.ndarray:
    """First ``max_tokens`` ids, checking that the text is long enough.

    ``min_follow`` asks for that many further tokens to remain after the
    context (eval needs a continuation).
    """
    if max_tokens is not None and max_tokens <= 0:
        raise KvcInputError(f"--max-tokens must be positive, got {max_tokens}")
    n = len(ids) if max_tokens is None else max_tokens
    if n + min_follow > len(ids):
        need = f"{n} context tokens" + (f" + {min_follow} continuation tokens" if min_follow else "")
        raise KvcInputError(f"the text has only {len(ids)} tokens, fewer than the requested {need}")
    return ids[:n]


def max_context(lm: LoadedModel) -> int | None:
    """The model's context window (``max_position_embeddings``), or None if its config does not say."""
    n = getattr(lm.model.config.get_text_config(), "max_position_embeddings", None)
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else None


class KvcWindowError(KvcInputError):
    """More tokens than the model's context window. ``lower``: the caller's arguments, by their Python names, whose
    values add tokens; the message names them, and ``kvc``, whose flags spell them with dashes, its flags.

    Why: the one message said "use --max-tokens" to every caller, a Python one passing ``max_new_tokens`` and
    ``kvc ask``, which has no --max-tokens, included."""

    def __init__(self, head: str, lower: tuple[str, ...]) -> None:
        self.head, self.lower = head, lower
        super().__init__(self._say(lower))

    def _say(self, names: tuple[str, ...]) -> str:
        return f"{self.head} (" + (f"lower {' or '.join(names)}, or give" if names else "give") + " a shorter text)"

    def cli_message(self) -> str:
        return self._say(tuple("--" + n.replace("_", "-") for n in self.lower))

    def __reduce__(self) -> tuple[Any, tuple[str, tuple[str, ...]]]:  # across processes (workers, pools) whole
        return type(self), (self.head, self.lower)


def check_fits(lm: LoadedModel, n_tokens: int, what: str = "the context", lower: tuple[str, ...] = ()) -> None:
    """Refuse more tokens than the model's context window (:class:`KvcWindowError`, naming the arguments in
    ``lower`` as what to shorten).

    Why: past it a model's output is meaningless, and prefill memory grows
    with the length, so a huge text must be an error, not hours of swapping.
    """
    limit = max_context(lm)
    if limit is not None and n_tokens > limit:
        raise KvcWindowError(f"{what} has {n_tokens:,} tokens, more than the model's context window of {limit:,}",
                             lower)


def model_cache(lm: LoadedModel) -> Any:
    """An empty HF cache of the layer classes a fresh prefill of ``lm`` uses (:mod:`kvcodec.models.cachelayout`).

    Why not a plain full cache: a sliding-window layer keeps only the last
    ``window - 1`` tokens, the only ones any later query can attend to; storing
    the others would cost bits for nothing (the ragged layout, spec/kvc-v1.md
    §4.2), and the loader rebuilds exactly this cache so generation continues
    as after the prefill. Refuses models whose cache holds no per-token K/V.
    """
    from transformers import DynamicCache

    lm.layout  # noqa: B018 - its windows refuse unsupported cache layer types with one line
    return DynamicCache(config=lm.model.config)


@torch.inference_mode()
def prefill(lm: LoadedModel, token_ids: np.ndarray, logits_to_keep: int = 1,
            full_layers: bool = False) -> tuple[Any, torch.Tensor]:
    """Full prefill. Returns (HF DynamicCache, logits [logits_to_keep, vocab]).

    Only the last ``logits_to_keep`` positions get logits (0: all of them, for
    tests that compare every position): the full-vocabulary projection of
    every position costs up to 2.6x the rest of a prefill and nobody reads it.
    ``full_layers`` keeps every token in every layer, sliding-window layers
    included (the masks apply each layer's window themselves, so logits are the
    same): for consumers that cut the cache into token ranges (the stream's
    level chunks), where a later range's prefill needs the earlier tokens.
    """
    from transformers import DynamicCache

    ids = torch.as_tensor(np.asarray(token_ids, dtype=np.int64)).unsqueeze(0)
    past = DynamicCache() if full_layers else model_cache(lm)
    with fast_sdpa(lm):  # sliding-window layers compute only their window's scores (the module says why)
        out = lm.model(input_ids=ids, past_key_values=past, use_cache=True, logits_to_keep=logits_to_keep)
    return out.past_key_values, out.logits[0]


def cache_from_hf(past: Any, token_ids: np.ndarray, lm: LoadedModel, meta: dict | None = None) -> KVCache:
    """Wrap an HF cache (batch 1) as a KVCache carrying the model fingerprint (sliding layers: the tokens they keep)."""
    keys = [layer.keys[0].detach().clone() for layer in past.layers]
    values = [layer.values[0].detach().clone() for layer in past.layers]
    return KVCache(keys, values, token_ids, lm.fingerprint, meta=dict(meta or {}))


def in_vocabulary(lm: LoadedModel, ids: np.ndarray) -> np.ndarray:
    """``ids``, refused in one line unless each lies in [0, vocab_size): a tokenizer's added tokens may lie past the
    model's embedding (a pad token added without resizing it), and such an id escaped the prefill as IndexError."""
    vocab = int(lm.model.config.get_text_config().vocab_size)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab):
        bad = int(ids.min()) if ids.min() < 0 else int(ids.max())
        raise KvcInputError(f"token ids must lie in [0, {vocab}), the model's vocabulary; got {bad} (a token of its "
                            "tokenizer the model does not embed?)" if bad >= vocab else
                            f"token ids must lie in [0, {vocab}), the model's vocabulary; got {bad}")
    return ids


def context_ids(
    lm: LoadedModel, text: str | None = None, token_ids: np.ndarray | None = None, max_tokens: int | None = None
) -> np.ndarray:
    """The validated context token ids of ``text`` or ``token_ids``, truncated to ``max_tokens``."""
    if (text is None) == (token_ids is None):
        raise KvcInputError("give exactly one of text or token_ids")
    if text is not None:
        ids = tokenize(lm.tokenizer, text)
    else:
        ids = as_token_ids(token_ids)
    if ids.size == 0:
        raise KvcInputError("no tokens to capture")
    in_vocabulary(lm, ids)
    ids = select_context(ids, max_tokens)
    check_fits(lm, len(ids), lower=("max_tokens",) if max_tokens is not None else ())
    return ids


def capture(
    lm: LoadedModel,
    text: str | None = None,
    token_ids: np.ndarray | None = None,
    max_tokens: int | None = None,
    full_layers: bool = False,
    score_window: int | None = None,
) -> KVCache:
    """KV cache of ``text`` (or ``token_ids``), truncated to ``max_tokens``; a sliding-window layer keeps only
    its window unless ``full_layers`` (:func:`prefill`).

    ``score_window`` (an encoder's token-importance window): the prefill also observes the attention of the
    context's last ``score_window`` queries and attaches it (``cache.attention``), so the encoder needs no
    second forward pass (:func:`kvcodec.models.importance.cache_importance`). The keys and values are those
    of a plain prefill, bit for bit; the observation costs a few percent of it.
    """
    ids = context_ids(lm, text, token_ids, max_tokens)
    if score_window is None:
        past, _ = prefill(lm, ids, full_layers=full_layers)
        return cache_from_hf(past, ids, lm, meta={"model": lm.name})
    if isinstance(score_window, bool) or not isinstance(score_window, int) or score_window <= 0:
        raise KvcInputError(f"score_window must be a positive number of queries, got {score_window!r}")
    from kvcodec.core.kvcache import AttentionScores
    from kvcodec.models.attention_tap import ImportanceCollector, tap_sees, tapped

    import contextlib

    from kvcodec.models.importance import cache_importance

    # a model the tap cannot observe: a plain prefill, then the weights its eager attention returns (cache_importance)
    col = ImportanceCollector(score_window, len(ids), list(lm.layout.windows or ()), squared=True) if tap_sees(lm) else None
    with tapped(lm, col) if col is not None else contextlib.nullcontext():
        past, _ = prefill(lm, ids, full_layers=full_layers)
    cache = cache_from_hf(past, ids, lm, meta={"model": lm.name})
    scores = col.stacked(lm.fingerprint.num_layers) if col is not None else cache_importance(lm, cache, score_window)
    assert scores is not None  # an unpruned cache
    cache.attention = AttentionScores(score_window, scores)
    cache.validate()
    return cache
