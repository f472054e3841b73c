"""The prompt `ask` and blend build, in each model's own chat format.

A knowledge-base context is cached in pieces (the chat prefix, then each
document tokenized on its own, so a document's cache is reusable), and the
question comes last. The pieces must still add up to exactly the prompt the
model was trained on, so the format comes from the tokenizer itself:

* **with a chat template** (``tokenizer.chat_template``): the conversation
  ``[system: SYSTEM, user: <documents> "Question: ..."]`` is rendered with
  ``add_generation_prompt=True`` around a sentinel user message; the text
  before the sentinel is the prefix, the text after it ends the question.
  Templates that refuse a system turn (Gemma's raise) get the system text at
  the head of the user turn instead.
* **without a template** (a base model): the documented plain format
  ``SYSTEM "\\n\\n" <documents> "Question: {q}\\nAnswer:"``.

Either way the text is tokenized with ``add_special_tokens=False`` (special
tokens written in the template text, like ``<start_of_turn>``, are parsed as
such) and a BOS token is put first exactly when the tokenizer itself adds
one (``add_special_tokens=True`` starts with BOS) and the template did not
already write it. Without BOS some models (Gemma) degrade badly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from kvcodec.models.capture import tokenize
from kvcodec.models.chatguard import TemplateBudgetError, render_chat_template
from kvcodec.errors import KvcInputError

SYSTEM = "Answer the question using the documents."
PLAIN_QUESTION = "Question: {question}\nAnswer:"
_SENTINEL = "\u2063KVC-USER-CONTENT\u2063"


def _wants_bos(tokenizer: Any) -> int | None:
    """The BOS id if the tokenizer adds one on its own (the model expects it), else None."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return int(bos) if with_special[:1] == [bos] and without[:1] != [bos] else None


def _render(tokenizer: Any, system: str) -> tuple[str, str]:
    """(text before the user content, text after it) of the model's chat template, rendered with bounded work
    (:mod:`kvcodec.models.chatguard`: a template that does not parse, raises or loops is one KvcInputError line)."""
    try:
        text = render_chat_template(tokenizer, [{"role": "system", "content": system},
                                                {"role": "user", "content": _SENTINEL}])
    except TemplateBudgetError:
        raise
    except KvcInputError:  # the template raised: e.g. Gemma's "System role not supported"
        text = render_chat_template(tokenizer, [{"role": "user", "content": f"{system}\n\n{_SENTINEL}"}])
    if text.count(_SENTINEL) != 1:
        raise KvcInputError("the model's chat template does not place the user message exactly once")
    head, tail = text.split(_SENTINEL)
    return head, tail


@dataclass(frozen=True)
class ChatFormat:
    """How one tokenizer wants a documents + question prompt, as token ids.

    ``prefix`` is the head of the prompt up to the user content (BOS, system
    turn, user-turn opener), ``question_tail`` follows the question (user-turn
    closer, assistant-turn opener), ``templated`` says whether the model's
    own template was used (False: the plain format).
    """

    prefix: np.ndarray
    question_head: str
    question_tail: str
    templated: bool
    tokenizer: Any

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, system: str = SYSTEM) -> "ChatFormat":
        if getattr(tokenizer, "chat_template", None):
            head, tail = _render(tokenizer, system)
            question_head, templated = "Question: ", True
        else:
            head, tail = system + "\n\n", ""
            question_head, templated = "", False
        prefix = _encode(tokenizer, head) if head else np.zeros(0, dtype=np.int64)
        bos = _wants_bos(tokenizer)
        if bos is not None and (prefix.size == 0 or prefix[0] != bos):
            prefix = np.concatenate([np.asarray([bos], dtype=np.int64), prefix])
        if prefix.size == 0:
            raise KvcInputError("the chat format gives an empty prompt prefix")
        return cls(prefix=prefix, question_head=question_head, question_tail=tail, templated=templated, tokenizer=tokenizer)

    def question_scaffold(self) -> tuple[np.ndarray, np.ndarray]:
        """Token ids of the question turn's own words around the question: (before it, after it), e.g.
        ``Question:`` and the turn closer + assistant opener; both empty in the plain format, whose question line is
        the user's. What ends a whole prompt cached with its question, which span choosers must not take for content."""
        if not self.templated:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        head = _encode(self.tokenizer, self.question_head.rstrip()) if self.question_head.strip() else np.zeros(0, np.int64)
        tail = _encode(self.tokenizer, self.question_tail) if self.question_tail else np.zeros(0, np.int64)
        return head, tail

    def question_ids(self, question: str) -> np.ndarray:
        """Token ids of the question turn: the question, then the assistant-turn opener."""
        if not question.strip():
            raise KvcInputError("the question is empty")
        q = question.strip()
        text = f"{self.question_head}{q}{self.question_tail}" if self.templated else PLAIN_QUESTION.format(question=q)
        return _encode(self.tokenizer, text)


def _encode(tokenizer: Any, text: str) -> np.ndarray:
    """Ids of ``text`` without added special tokens; whitespace-only text (a template's newline) is kept."""
    if text.strip():
        return tokenize(tokenizer, text)
    return np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=np.int64)


def is_chat_context(lm: Any, token_ids: Any) -> bool:
    """Whether ``token_ids`` open with ``lm``'s own chat prefix, as every context ``KnowledgeBase`` and ``kvc ask``
    store does: a context a question will follow (rate control's chat factor, :mod:`kvcodec.onboard.chatfactor`)."""
    if token_ids is None or getattr(lm, "tokenizer", None) is None:
        return False
    memo = getattr(lm, "__dict__", {}).get("_kvc_chat_prefix")
    if memo is None:
        memo = ChatFormat.for_tokenizer(lm.tokenizer).prefix  # the template's, or the plain format's system line
        try:
            lm.__dict__["_kvc_chat_prefix"] = memo
        except (AttributeError, TypeError):
            pass
    ids = np.asarray(token_ids).reshape(-1)
    return bool(memo.size) and ids.size > memo.size and bool(np.array_equal(ids[:memo.size], memo))
