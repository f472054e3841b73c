"""What a redaction named by text leaves in the child: nothing of what it names (spec/kvc-v1.md §4.5).

Two ways the removed text survived, both found by scanning the child's token ids and decoded text:

* a character spelled by several byte tokens (a rare CJK character, an emoji) was removed by its *last* token
  only, since only that token completes it: the child kept the character's leading bytes (``龘`` is
  ``E9 BE 98``; the child kept the tokens of ``E9 BE``);
* removing every occurrence joins the text around them, and the join can spell the text again (``1234`` out of
  ``12123434`` left ``12`` + ``34``): the child said what the redaction was asked to remove.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.errors import KvcInputError
from kvcodec.format import KvcReader

pytestmark = pytest.mark.model

LINE = "Minutes of the meeting. The on-call engineer this week is {}, reachable after six.\nNothing else was noted."


@pytest.fixture(scope="module")
def parent(lm):
    from kvcodec.api import encode
    from kvcodec.models.capture import capture, tokenize

    def make(text: str) -> bytes:
        return encode(capture(lm, token_ids=tokenize(lm.tokenizer, text)), None, preset="lossless").data

    return make


def _child_text(lm, data: bytes) -> str:
    with KvcReader(data) as r:
        return lm.tokenizer.decode(np.asarray(r.token_ids).tolist())


def _one_run_removed(parent_text: str, child_text: str) -> bool:
    """Whether ``child_text`` is ``parent_text`` less one run of whole characters."""
    return any(parent_text.startswith(child_text[:i]) and parent_text.endswith(child_text[i:])
               for i in range(len(child_text) + 1)) and len(child_text) < len(parent_text)


@pytest.mark.parametrize("name, secret", [("鱻龘", "龘"), ("鱻龘", "鱻"), ("𠜎𠜱", "𠜱"), ("😀😃", "😃"), ("😀😃", "😀")])
def test_a_character_spelled_by_byte_tokens_is_removed_whole(lm, parent, name, secret):
    from kvcodec.edit.redact import redact

    text = LINE.format(name)
    child = _child_text(lm, redact(lm, parent(text), text=secret).data)
    assert "\ufffd" not in child  # no stray byte of a character is left (before: the secret's leading bytes)
    assert secret not in child and _one_run_removed(text, child)


@pytest.mark.parametrize("how", [{"text": "1234"}, {"pattern": r"1234"}])
def test_a_join_that_spells_the_text_again_is_removed_too(lm, parent, how, tmp_path):
    from kvcodec.edit.redact import redact
    from kvcodec.edit.stored import edit_stored, resolve_params
    from kvcodec.models.capture import tokenize
    from kvcodec.store import Store, StoreKey
    from kvcodec.store.keys import codec_key

    text = "The door code is 12123434. Keep it to yourself."
    data = parent(text)
    child = _child_text(lm, redact(lm, data, **how).data)
    assert "1234" not in child and "door code is" in child and "Keep it" in child
    # the service's path resolves the spans apart (before the model slot): the same spans
    resolved = resolve_params(lm, data, "redact", dict(how))
    assert _child_text(lm, redact(lm, data, token_spans=resolved["token_spans"]).data) == child
    store = Store.open(str(tmp_path / "store"))
    key = StoreKey.for_tokens(tokenize(lm.tokenizer, text), model=lm.fingerprint.id, codec=codec_key("lossless"),
                              namespace="t")
    store.put(key, data, {})
    _, res = edit_stored(lm, store, key, "redact", dict(how))
    assert "1234" not in lm.tokenizer.decode(res.cache.token_ids.tolist())


def test_a_pattern_that_matches_whatever_is_left_is_refused(lm, parent):
    """The last digit of a number: each removal makes a new last digit. Refused in one line after a bounded
    number of rounds, before any prefill."""
    from kvcodec.edit.redact import redact

    with pytest.raises(KvcInputError, match="rounds"):
        redact(lm, parent("The serial is 987654321, printed on the back."), pattern=r"\d(?!\d)")


@pytest.mark.parametrize("how", [{"text": "Keiko  Tanaka"}, {"pattern": r"Keiko\s+Tanak[ei]\b"},
                                 {"pattern": r"Keiko Tanaka("}, {"pattern": r"(?R)Keiko Tanaka"}])
def test_a_refused_redaction_does_not_repeat_what_it_was_given(lm, parent, how):
    """What a caller asks to remove is the secret (or a near miss of it: a typo, another spelling): a refusal
    says what is wrong without quoting it, since the service logs every refusal's line (before: ``the text
    'Keiko  Tanaka' does not occur ...`` in the answer and in the operator's log)."""
    from kvcodec.edit.redact import redact
    from kvcodec.edit.stored import resolve_params

    data = parent(LINE.format("Keiko Tanaka"))
    for run in (lambda: redact(lm, data, **how), lambda: resolve_params(lm, data, "redact", dict(how))):
        with pytest.raises(KvcInputError) as got:
            run()
        assert "Keiko" not in str(got.value) and "Tanak" not in str(got.value)


def test_spans_the_log_cannot_hold_are_refused_before_the_prefill(lm, parent, monkeypatch):
    """A redaction's record holds its spans (at most 4,096 characters of JSON): 256 spans at five-digit token
    indices (a model with a window past 10,000 tokens) overflow it, and the whole prefill ran before the write
    refused the log. Shown here with the limit lowered to what this short entry's spans overflow."""
    import kvcodec.edit.log as log
    import kvcodec.edit.redact as redact_mod

    prefilled = []
    monkeypatch.setattr(log, "MAX_PARAMS_CHARS", 60)
    monkeypatch.setattr(redact_mod, "_prefill", lambda *a: prefilled.append(1))
    with pytest.raises(KvcInputError, match="more than the 60"):
        redact_mod.redact(lm, parent(LINE.format("Keiko Tanaka")), token_spans=[(2, 3), (5, 6), (8, 9), (11, 12)])
    assert not prefilled


def test_the_patterns_time_bound_is_for_all_rounds_together(lm, monkeypatch):
    """Matching again over what is kept must not multiply the pattern's bound (2 CPU-seconds, the guide says):
    each pass gets what is left of one bound, and a round matches once (it matched twice, each with a whole bound)."""
    import kvcodec.edit.spans as spans
    from kvcodec.models.capture import tokenize

    bounds: list[float | None] = []
    real = spans.regex_spans

    def recording(text, pattern, seconds=None, required=True):
        bounds.append(seconds)
        return real(text, pattern, seconds, required)

    monkeypatch.setattr(spans, "regex_spans", recording)
    ids = tokenize(lm.tokenizer, "The serial is 987654321, printed on the back.")
    with pytest.raises(KvcInputError, match="rounds"):
        spans.redaction_spans(lm.tokenizer, ids, pattern=r"\d(?!\d)")
    assert len(bounds) == spans.REDACT_ROUNDS + 1
    assert all(b is not None and 0 < b <= spans.PATTERN_SECONDS for b in bounds)
    assert bounds[0] == spans.PATTERN_SECONDS  # the first pass has the whole bound (the text's map is not its work)
    assert bounds == sorted(bounds, reverse=True)


def test_widening_to_whole_characters_is_bounded_per_span(lm):
    """A context of literal U+FFFD reads, boundary after boundary, as one unfinished character: each span's edges
    walked the whole run (250 spans over 6,000 such tokens: 6.6 s of decodes). A character has at most 4 bytes,
    so an edge moves at most 3 tokens."""
    from kvcodec.edit.spans import whole_characters
    from kvcodec.models.capture import tokenize

    ids = tokenize(lm.tokenizer, "\ufffd" * 300)
    spans = [(i, i + 1) for i in range(10, len(ids) - 10, 40)]
    decodes = []

    class Counting:
        def decode(self, ids):
            decodes.append(1)
            return lm.tokenizer.decode(ids)

    out = whole_characters(Counting(), ids, spans)
    assert len(decodes) <= 8 * len(spans)
    assert sum(b - a for a, b in out) <= 7 * len(spans)
