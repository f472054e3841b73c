"""A query-independent choice of the spans to emphasise: sentences ranked by the model's own attention.

``steer`` needs spans; a user may name them (text, regex, token spans) or let this scorer choose them
without seeing any question, as an offline edit must (the issue's "documented, query-independent scorer").

**The score** (LLMSteer-like rereading). The model reads the context twice in one eager forward (the ids,
then the ids again without the first token; no bias), so every sentence, the last one included, is followed
by a whole reading of the others. For every key token ``k`` of the first reading and every later query ``q``
of another sentence (either reading), the attention ``a[q, k]`` is compared with what a uniform causal
reader would give it, ``1 / (q + 1)``: the ratio ``a[q, k] (q + 1)`` removes the plain recency effect (late
queries spread thinner). The ratios are averaged over those queries, every head and every layer; a
sentence's score is the mean over its tokens. Queries of ``k``'s own sentence are left out in both readings
(the second reading of a sentence attends to its first by copying, whatever it says), and so is the first
token: it is the attention sink, which every model attends to whatever it says. Sentences holding the prompt's
scaffolding (any special token, such as a role marker, and the model's chat template around the user content where
the context starts or ends with it: :func:`template_tokens`) are never chosen. The ``k`` sentences of highest score are the spans, returned in text order.

**Sentences** are split on the decoded text: after ``.``, ``!``, ``?`` or ``:`` followed by white space, and
at every line break, mapped to tokens as every other character span is (:mod:`kvcodec.edit.spans`).

**Why this and what it cannot do.** Tokens that the rest of the context keeps returning to are what the model
itself treats as load-bearing; emphasising them is the context-only half of LLMSteer's "re-read and steer
towards what the reading attends to". (That the ranking matches a human's idea of the key passage is not
claimed: on a toy text a definition that later sentences reuse did not outrank filler on SmolLM2.) It cannot know
which of several similar facts a future question will ask for: benchmarks/bench_edit.py measures it on the
key-fact task against the given span and against no steering, and BENCHMARKS.md says what it buys.

The eager pass switches the model's attention implementation for the duration of the call (weights are
only available from eager attention); a concurrent forward of the same model in this process computes the
same attention eagerly meanwhile. Contexts longer than :data:`MAX_AUTO_TOKENS` are refused: eager attention
materialises ``heads x n x n`` weights per layer.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import torch

from kvcodec.edit.spans import char_spans_to_tokens, token_offsets
from kvcodec.errors import KvcInputError
from kvcodec.models.attention_choice import whole_model_attention

__all__ = ["MAX_AUTO_SPANS", "MAX_AUTO_TOKENS", "auto_spans", "check_count", "sentence_spans", "sentence_scores",
           "special_ids", "template_tokens"]

MAX_AUTO_TOKENS = 2048  # read twice: eager weights of 4096 x 4096 per head and layer
MAX_AUTO_SPANS = 64
_BREAK = re.compile(r"(?<=[.!?:])\s+|\n+")


def sentence_spans(tokenizer: Any, ids: np.ndarray) -> list[tuple[int, int]]:
    """Token ranges of the context's sentences (see the module doc), in order, disjoint, covering every token
    with a non-blank character."""
    text, ends = token_offsets(tokenizer, ids)
    chars, at = [], 0
    for m in _BREAK.finditer(text):
        if text[at:m.start()].strip():
            chars.append((at, m.start()))
        at = m.end()
    if text[at:].strip():
        chars.append((at, len(text)))
    out: list[tuple[int, int]] = []
    for s, e in chars:  # one at a time: two sentences sharing a straddling token stay two (the later one yields it)
        (a, b), = char_spans_to_tokens(ends, [(s, e)])
        a = max(a, out[-1][1]) if out else a
        if b > a:
            out.append((a, b))
    return out


def _attention_received(lm: Any, ids: np.ndarray, sentence_of: np.ndarray) -> np.ndarray:
    """Per key token of the first reading: mean over layers, heads and later queries of other sentences (both
    readings) of ``a[q, k] (q + 1)``."""
    n = len(ids)
    twice = np.concatenate([ids, ids[1:]])
    N = len(twice)
    q_idx = torch.arange(N, dtype=torch.float64)
    sent = torch.as_tensor(np.concatenate([sentence_of, sentence_of[1:]]))
    later_other = (q_idx[:, None] > q_idx[None, :n]) & (sent[:, None] != sent[None, :n])  # [q, k]
    weight = later_other.double() * (q_idx[:, None] + 1)
    count = later_other.sum(0).double().clamp_min(1)
    total = torch.zeros(n, dtype=torch.float64)
    layers = lm.layout.decoder_layers(lm.model) or []

    def hook(_m: Any, _args: Any, out: Any) -> None:
        w = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if w is None:
            raise KvcInputError(f"{type(lm.model).__name__}'s attention returned no weights under eager attention")
        total.add_((w[0].double().mean(0)[:, :n] * weight).sum(0) / count)

    handles = [layer.self_attn.register_forward_hook(hook) for layer in layers]
    try:
        with whole_model_attention(lm, "eager"), torch.inference_mode():  # waits for other threads' attention variants
            lm.model(input_ids=torch.as_tensor(twice, dtype=torch.long)[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    if not layers:
        raise KvcInputError(f"cannot find the decoder layers of {type(lm.model).__name__}")
    return (total / len(layers)).numpy()


def sentence_scores(lm: Any, ids: np.ndarray) -> tuple[list[tuple[int, int]], np.ndarray]:
    """The sentences of ``ids`` and each one's score (the module doc), in text order."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    if not 2 <= len(ids) <= MAX_AUTO_TOKENS:
        raise KvcInputError(f"choosing spans by attention needs a context of 2 to {MAX_AUTO_TOKENS} tokens, "
                            f"this one has {len(ids)}")
    spans = sentence_spans(lm.tokenizer, ids)
    sentence_of = np.full(len(ids), -1, dtype=np.int64)
    for i, (a, b) in enumerate(spans):
        sentence_of[a:b] = i
    free = sentence_of < 0  # tokens of no sentence (white space): each its own group
    sentence_of[free] = len(spans) + np.arange(int(free.sum()))
    got = _attention_received(lm, ids, sentence_of)
    got[0] = np.nan  # the attention sink
    scores = np.array([np.nanmean(got[a:b]) if np.isfinite(got[a:b]).any() else -np.inf for a, b in spans])
    template = template_tokens(lm.tokenizer, ids)
    scores[[bool(template[a:b].any()) for a, b in spans]] = -np.inf  # never chosen (module doc)
    return spans, scores


def special_ids(tokenizer: Any) -> np.ndarray:
    """Every special token id of ``tokenizer``: the named ones (``all_special_ids``: BOS, EOS, PAD, ...) and every
    added token marked special. Why both: transformers 5 lists only the named ones in ``all_special_ids``, so Gemma 3's
    ``<start_of_turn>`` / ``<end_of_turn>`` and SmolLM2's ``<file_sep>`` are in the second set only."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", None) or []}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {int(i) for i, tok in added.items() if getattr(tok, "special", False)}
    return np.asarray(sorted(ids), dtype=np.int64)


def template_tokens(tokenizer: Any, ids: np.ndarray) -> np.ndarray:
    """Which tokens of ``ids`` are the prompt's scaffolding, not the document: the tokenizer's special tokens
    (:func:`special_ids`: role markers, turn ends, BOS, wherever they are), and the model's own chat template around
    the user content (:class:`kvcodec.models.chat.ChatFormat`, rendered around a sentinel): its head where the context
    starts with it (the system prompt and user-turn opener every ``kvc ask`` entry starts with), and, where the context
    ends with the question turn's closer (a whole prompt cached with its question), that closer, the assistant opener
    and the turn's ``Question:``.

    Why: attention returns to role markers and the system prompt in every context, whatever the document says;
    ranked by attention they outrank the document, and emphasising them steers nothing the user stored."""
    from kvcodec.models.chat import ChatFormat

    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    out = np.isin(ids, special_ids(tokenizer))
    try:
        fmt = ChatFormat.for_tokenizer(tokenizer)
    except KvcInputError:  # no chat format: only the special tokens are scaffolding
        return out
    head = fmt.prefix
    if 0 < len(head) <= len(ids) and np.array_equal(ids[:len(head)], head):
        out[:len(head)] = True
    q_head, tail = fmt.question_scaffold()
    end = len(ids) - len(tail)
    if len(tail) and end >= 0 and np.array_equal(ids[end:], tail):
        out[end:] = True
        # the question turn's opening words: their last occurrence before the tail
        at = end - len(q_head)
        while len(q_head) and at >= 0 and not np.array_equal(ids[at:at + len(q_head)], q_head):
            at -= 1
        if len(q_head) and at >= 0:
            out[at:at + len(q_head)] = True
    return out


def check_count(k: Any) -> int:
    """``k`` as the number of sentences to choose (an integer in [1, MAX_AUTO_SPANS]), else one line."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or not 1 <= k <= MAX_AUTO_SPANS:
        raise KvcInputError(f"the number of spans to choose must be an integer in [1, {MAX_AUTO_SPANS}], got {k!r:.40}")
    return int(k)


def auto_spans(lm: Any, ids: np.ndarray, k: Any) -> list[tuple[int, int]]:
    """The ``k`` highest-scoring sentences of the context ``ids`` as token spans, in text order (module doc).

    Refused (one line): ``k`` not an integer in [1, MAX_AUTO_SPANS], or so many that every sentence would be
    chosen (nothing would be steered), contexts outside [2, MAX_AUTO_TOKENS] tokens."""
    k = check_count(k)
    spans, scores = sentence_scores(lm, ids)
    eligible = int(np.isfinite(scores).sum())  # the prompt's scaffolding is never chosen (template_tokens)
    if k >= eligible:
        raise KvcInputError(f"the context has {eligible} sentence(s) of document text; choosing {k} would emphasise all of it")
    best = np.argsort(-scores, kind="stable")[:int(k)]
    return [spans[i] for i in sorted(best)]
