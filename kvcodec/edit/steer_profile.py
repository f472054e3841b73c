"""Choosing the heads to steer, and the task that measures steering (issue 37).

**The task** (:func:`fact_examples`): a key fact buried among distractor passages. Four facts of one form
("The password of the staging server is walrus.") name four different servers and values; they sit between
paragraphs of a real held-out text (:data:`kvcodec.texts.HELD_OUT`), and the question asks for one of them.
The emphasised span is the asked fact's sentence (the user, or the KDN operator, marks the key passage: PASTA's
setting). An answer is right when the asked value is the most likely of the four values as the continuation
of the question (:func:`answer_margin`: log-probability of each value's tokens, teacher-forced), so the metric
is accuracy over examples, and the margin (right minus best wrong, nats) is its smooth version.

**The head profile** (:func:`profile_layers`), PASTA's procedure made affordable: PASTA steers each head
alone on 1,000 examples of four tasks and intersects the per-task top-k. Here each *layer* is steered alone
(all its query heads: ``layers`` candidates instead of ``layers x heads``) on a small profiling set built from
other held-out texts, names and values than the evaluation set, and the ``top`` layers with the largest mean
margin gain are kept (only layers whose gain is positive). Their heads are the steered heads. The profile is
query-independent (it never sees the evaluation questions), as an offline edit must be.
:func:`profile_heads` runs the whole procedure for a model (``kvc edit profile-heads``): a new model's heads are
profiled before it is steered, since steering the wrong layers lowers the margin.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import torch

from kvcodec.edit.spans import char_spans_to_tokens, token_offsets
from kvcodec.errors import KvcInputError
from kvcodec.integrations.attn_bias import biased_attention, model_attention_heads

__all__ = ["FactExample", "PROFILE_EXAMPLES", "PROFILE_TEXTS", "answer_margin", "fact_examples", "heads_spec",
           "profile_heads", "profile_layers"]

PROFILE_TEXTS = ("apache2", "changelog-apt")  # held-out texts, none of them the evaluation's (bench_edit.py)
PROFILE_EXAMPLES = 6  # what a 2-core CPU affords per layer (docs/guide/edit.md)
MAX_PROFILE_EXAMPLES = 1000  # PASTA's own count: more is a mistake, not a profile

_SERVERS = ("staging", "backup", "billing", "archive", "mail", "build", "print", "search")
_VALUES = ("walrus", "tulip", "comet", "granite", "saffron", "harbor", "violet", "cobalt", "meadow", "falcon",
           "quartz", "juniper", "lantern", "orchid", "pepper", "summit")


@dataclass
class FactExample:
    """One example: the context's token ids, the emphasised token span, the question ids, the candidate
    values' ids (index 0 is the right one)."""

    context: np.ndarray
    span: tuple[int, int]
    question: np.ndarray
    candidates: list[np.ndarray]


def _paragraphs(text: str, min_chars: int = 150, max_chars: int = 400) -> list[str]:
    out = []
    for p in text.split("\n\n"):
        p = " ".join(p.split())
        if min_chars <= len(p):
            out.append(p[:max_chars])
    return out


def fact_examples(tokenizer: Any, texts: Sequence[str], n: int, seed: int, facts: int = 4,
                  passages: int = 4) -> list[FactExample]:
    """``n`` examples (see the module doc), deterministic in ``seed``, distractors from ``texts``."""
    from kvcodec.models.capture import tokenize
    from kvcodec.texts import load_text

    rng = random.Random(seed)
    paras = [p for t in texts for p in _paragraphs(load_text(t))]
    if len(paras) < passages:
        raise KvcInputError(f"the texts {', '.join(texts)} hold {len(paras)} paragraph(s) of 150+ characters; "
                            f"each example needs {passages} distractors")
    out = []
    for _ in range(n):
        servers = rng.sample(_SERVERS, facts)
        values = rng.sample(_VALUES, facts)
        sentences = [f"The password of the {s} server is {v}." for s, v in zip(servers, values)]
        chosen = rng.sample(paras, passages)
        ask = rng.randrange(facts)
        order = list(range(facts))
        rng.shuffle(order)
        parts, where = [], {}
        for i in range(max(facts, passages)):
            if i < passages:
                parts.append(chosen[i])
            if i < facts:
                where[order[i]] = len(parts)
                parts.append(sentences[order[i]])
        text = "\n\n".join(parts)
        ids = tokenize(tokenizer, text)
        start = text.index(sentences[ask])
        _, ends = token_offsets(tokenizer, ids)
        (a, b), = char_spans_to_tokens(ends, [(start, start + len(sentences[ask]))])
        q = tokenize(tokenizer, f"\n\nQuestion: What is the password of the {servers[ask]} server?\n"
                                f"Answer: The password of the {servers[ask]} server is")
        cands = [tokenize(tokenizer, " " + values[ask])] + [tokenize(tokenizer, " " + v) for i, v in enumerate(values)
                                                            if i != ask]
        out.append(FactExample(ids, (a, b), q, cands))
    return out


@torch.inference_mode()
def answer_margin(lm: Any, cache: Any, ex: FactExample, bias: Any = None) -> float:
    """log p(right value) - max log p(wrong value) after ``cache`` (a KVCache of ``ex.context``) and the question,
    under ``bias`` (applied to every query, as the loader does; None: no steering)."""
    from kvcodec.models.cachelayout import cache_for_model

    n = cache.num_context_tokens
    scores = []
    with biased_attention(lm, bias, n):
        for cand in ex.candidates:
            ids = np.concatenate([ex.question, cand])
            past = cache_for_model(lm, cache)
            out = lm.model(input_ids=torch.as_tensor(ids)[None], past_key_values=past,
                           position_ids=torch.arange(n, n + len(ids))[None], use_cache=True)
            lp = torch.log_softmax(out.logits[0].double(), -1)
            k = len(ex.question)
            scores.append(float(sum(lp[k - 1 + i, int(t)] for i, t in enumerate(cand))))
    return scores[0] - max(scores[1:])


def _is_int(x: Any) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def _check_profile(lm: Any, top: Any, layers: Sequence[int] | None) -> list[int]:
    """The layers to profile (all by default) as distinct ints in range, and ``top`` checked; else one line."""
    L = lm.fingerprint.num_layers
    if not _is_int(top) or not 1 <= top <= L:
        raise KvcInputError(f"top must be an integer in [1, {L}] (the model's layers), got {top!r:.40}")
    chosen = list(range(L)) if layers is None else list(layers)
    if not chosen or not all(_is_int(x) and 0 <= x < L for x in chosen) or len(set(chosen)) != len(chosen):
        raise KvcInputError(f"layers to profile must be distinct integers in [0, {L - 1}], at least one")
    return [int(x) for x in chosen]


def profile_layers(lm: Any, examples: Sequence[FactExample], alpha: float = 0.01, top: int = 3,
                   layers: Sequence[int] | None = None, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Steer each layer alone (all its heads) on ``examples``; keep the ``top`` layers of largest positive mean
    margin gain. Returns ``{"heads": [[layer, head], ...], "layers": [...], "heads_spec": "L:*,..." (None when no
    layer gains), "gain_by_layer": {...}, "baseline_margin": ...}``. ``progress`` gets a line per profiled layer
    (minutes in all: each layer costs a steered prefill and four scored answers per example)."""
    from kvcodec.edit.steer import check_alpha, pasta_bias, steer_cache
    from kvcodec.models.capture import capture

    todo = _check_profile(lm, top, layers)
    check_alpha(alpha)
    if not examples:
        raise KvcInputError("profiling needs at least one example")
    H = model_attention_heads(lm)
    plain = [capture(lm, token_ids=ex.context) for ex in examples]
    base = [answer_margin(lm, c, ex) for c, ex in zip(plain, examples)]
    gains: dict[int, float] = {}
    for i, layer in enumerate(todo):
        g = []
        for ex, b0 in zip(examples, base):
            bias = pasta_bias(lm, [(layer, h) for h in range(H)], [ex.span], len(ex.context), alpha)
            g.append(answer_margin(lm, steer_cache(lm, ex.context, bias), ex, bias) - b0)
        gains[layer] = float(np.mean(g))
        if progress is not None:
            progress(f"layer {layer} ({i + 1}/{len(todo)}): mean margin gain {gains[layer]:+.3f} nats")
    best = sorted([layer for layer, g in sorted(gains.items(), key=lambda kv: -kv[1]) if g > 0][:top])
    return {"heads": [[layer, h] for layer in best for h in range(H)], "layers": best, "heads_spec": heads_spec(best),
            "gain_by_layer": gains, "baseline_margin": float(np.mean(base)), "alpha": alpha, "examples": len(examples)}


def heads_spec(layers: Sequence[int]) -> str | None:
    """Every head of ``layers`` as ``kvc edit steer --heads`` takes them (``"20:*,23:*"``); None for no layer."""
    return ",".join(f"{layer}:*" for layer in layers) or None


def profile_heads(lm: Any, texts: Sequence[str] = PROFILE_TEXTS, examples: int = PROFILE_EXAMPLES, top: int = 3,
                  alpha: float = 0.01, layers: Sequence[int] | None = None, seed: int = 1,
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """The heads to steer on ``lm``: :func:`profile_layers` on ``examples`` key-fact examples drawn from ``texts``
    (names of :mod:`kvcodec.texts` or text files). Everything is checked before the first forward pass; the result
    adds the texts and the seconds it took."""
    import time

    from kvcodec.edit.steer import check_alpha

    if not _is_int(examples) or not 1 <= examples <= MAX_PROFILE_EXAMPLES:
        raise KvcInputError(f"examples must be an integer in [1, {MAX_PROFILE_EXAMPLES}], got {examples!r:.40}")
    _check_profile(lm, top, layers)
    check_alpha(alpha)
    if not texts:
        raise KvcInputError("give at least one text to draw the profiling examples from")
    t0 = time.perf_counter()
    exs = fact_examples(lm.tokenizer, list(texts), int(examples), seed=seed)
    if progress is not None:
        n = lm.fingerprint.num_layers if layers is None else len(layers)
        progress(f"profiling {n} layer(s) on {len(exs)} key-fact example(s) from {', '.join(texts)}")
    out = profile_layers(lm, exs, alpha=alpha, top=top, layers=layers, progress=progress)
    return dict(out, texts=list(texts), seconds=round(time.perf_counter() - t0, 1))
