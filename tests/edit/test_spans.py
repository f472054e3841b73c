"""Spans of a stored context: characters and regex matches map to the tokens that overlap them."""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.edit.spans import char_spans_to_tokens, merge_ranges, parse_token_span, resolve_spans, token_offsets
from kvcodec.errors import KvcInputError
from tests.edit.conftest import EMAIL

pytestmark = pytest.mark.model


def test_offsets_tile_the_decoded_text(lm, changelog_ids):
    ids = changelog_ids[:120]
    text, ends = token_offsets(lm.tokenizer, ids)
    assert text == lm.tokenizer.decode(ids.tolist())
    assert ends[0] == 0 and ends[-1] == len(text) and np.all(np.diff(ends) >= 0)
    # each token's characters are what it adds to the decoding
    for i in (0, 7, 50, 119):
        assert text[ends[i]:ends[i + 1]] == lm.tokenizer.decode(ids[:i + 1].tolist())[ends[i]:]


def test_an_email_regex_maps_to_exactly_the_tokens_that_spell_it(lm, changelog_ids):
    ids = changelog_ids[:160]
    text, ends = token_offsets(lm.tokenizer, ids)
    spans = resolve_spans(lm.tokenizer, ids, pattern=EMAIL)
    assert len(spans) >= 1
    a, b = spans[0]
    covered = text[ends[a]:ends[b]]
    assert "jak@debian.org" in covered
    # nothing outside the address is taken except the pieces of the tokens at its edges
    assert len(covered) - len("<jak@debian.org>") < 6
    assert resolve_spans(lm.tokenizer, ids, text="jak@debian.org")[0][0] >= a


def test_char_spans_take_straddling_tokens_whole():
    ends = np.array([0, 3, 5, 9, 12])
    assert char_spans_to_tokens(ends, [(4, 6)]) == [(1, 3)]
    assert char_spans_to_tokens(ends, [(0, 3), (3, 5)]) == [(0, 2)]
    assert merge_ranges([(5, 7), (1, 2), (2, 4)]) == [(1, 4), (5, 7)]


@pytest.mark.parametrize("kw, msg", [
    ({"pattern": "zzz-not-there"}, "matches nothing"),
    ({"pattern": "("}, "bad regular expression"),
    ({"pattern": ""}, "non-empty"),
    ({"pattern": "(?=apt)"}, "matches nothing"),  # only empty matches
    ({"token_spans": [(5, 5)]}, "empty or outside"),
    ({"token_spans": [(-1, 3)]}, "empty or outside"),
    ({"token_spans": [(0, 10_000)]}, "empty or outside"),
    ({"char_spans": [(10, 5)]}, "empty or outside"),
    ({}, "exactly one"),
    ({"pattern": "a", "text": "a"}, "exactly one"),
])
def test_bad_spans_are_one_input_error(lm, changelog_ids, kw, msg):
    with pytest.raises(KvcInputError, match=msg):
        resolve_spans(lm.tokenizer, changelog_ids[:40], **kw)


def test_parse_token_span():
    assert parse_token_span("3:9") == (3, 9)
    with pytest.raises(KvcInputError, match="START:END"):
        parse_token_span("3-9")


@pytest.mark.parametrize("pattern, msg", [
    # regex unrolls counted repeats at compile, before any timeout: nested counts took gigabytes and minutes
    ("(?:(?:a{1000}){1000}){1000}", "repeats too much"),
    ("(?:x{1000}y{1000}){1000}", "repeats too much"),  # siblings add up: 2 million, about 550 MB
    # the text's reading counted too little where regex parses otherwise: a version-0 class [[] taken as a nested
    # one still open ([[](?:(?:a{300}){300}){30}] counted 1 and took 767 MB), verbose whitespace and comments
    ("[[](?:(?:a{300}){300}){2}]", "repeats too much"),
    ("(?x)(?:(?:a{400}) {400})", "repeats too much"),
    ("(?x)(?:a{400}#)\n){400}", "repeats too much"),
    # an endless recursion filled regex's backtracking stack (576 MB for (?R), about 1 GB for (?:(?R)|h)) before
    # its MemoryError: a call to a group or to the pattern is refused before the compile, whatever its spelling
    ("(?R)", "calls itself or a group"),
    ("(?:(?R)|h)", "calls itself or a group"),
    ("(?(DEFINE)(?<x>(?&x)))(?&x)", "calls itself or a group"),
    ("(?x)(?P #c\n>x)(?P<x>(?:(?P>x)|h))", "calls itself or a group"),
    ("(?x)(?+ 1)((?-1)|h)", "calls itself or a group"),
])
def test_a_pattern_that_would_exhaust_memory_is_one_input_error(pattern, msg):
    """A hostile pattern costs neither unbounded memory at its compile nor a traceback at its match; patterns with
    ordinary counts (an IP address, a brace run) still match."""
    from kvcodec.edit.spans import regex_spans

    text = "host 10.0.0.1 {{{{{ said hello " * 200
    with pytest.raises(KvcInputError, match=msg):
        regex_spans(text, pattern)
    assert regex_spans(text, r"\d{1,3}(?:\.\d{1,3}){3}")[0] == (5, 13)
    assert regex_spans(text, r"[{]{5}")[0] == (14, 19)
    from kvcodec.edit.spans import unrolled_size

    assert unrolled_size(r"\p{L}{3,}") == 3 and unrolled_size(r"\d{1,3}(?:\.\d{1,3}){3}") == 18
    from kvcodec.edit.spans import parsed_size

    assert parsed_size(r"\d{1,3}(?:\.\d{1,3}){3}") < 30 and parsed_size("(?x)(?:(?:a{400}) {400})") > 160_000
