"""Spans of a stored context: from characters of its text (or a regex over it) to token ranges.

Why through the decoded text: the stored entry holds token ids, not the text it was made from, and a user
names what to redact or emphasise by what it says ("the e-mail address", "the paragraph that starts
with ..."). The text is the tokenizer's decoding of the stored ids, and each token owns the characters its
decoding adds (:func:`token_offsets`), so a character span maps to every token that overlaps it: a token
that straddles the span's edge is included whole (removing half a token is impossible; emphasising a whole
one costs nothing).
"""

from __future__ import annotations

import re
from typing import Any, Sequence

import numpy as np

from kvcodec.errors import KvcInputError

__all__ = ["MAX_PATTERN_CHARS", "MAX_SPANS", "char_spans_to_tokens", "merge_ranges", "parse_token_span", "regex_spans",
           "resolve_spans", "token_offsets"]

MAX_PATTERN_CHARS = 1000
MAX_SPANS = 256


def token_offsets(tokenizer: Any, ids: np.ndarray) -> tuple[str, np.ndarray]:
    """The decoded text of ``ids`` and ``ends`` [n+1]: token i covers characters ``[ends[i], ends[i+1])``.

    Each boundary is the length of the decoding of the ids before it (decoded in one call per token; a
    byte-level BPE token that ends inside a multi-byte character owns nothing until the character is
    complete). A boundary that moves backwards (a tokenizer whose prefix decodings are not prefixes of
    each other) is clamped, so the ranges stay ordered.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    text = tokenizer.decode(ids.tolist())
    ends = np.zeros(len(ids) + 1, dtype=np.int64)
    for i in range(1, len(ids)):
        piece = tokenizer.decode(ids[:i].tolist())
        n = len(piece) if text.startswith(piece) else len(piece.rstrip("\ufffd"))
        ends[i] = min(max(n, ends[i - 1]), len(text))
    ends[len(ids)] = len(text)
    return text, ends


def char_spans_to_tokens(ends: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Token ranges ``[a, b)`` of every token overlapping each character span ``[s, e)`` (merged, sorted)."""
    n_chars = int(ends[-1])
    out = []
    for s, e in spans:
        if not (0 <= s < e <= n_chars):
            raise KvcInputError(f"character span [{s}, {e}) is empty or outside the context's {n_chars} characters")
        a = int(np.searchsorted(ends, s, side="right")) - 1  # the token whose range holds character s
        b = int(np.searchsorted(ends, e, side="left"))  # first token starting at or after e
        out.append((max(a, 0), max(b, a + 1)))
    return merge_ranges(out)


def merge_ranges(ranges: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, overlapping or touching ranges joined."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def regex_spans(text: str, pattern: str) -> list[tuple[int, int]]:
    """Character spans of every non-empty match of ``pattern`` in ``text``."""
    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise KvcInputError(f"the pattern must be a non-empty regular expression of at most {MAX_PATTERN_CHARS} characters")
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        raise KvcInputError(f"bad regular expression {pattern!r:.60}: {exc}") from None
    spans = [m.span() for m in rx.finditer(text) if m.end() > m.start()]
    if not spans:
        raise KvcInputError(f"the pattern {pattern!r:.60} matches nothing in the stored context")
    if len(spans) > MAX_SPANS:
        raise KvcInputError(f"the pattern matches {len(spans)} spans (limit {MAX_SPANS})")
    return spans


def parse_token_span(s: str) -> tuple[int, int]:
    """``"A:B"`` -> (A, B): a token range as the CLI takes it."""
    try:
        a, b = (int(x) for x in str(s).split(":"))
    except ValueError:
        raise KvcInputError(f"a token span is START:END (token indices), got {s!r:.40}") from None
    return a, b


def resolve_spans(tokenizer: Any, ids: np.ndarray, *, pattern: str | None = None, text: str | None = None,
                  char_spans: Sequence[tuple[int, int]] | None = None,
                  token_spans: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """Token ranges named by exactly one of: a regex ``pattern``, a literal ``text`` (every occurrence),
    character spans, or token spans; merged, sorted, each within ``[0, len(ids))`` and non-empty."""
    given = [x is not None for x in (pattern, text, char_spans, token_spans)]
    if sum(given) != 1:
        raise KvcInputError("name the span by exactly one of: a pattern, a text, character spans, token spans")
    n = len(ids)
    if token_spans is not None:
        spans = [(int(a), int(b)) for a, b in token_spans]
        if not spans or len(spans) > MAX_SPANS:
            raise KvcInputError(f"give 1 to {MAX_SPANS} token spans")
        for a, b in spans:
            if not 0 <= a < b <= n:
                raise KvcInputError(f"token span [{a}, {b}) is empty or outside the context's {n} tokens")
        return merge_ranges(spans)
    decoded, ends = token_offsets(tokenizer, ids)
    if text is not None:
        if not isinstance(text, str) or not text:
            raise KvcInputError("the text to find is empty")
        spans_c = regex_spans(decoded, re.escape(text))
    elif pattern is not None:
        spans_c = regex_spans(decoded, pattern)
    else:
        spans_c = [(int(a), int(b)) for a, b in (char_spans or [])]
        if not spans_c or len(spans_c) > MAX_SPANS:
            raise KvcInputError(f"give 1 to {MAX_SPANS} character spans")
    return char_spans_to_tokens(ends, spans_c)
