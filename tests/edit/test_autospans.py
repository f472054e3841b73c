"""The query-independent span scorer for ``steer`` (:mod:`kvcodec.edit.autospans`) on the real model."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.edit.autospans import MAX_AUTO_TOKENS, auto_spans, sentence_scores, sentence_spans
from kvcodec.errors import KvcInputError
from kvcodec.models.capture import tokenize

pytestmark = pytest.mark.model


def test_sentences_cover_the_text_in_order(lm):
    text = "First point: the key is blue.\nSecond line here! Is it? Yes. Last"
    ids = tokenize(lm.tokenizer, text)
    spans = sentence_spans(lm.tokenizer, ids)
    got = [lm.tokenizer.decode(ids[a:b].tolist()).strip() for a, b in spans]
    assert got == ["First point:", "the key is blue.", "Second line here!", "Is it?", "Yes.", "Last"]
    assert all(b1 <= a2 for (_, b1), (a2, _) in zip(spans, spans[1:]))


def test_scores_and_choice_are_deterministic_and_leave_the_model_as_it_was(lm, changelog_ids):
    ids = changelog_ids[:120]
    impl = lm.model.config._attn_implementation
    spans, s1 = sentence_scores(lm, ids)
    _, s2 = sentence_scores(lm, ids)
    assert lm.model.config._attn_implementation == impl  # the eager pass is undone
    assert np.array_equal(s1, s2) and np.isfinite(s1).all() and len(spans) > 3
    got = auto_spans(lm, ids, 3)
    best = sorted(spans[i] for i in np.argsort(-s1, kind="stable")[:3])
    assert got == best  # the top three sentences, in text order


@pytest.mark.parametrize("k, msg", [(0, "integer in"), (True, "integer in"), (2.5, "integer in"), (10_000, "integer in"),
                                    (40, "would emphasise all")])
def test_hostile_counts_are_one_line(lm, changelog_ids, k, msg):
    with pytest.raises(KvcInputError, match=msg):
        auto_spans(lm, changelog_ids[:60], k)


def test_hostile_contexts_are_one_line(lm, changelog_ids):
    with pytest.raises(KvcInputError, match="2 to"):
        auto_spans(lm, changelog_ids[:1], 1)
    with pytest.raises(KvcInputError, match=str(MAX_AUTO_TOKENS)):
        auto_spans(lm, np.zeros(MAX_AUTO_TOKENS + 1, np.int64), 1)


def test_the_prompt_scaffolding_is_never_chosen(lm, changelog_ids):
    """On a `kvc ask` entry's context (the model's chat prefix, then the document), no sentence holding the chat
    prefix or a special token is ever chosen, however many are asked for (issue 57: the system prompt and role
    markers outranked the document)."""
    from kvcodec.edit.autospans import template_tokens
    from kvcodec.models.chat import ChatFormat

    prefix = ChatFormat.for_tokenizer(lm.tokenizer).prefix
    doc = changelog_ids[:100]
    special = np.asarray(sorted(lm.tokenizer.all_special_ids), np.int64)
    ids = np.concatenate([prefix, doc[:50], special[:1], doc[50:]])  # a role marker inside the document too
    marked = template_tokens(lm.tokenizer, ids)
    assert marked[:len(prefix)].all() and marked[len(prefix) + 50] and not marked[len(prefix):len(prefix) + 50].any()
    spans, scores = sentence_scores(lm, ids)
    touching = [bool(marked[a:b].any()) for a, b in spans]
    assert any(touching) and all(np.isneginf(s) for s, t in zip(scores, touching) if t)
    assert all(np.isfinite(s) for s, t in zip(scores, touching) if not t)
    eligible = len(spans) - sum(touching)
    for a, b in auto_spans(lm, ids, eligible - 1):
        assert not marked[a:b].any()
    with pytest.raises(KvcInputError, match="of document text"):
        auto_spans(lm, ids, eligible)


def test_a_kvc_ask_prompt_never_gets_its_scaffolding_chosen(lm, tmp_path):
    """A whole prompt as `kvc ask` builds it (KnowledgeBase: the model's chat prefix, two documents, then the question
    turn, as a cache of the full prompt holds it), a document of which holds a special token that transformers 5
    leaves out of ``all_special_ids`` (SmolLM2's ``<file_sep>``, special among the tokenizer's added tokens): every
    special token, the chat prefix, the question turn's ``Question:`` and its closer/assistant opener are marked, no
    document token is, and however many sentences are asked for, no chosen span touches a marked token (issue 57:
    the system prompt and role markers were emphasised instead of the document)."""
    from kvcodec.edit.autospans import template_tokens
    from kvcodec.runtime.knowledge import KnowledgeBase

    tok = lm.tokenizer
    fsep = tok.convert_tokens_to_ids("<file_sep>")
    assert fsep not in tok.all_special_ids  # the case the named list misses
    kb = KnowledgeBase(lm, str(tmp_path / "st"), preset="lossless")
    docs = ["The service listens on port 8443. Its logs rotate daily.\n<file_sep>\nBackups run at midnight.",
            "Access needs a badge. Visitors sign in at the desk. The desk closes at six."]
    ctx, _ = kb.context_ids(docs)
    ids = np.concatenate([ctx, kb.question_ids("Which port does the service use?")])
    marked = template_tokens(tok, ids)
    n_prefix, (q_head, tail) = len(kb.prefix_ids()), kb.chat.question_scaffold()
    assert marked[:n_prefix].all() and marked[ids == fsep].all() and marked[np.isin(ids, tok.all_special_ids)].all()
    assert len(tail) > 1 and marked[len(ids) - len(tail):].all()
    assert marked[len(ctx):len(ctx) + len(q_head)].all() and not marked[len(ctx) + len(q_head):len(ids) - len(tail)].any()
    assert not marked[n_prefix:len(ctx)][ids[n_prefix:len(ctx)] != fsep].any()  # the documents' own words
    spans, scores = sentence_scores(lm, ids)
    eligible = int(np.isfinite(scores).sum())
    assert 0 < eligible < len(spans)
    chosen = auto_spans(lm, ids, eligible - 1)
    assert len(chosen) == eligible - 1 and not any(marked[a:b].any() for a, b in chosen)
    text = " ".join(tok.decode(ids[a:b].tolist()) for a, b in chosen)
    assert not any(s in text for s in ("<|im_", "<file_sep>", "Answer the question using", "Question:"))
