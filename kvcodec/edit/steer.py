"""``steer``: emphasise spans of a stored context for every later question (PASTA, as an offline edit).

PASTA (Zhang et al., ICLR 2024) adds ``log(alpha)`` (alpha = 0.01) to the pre-softmax attention logits of
selected (layer, head) pairs for every key *outside* the emphasised spans, for every query. Because the
bias also acts during the context's own prefill, later layers' K/V change too, so the exact offline edit
is: prefill the stored token ids once under the bias, store those K/V, and store the bias itself
(spec/kvc-v1.md §4.6, required feature bit 1) for the loader to apply to every later query
(:func:`kvcodec.integrations.hf.generate`; engines that cannot, refuse the file). Cost: one prefill of the
context (the stored cache is only the source of the token ids and the model check).

Which heads: PASTA profiles each head alone on held-out tasks and keeps the best. kvcodec's procedure
(:func:`kvcodec.edit.steer_profile.profile_heads`, run by ``kvc edit profile-heads`` and benchmarks/bench_edit.py)
is documented there; the caller names the heads (``heads=[(layer, head), ...]``) or passes the profiled ones.
"""

from __future__ import annotations

import math
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcodec.core.kvcache import KVCache
from kvcodec.edit.entry import EditResult, check_child_preset, check_dest, open_parent, write_child
from kvcodec.edit.log import check_params
from kvcodec.edit.spans import resolve_spans
from kvcodec.errors import KvcInputError
from kvcodec.format.bias import AttentionBias
from kvcodec.integrations.attn_bias import biased_attention, model_attention_heads

__all__ = ["DEFAULT_ALPHA", "check_alpha", "check_heads", "parse_heads", "pasta_bias", "steer", "steer_cache"]

DEFAULT_ALPHA = 0.01  # PASTA's default scaling of the non-emphasised keys' attention


def _is_int(x: Any) -> bool:
    """An integer (Python or NumPy), not a bool, a float or a string: the edit API never coerces (issue 55)."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def check_heads(lm: Any, heads: Any) -> list[tuple[int, int]]:
    """``heads`` as sorted, distinct (layer, head) pairs within ``lm``'s layers and query heads (else one line)."""
    L, H = lm.fingerprint.num_layers, model_attention_heads(lm)
    try:
        given = list(heads)
        if not all(len(p) == 2 and all(_is_int(x) for x in p) for p in given):
            raise TypeError
        pairs = sorted({(int(a), int(b)) for a, b in given})
    except (TypeError, ValueError):
        raise KvcInputError("heads must be (layer, head) integer pairs") from None
    if not pairs or len(pairs) != len(given):
        raise KvcInputError("heads must be distinct (layer, head) integer pairs, at least one")
    for a, b in pairs:
        if not (0 <= a < L and 0 <= b < H):
            raise KvcInputError(f"head ({a}, {b}) is out of range: the model has {L} layers of {H} attention heads")
    return pairs


def parse_heads(spec: str, attention_heads: int) -> list[tuple[int, int]]:
    """``"8:0,8:3,12:*"`` -> [(8, 0), (8, 3), (12, 0), ... (12, H-1)]: heads as the CLI takes them (``*``: every
    head of the layer). Ranges are checked against the model by :func:`check_heads`."""
    out: list[tuple[int, int]] = []
    for part in str(spec).split(","):
        layer, sep, head = part.strip().partition(":")
        try:
            heads = range(attention_heads) if head.strip() == "*" else [int(head)]
            out += [(int(layer), h) for h in heads]
        except ValueError:
            raise KvcInputError(f"heads are LAYER:HEAD or LAYER:* separated by commas, got {part.strip()!r:.40}") from None
        if not sep:
            raise KvcInputError(f"heads are LAYER:HEAD or LAYER:* separated by commas, got {part.strip()!r:.40}")
    return out


def check_alpha(alpha: Any) -> float:
    """``alpha`` (the attention kept on keys outside the spans) as a float in (0, 1] whose log a bias can hold, else
    one line; apart so that callers doing minutes of work before the bias (head profiling) refuse it first."""
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha) or not 0 < alpha <= 1:
        raise KvcInputError(f"alpha must be a finite number in (0, 1] (the attention kept outside the spans), got {alpha!r}")
    if math.log(alpha) < -1e4:
        raise KvcInputError(f"alpha {alpha!r} is too small (log below -10000)")
    return float(alpha)


def pasta_bias(lm: Any, heads: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]], context_tokens: int,
               alpha: float = DEFAULT_ALPHA) -> AttentionBias:
    """PASTA's bias: log(``alpha``) on the keys outside ``spans`` for ``heads`` (validated; NaN/inf refused)."""
    value = math.log(check_alpha(alpha))
    if not spans or spans[0][0] == 0 and spans[-1][1] == context_tokens and len(spans) == 1:
        raise KvcInputError("the emphasised spans cover the whole context: nothing would be steered")
    return AttentionBias.outside(model_attention_heads(lm), check_heads(lm, heads), value, spans, context_tokens)


@torch.inference_mode()
def steer_cache(lm: Any, token_ids: np.ndarray, bias: AttentionBias) -> KVCache:
    """The cache of ``token_ids`` prefilled under ``bias`` (the exact steering edit)."""
    from kvcodec.models.capture import cache_from_hf, prefill

    ids = np.asarray(token_ids, np.int64)
    with biased_attention(lm, bias, len(ids)):
        past, _ = prefill(lm, ids)
    return cache_from_hf(past, ids, lm)


def steer(lm: Any, source: Any, heads: Sequence[tuple[int, int]], *, pattern: str | None = None, text: str | None = None,
          char_spans: Sequence[tuple[int, int]] | None = None, token_spans: Sequence[tuple[int, int]] | None = None,
          auto: int | None = None, alpha: float = DEFAULT_ALPHA, dest: Any = None, preset: str | None = None,
          progress: Callable[[str], None] | None = None) -> EditResult:
    """Emphasise in the stored entry ``source`` the spans named by exactly one of ``pattern``, ``text``,
    ``char_spans``, ``token_spans`` or ``auto`` (the ``auto`` sentences the query-independent scorer of
    :mod:`kvcodec.edit.autospans` ranks highest), on ``heads``, into a new entry that carries its attention bias."""
    check_dest(source, dest)
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    parent = open_parent(source)
    check_child_preset(parent, preset)
    ids = parent.token_ids(lm, "steer")
    if parent.reader.header.pruned:  # its stored tokens are not all of ids: the child would silently be unpruned
        raise KvcInputError("the entry is a pruned cache (its tokens are not all stored); edits need a full cache")
    if parent.reader.header.attention_bias is not None:
        raise KvcInputError("the entry is already steered; steer its parent again instead of stacking biases")
    if auto is not None:
        if any(x is not None for x in (pattern, text, char_spans, token_spans)):
            raise KvcInputError("name the span by exactly one of: a pattern, a text, character spans, token spans, auto")
        from kvcodec.edit.autospans import auto_spans, check_count

        auto = check_count(auto)
        check_heads(lm, heads)  # refuse bad input before the scorer's forward
        say(f"choosing {auto} span(s) by the model's attention (reading {len(ids)} tokens twice)")
        spans = auto_spans(lm, ids, auto)
    else:
        spans = resolve_spans(lm.tokenizer, ids, pattern=pattern, text=text, char_spans=char_spans, token_spans=token_spans)
    bias = pasta_bias(lm, heads, spans, len(ids), alpha)
    params: dict[str, Any] = {"token_spans": [list(s) for s in spans], "heads": [[e.layer, e.head] for e in bias.entries],
                              "alpha": float(alpha)}
    if pattern is not None:
        params["pattern"] = pattern
    if auto is not None:
        params["auto"] = int(auto)
    check_params(params)  # the log record must hold them: refused before the prefill, not after it
    t1 = time.perf_counter()
    say(f"prefilling {len(ids)} tokens with {len(bias.entries)} steered heads")
    child = steer_cache(lm, ids, bias)
    t2 = time.perf_counter()
    return write_child(lm, parent, child, "steer", params, dest=dest, preset=preset, progress=progress,
                       timings={"prepare_s": t1 - t0, "prefill_s": t2 - t1}, attention_bias=bias,
                       info={"spans": [list(s) for s in spans], "steered_heads": len(bias.entries)})
