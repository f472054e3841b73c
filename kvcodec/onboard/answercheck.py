"""The answer probe: does a preset keep a model's answers at the step its rate control picks? (issue 53)

Why a probe of its own: mean KL over a continuation averages over easy tokens, and a knowledge base does
not know its future questions. A fact that only a later question reads is one token among thousands on
a continuation, so a file can meet its KL promise and still change the answer to that question. Measured
on SmolLM2 (BENCHMARKS.md, "Answers"): ``balanced`` (mean KL <= 0.01, importance-weighted steps) changed
5 of 12 answers; uniform steps at about twice its bits changed none of the same 12.

What it does, once per model when its rate model is fitted (``kvc calibrate``, or the first lossy encode):
it plants :data:`FACTS` facts (invented names, random numbers: written nowhere but in the context) at
spread-out depths of the tuning texts :data:`PROBE_TEXTS` (:data:`kvcodec.texts.TUNING`, never the held-out
set), asks about each one through the model's own chat template (:mod:`kvcodec.models.chat`), and
compares the greedy answer from the decoded cache with the exact cache's, token for token. The result is
the largest factor of :data:`STEP_FACTORS` at which every answer of every text is identical; rate control
multiplies the preset's step by it (:func:`kvcodec.plan.ratecontrol.controlled_plan`), and says so in one
warning line when it is below 1: the model is deposited at a safer rate, never silently.

It is a screen, not a benchmark: :data:`FACTS` x :data:`PROBE_TEXTS` questions cannot show a 97 % rate,
only catch a model on which the preset's step loses answers outright. The benchmark is
``benchmarks/bench_answers.py`` (held-out texts and questions).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

PROBE_VERSION = 1  # part of the rate model's per-preset digest: a changed probe re-runs on next use
PROBE_TEXTS = ("gpl3", "pydoc")  # tuning texts (kvcodec.texts.TUNING): nothing is evaluated on them
PROBE_TOKENS = 2048  # each probe context, at most (less in a smaller window)
FACTS = 4  # per text
ANSWER_TOKENS = 12  # greedy tokens compared per answer (the facts' answers are 1-4 words)
# tokens a probe context leaves free in the model's window for what it is continued with: a question and its answer
# here; the chat factor's longer answer is cut to what the window holds (kvcodec.onboard.chatfactor.chat_continuations)
CONTINUATION_ROOM = 96
STEP_FACTORS = (1.0, 0.5, 0.25)  # tried in turn; the last is taken if none keeps every answer
_NAMES = ("Varnholt", "Quessel", "Brindmoor", "Tallowick", "Ostrander", "Helvik", "Marrowby", "Dunsk")
_THINGS = ("archive", "lighthouse", "observatory", "foundry", "mill", "library", "harbour office", "seed bank")


@dataclass(frozen=True)
class ProbeContext:
    """One probe context: its token ids (chat prefix + the planted document) and its questions' ids."""

    text: str
    ids: np.ndarray
    questions: tuple[np.ndarray, ...]


def probe_contexts(lm: Any, tokens: int = PROBE_TOKENS) -> list[ProbeContext]:
    """The probe's contexts for ``lm``: each tuning text cut to fit ``tokens`` (and the model's window), with
    :data:`FACTS` facts planted at evenly spread depths (deterministic: seeded by the text's name)."""
    from kvcodec.models.capture import max_context, tokenize
    from kvcodec.models.chat import ChatFormat
    from kvcodec.texts import load_text

    chat = ChatFormat.for_tokenizer(lm.tokenizer)
    window = max_context(lm)
    budget = min(tokens, window - CONTINUATION_ROOM) if isinstance(window, int) else tokens
    out = []
    for name in PROBE_TEXTS:
        rng = random.Random(f"answer-probe/{name}")
        paras = [p for p in load_text(name).split("\n\n") if p.strip()]
        facts, questions = [], []
        for i in range(FACTS):
            place = f"{rng.choice(_NAMES)} {_THINGS[i % len(_THINGS)]}"
            code = str(rng.randrange(1000, 9999))
            facts.append(f"The access code of the {place} is {code}.")
            questions.append(f"Answer from the documents above, with the value only. "
                             f"What is the access code of the {place}?")
        # keep whole paragraphs while the document fits the budget, then plant the facts at spread depths
        kept: list[str] = []
        used = len(chat.prefix) + sum(len(tokenize(lm.tokenizer, f + "\n\n")) for f in facts)
        for p in paras:
            n = len(tokenize(lm.tokenizer, p + "\n\n"))
            if used + n > budget:
                break
            kept.append(p)
            used += n
        while len(kept) >= 2 * FACTS:  # the paragraphs' counts were an estimate: the joined document decides
            ids = _planted(chat.prefix, kept, facts, lm.tokenizer)
            if len(ids) <= budget:
                out.append(ProbeContext(name, ids, tuple(chat.question_ids(q) for q in questions)))
                break
            kept.pop()
    return out


def _planted(prefix: np.ndarray, paras: list[str], facts: list[str], tokenizer: Any) -> np.ndarray:
    """Token ids of the chat prefix and the paragraphs with ``facts`` planted at evenly spread depths."""
    from kvcodec.models.capture import tokenize

    kept = list(paras)
    for i, f in enumerate(facts):
        kept.insert(int((i + 0.5) * len(paras) / len(facts)) + i, f)
    return np.concatenate([prefix, tokenize(tokenizer, "\n\n".join(kept).rstrip() + "\n\n")])


def answers(lm: Any, cache: Any, questions: tuple[np.ndarray, ...], n: int = ANSWER_TOKENS) -> list[list[int]]:
    """The greedy answer (up to ``n`` tokens, stopping at EOS) to each question fed after ``cache``, the questions
    batched (:func:`kvcodec.models.quality.greedy_answers`)."""
    from kvcodec.models.quality import greedy_answers

    return greedy_answers(lm, cache, list(questions), n)


def probe_caches(lm: Any, contexts: list[ProbeContext]) -> list[Any]:
    """The exact cache of each probe context (one prefill each). The answer probe and the chat factors
    (:mod:`kvcodec.onboard.chatfactor`) read the same contexts, so a rate-model fit prefills them once and hands both
    the caches (a prefill is deterministic: the same caches, bit for bit, as each prefilling its own)."""
    from kvcodec.models.capture import capture

    return [capture(lm, token_ids=c.ids) for c in contexts]


class Probe:
    """A model's probe contexts (:func:`probe_contexts`) and, on first use, their exact caches (:func:`probe_caches`)
    and token importance (:meth:`importance`): what one rate-model fit hands its answer probe and its chat factors, so
    each context is tokenized, prefilled and scored once."""

    def __init__(self, lm: Any, fast: Any = None) -> None:
        self.lm = lm
        # what prefills the contexts and scores their tokens: the onboarding twin (kvcodec.models.compute) when given;
        # the answers and KLs read from the caches run on ``lm``
        self.fast = lm if fast is None else fast
        self.contexts = probe_contexts(lm)
        self._caches: list[Any] | None = None
        self._importance: dict[tuple[int, Any], Any] = {}

    @property
    def caches(self) -> list[Any]:
        if self._caches is None:
            self._caches = probe_caches(self.fast, self.contexts)
        return self._caches

    def importance(self, cache: Any, tokenscale: Any) -> Any:
        """The token importance rate control plans ``cache`` (one of :attr:`caches`) with for a preset whose
        ``tokenscale`` setting this is (None: it weighs no tokens, and gets None), computed once per cache and window:
        :func:`~kvcodec.plan.ratecontrol.controlled_plan` computes it per call when not given it, per preset and per
        step factor (a forward pass each; a whole prefill on a model with sliding-window layers)."""
        if tokenscale is None:
            return None
        from kvcodec.models.importance import cache_importance
        from kvcodec.plan.pipelines import TOKENSCALE_DEFAULT

        window = {**TOKENSCALE_DEFAULT, **tokenscale}["window"]
        key = (id(cache), window)
        if key not in self._importance:
            self._importance[key] = cache_importance(self.fast, cache, window=window)
        return self._importance[key]


def answer_step_factor(lm: Any, contexts: list[ProbeContext], plan_at: Callable[[Any, float], Any],
                       progress: Callable[[], None] | None = None, caches: list[Any] | None = None) -> dict[str, Any]:
    """The largest of :data:`STEP_FACTORS` at which the plans ``plan_at(cache, factor)`` keep every probe answer
    identical to the exact cache's, and what was seen at each factor tried (module docstring). ``caches``: the
    contexts' exact caches (:func:`probe_caches`), read and never changed; None prefills them."""
    from kvcodec.core.roundtrip import roundtrip

    caches = probe_caches(lm, contexts) if caches is None else caches
    exact = [answers(lm, cache, c.questions) for cache, c in zip(caches, contexts)]
    tried = []
    for factor in STEP_FACTORS:
        same = total = 0
        for cache, c, ref in zip(caches, contexts, exact):
            dec, _ = roundtrip(cache, plan_at(cache, factor))
            got = answers(lm, dec, c.questions)
            same += sum(a == b for a, b in zip(got, ref))
            total += len(ref)
            if progress is not None:
                progress()
        tried.append({"factor": factor, "identical": same, "questions": total})
        if same == total:
            break
    return {"factor": tried[-1]["factor"], "tried": tried, "texts": [c.text for c in contexts]}
