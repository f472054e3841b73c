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
import time
from typing import Any, Sequence

import numpy as np

from kvcodec.errors import KvcInputError

__all__ = ["MAX_PATTERN_CHARS", "MAX_PATTERN_UNROLLED", "MAX_SPANS", "MAX_TEXT_CHARS", "PATTERN_SECONDS", "KvcPatternTimeoutError",
           "REDACT_ROUNDS", "char_spans_to_tokens", "int_pairs", "merge_ranges", "parse_token_span", "parsed_size",
           "redaction_spans", "regex_spans", "resolve_spans", "text_spans", "token_offsets", "unrolled_size",
           "whole_characters"]

MAX_PATTERN_CHARS = 1000
MAX_TEXT_CHARS = 100_000  # a literal to find (a paragraph, a page): searched as a literal, never as a regex
MAX_SPANS = 256
#: CPU-seconds a pattern may run over the context before it is refused (issue 55): a sane pattern over the
#: longest context (tens of thousands of characters) takes milliseconds. CPU time, as the ``regex`` module
#: measures its timeout: on a loaded machine the wall time to the refusal is longer, the work is not
PATTERN_SECONDS = 2.0
#: the most pattern elements a regex may stand for once its counted repeats are unrolled (:func:`unrolled_size`).
#: ``regex`` compiles ``x{m}`` as m copies of ``x``, at the compile, before any timeout applies: nested counts
#: multiply (``(?:(?:a{1000}){1000}){1000}`` took gigabytes, and minutes, before its first match was tried). A
#: million copies took 270 MB; this bound is about 30 MB, far past any pattern a redaction names.
MAX_PATTERN_UNROLLED = 100_000


def token_offsets(tokenizer: Any, ids: np.ndarray) -> tuple[str, np.ndarray]:
    """The decoded text of ``ids`` and ``ends`` [n+1]: token i covers characters ``[ends[i], ends[i+1])``.

    Each boundary is the length of the decoding of the ids before it (a byte-level BPE token that ends inside
    a multi-byte character owns nothing until the character is complete). A boundary that moves backwards (a
    tokenizer whose prefix decodings are not prefixes of each other) is clamped, so the ranges stay ordered.

    Why not one decode per prefix (the definition, and what this computed until issue 55): that is quadratic,
    16.8 s at 8,192 tokens, inside the service's one model slot. The prefix decodings are instead built from
    short windows: ``decode(ids[:i])`` is the text up to an *anchor* token (a clean character boundary the
    window already reached) plus what ``decode(ids[anchor - _CONTEXT:i])`` adds after its first
    ``_CONTEXT`` tokens (the context absorbs what a decoder does at a text's start, such as SentencePiece's
    dropped leading space). Each window is at most ``_WINDOW + _CONTEXT`` tokens, so the whole map costs
    O(n) decodes of bounded length. Every anchor is checked against the full decoding, and so is the end; a
    tokenizer whose decoding is not local in this sense (the check fails) gets the per-prefix definition.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    text = tokenizer.decode(ids.tolist())
    ends = _windowed_ends(tokenizer, ids.tolist(), text)
    if ends is None:
        ends = _prefix_ends(tokenizer, ids.tolist(), text)
    return text, ends


_WINDOW = 24  # tokens decoded past the anchor before it moves on
_CONTEXT = 4  # tokens decoded before the anchor, and dropped from the window's text


def _clamp(n: int, ends: np.ndarray, i: int, total: int) -> int:
    return min(max(n, int(ends[i - 1])), total)


def _prefix_ends(tokenizer: Any, ids: list[int], text: str) -> np.ndarray:
    """The definition: one decode per prefix (quadratic; the fallback of :func:`token_offsets`)."""
    ends = np.zeros(len(ids) + 1, dtype=np.int64)
    for i in range(1, len(ids)):
        piece = tokenizer.decode(ids[:i])
        n = len(piece) if text.startswith(piece) else len(piece.rstrip("\ufffd"))
        ends[i] = _clamp(n, ends, i, len(text))
    ends[len(ids)] = len(text)
    return ends


def _windowed_ends(tokenizer: Any, ids: list[int], text: str) -> np.ndarray | None:
    """The same boundaries as :func:`_prefix_ends` from bounded windows (:func:`token_offsets`), or None when
    the tokenizer's decoding is not local (an anchor or the end disagrees with the full decoding)."""
    n_ids = len(ids)
    ends = np.zeros(n_ids + 1, dtype=np.int64)
    anchor, base = 0, 0  # decode(ids[:anchor]) == text[:base]
    ctx, ctx_len = 0, 0  # the window starts at ids[ctx]; decode(ids[ctx:anchor]) has ctx_len characters
    for i in range(1, n_ids + 1):
        w = tokenizer.decode(ids[ctx:i])
        if w[:ctx_len] != text[base - ctx_len:base]:
            return None  # the context decodes differently inside a longer window: not local
        tail = w[ctx_len:]
        is_prefix = text.startswith(tail, base)
        if i == n_ids:
            if not (is_prefix and base + len(tail) == len(text)):
                return None
            ends[i] = len(text)
            return ends
        if is_prefix:
            n = base + len(tail)
        else:  # what the definition computes for a piece that is not a prefix of the text
            stripped = tail.rstrip("\ufffd")
            n = base + len(stripped) if stripped else len(text[:base].rstrip("\ufffd"))
        ends[i] = _clamp(n, ends, i, len(text))
        if i - anchor >= _WINDOW and is_prefix and tail and not tail.endswith("\ufffd"):
            moved = _context_at(tokenizer, ids, text, i, base + len(tail))
            if moved is not None:  # else: no clean context yet (inside a multi-byte character), keep the anchor
                anchor, base, (ctx, ctx_len) = i, base + len(tail), moved
    return ends  # no tokens, or one


def _context_at(tokenizer: Any, ids: list[int], text: str, i: int, base: int) -> tuple[int, int] | None:
    """A window start ``c`` (about ``_CONTEXT`` tokens before ``i``) whose decoding up to ``i`` is the text's
    up to ``base``, as (c, its length); None if none of a few starts is (each starts inside a character)."""
    for back in range(_CONTEXT, 2 * _CONTEXT + 4):
        c = max(0, i - back)
        ct = tokenizer.decode(ids[c:i])
        if len(ct) <= base and ct == text[base - len(ct):base]:
            return c, len(ct)
        if c == 0:
            break
    return None


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


_COUNT = re.compile(r"\{([0-9]*)(?:,([0-9]*))?\}")
_BRACED_ESCAPES = "pPNxXLgukU"  # an escape letter that may be followed by {...} (a property, a name, a code point)


def _skip_class(pattern: str, i: int) -> int:
    """The index after the character class opening at ``pattern[i] == "["`` (nested classes, as version 1 allows)."""
    depth, i = 1, i + 1
    if i < len(pattern) and pattern[i] == "^":
        i += 1
    if i < len(pattern) and pattern[i] == "]":  # a leading ] is a literal
        i += 1
    while i < len(pattern) and depth:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            depth += 1
        elif c == "]":
            depth -= 1
        i += 1
    return i


def unrolled_size(pattern: str) -> int:
    """An upper bound of how many elements ``pattern`` stands for with its counted repeats unrolled: each atom
    (a character, an escape, a class) counts 1, a group the sum of its contents (alternatives added), and
    ``{m}``, ``{m,n}``, ``{m,}`` multiply what they repeat by their largest finite count. What ``regex``'s
    compile builds grows with it (:data:`MAX_PATTERN_UNROLLED`); a brace that is not a count is an atom."""
    frames: list[list[int]] = [[0, 0]]  # per open group: [total, weight of its last atom]
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        top = frames[-1]
        if c == "(":
            frames.append([0, 0])
            i += 1
            continue
        if c == ")" and len(frames) > 1:
            total = max(frames.pop()[0], 1)
            frames[-1][0] += total
            frames[-1][1] = total
            i += 1
            continue
        if c == "{":
            m = _COUNT.match(pattern, i)
            if m and (m.group(1) or m.group(2)) and top[1]:
                counts = [int(g) for g in m.groups() if g]
                times = max(counts)
                top[0] += top[1] * (times - 1)
                top[1] *= times
                i = m.end()
                continue
        if c in "*+?|":
            top[1] = top[1] if c != "|" else 0
            i += 1
            continue
        if c == "[":
            i = _skip_class(pattern, i)
        elif c == "\\":
            i += 2
            if i < n and pattern[i] in "{<" and pattern[i - 1] in _BRACED_ESCAPES:
                close = pattern.find("}" if pattern[i] == "{" else ">", i)
                i = n if close < 0 else close + 1
        else:
            i += 1
        top[0] += 1
        top[1] = 1
    while len(frames) > 1:  # an unbalanced pattern: regex refuses it, the bound still counts it
        total = frames.pop()[0]
        frames[-1][0] += total
    return frames[0][0]


def parsed_size(pattern: str) -> int | None:
    """How many nodes ``pattern`` stands for with its counted repeats unrolled, read from ``regex``'s own parse
    tree (a repeat multiplies its subpattern's size by its largest finite count), or None where this ``regex``
    has no such parser (its internals changed: :func:`unrolled_size` alone bounds the pattern then).

    Why the module's own parse as well as :func:`unrolled_size`'s reading of the text: that reading
    miscounted what ``regex`` parses another way, and counted too little: in version 0 ``[[]`` is a whole
    class, which it took as a nested one still open (``[[](?:(?:a{300}){300}){30}]`` counted 1 and took
    767 MB), and in verbose mode whitespace and ``#`` comments are not atoms (``(?x)(?:(?:a{1000}) {1000})
    {1000}`` counted 3,003). Parsing is linear in the pattern (at most :data:`MAX_PATTERN_CHARS`); nothing is
    compiled. Raises ``regex.error`` for a pattern ``regex`` refuses."""
    try:
        from regex import _regex_core as core

        flags = 0
        for _ in range(4):  # a global flag set after the start ((?x) mid-pattern) restarts the parse, as regex does
            source = core.Source(pattern)
            info = core.Info(flags, source.char_type, {})
            source.ignore_space = bool(info.flags & core.VERBOSE)
            source.use_unicode_space(bool(info.flags & core.VERSION1))
            try:
                tree = core._parse_pattern(source, info)
                break
            except core._UnscopedFlagSet:
                flags = info.global_flags
        else:
            return None
        base, repeat = core.RegexBase, core.GreedyRepeat  # Lazy and Possessive repeats subclass GreedyRepeat
    except (ImportError, AttributeError, TypeError):
        return None
    sizes: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(tree, False)]
    while stack:  # post-order, without recursion: a pattern nests up to some 500 groups deep
        node, ready = stack.pop()
        kids = [v for v in vars(node).values() if isinstance(v, base)]
        kids += [x for v in vars(node).values() if isinstance(v, (list, tuple)) for x in v if isinstance(x, base)]
        if not ready:
            stack.append((node, True))
            stack.extend((k, False) for k in kids)
            continue
        if isinstance(node, repeat):
            times = node.max_count if node.max_count is not None else max(node.min_count, 1)
            sizes[id(node)] = sizes[id(node.subpattern)] * times
        else:
            sizes[id(node)] = 1 + sum(sizes[id(k)] for k in kids)
    return sizes[id(tree)]


def _skip_ignorable(pattern: str, i: int) -> int:
    """The index of the next character at or after ``i`` that verbose mode reads: whitespace and ``#`` comments
    skipped (always, whatever the flags: treating more as ignorable only refuses more)."""
    n = len(pattern)
    while i < n:
        if pattern[i].isspace():
            i += 1
        elif pattern[i] == "#":
            end = pattern.find("\n", i)
            i = n if end < 0 else end + 1
        else:
            break
    return i


def _calls_a_group(pattern: str) -> bool:
    """Whether ``pattern`` calls itself or a group as a subroutine (``(?R)``, ``(?0)``, ``(?1)``, ``(?-1)``,
    ``(?+1)``, ``(?&name)``, ``(?P>name)``).

    Why refused outright: a call that recurses without consuming a character grows ``regex``'s backtracking
    stack to its cap before the match fails, and that cap is memory, not time: ``(?R)`` took 576 MB, and
    ``(?:(?R)|h)`` about 1 GB, in under a second of CPU (every concurrent edit of ``kvc serve`` may hold one).
    A span to redact or emphasise never needs recursion. Verbose mode lets whitespace and comments sit after
    ``(?+``, ``(?-`` and ``(?P`` (``(?P #c\n>x)`` is a call), so they are skipped there. Only escapes are
    skipped otherwise: a character class is not (in version 0 ``[[]`` is a class of one ``[``, which a
    nested-class reader would take as still open, hiding what follows), so a ``(?R`` inside a class is refused
    too, which costs nothing real."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "\\":
            i += 2
            continue
        if pattern.startswith("(?", i) and i + 2 < n:
            c = pattern[i + 2]
            if c in "R&" or c.isdigit():
                return True
            if c in "+-P":
                j = _skip_ignorable(pattern, i + 3)
                if j < n and (pattern[j] == ">" if c == "P" else pattern[j].isdigit()):
                    return True
        i += 1
    return False


class KvcPatternTimeoutError(KvcInputError):
    """A pattern that did not finish within :data:`PATTERN_SECONDS` (catastrophic backtracking, most likely)."""


def regex_spans(text: str, pattern: str, seconds: float | None = None, required: bool = True) -> list[tuple[int, int]]:
    """Character spans of every non-empty match of ``pattern`` in ``text``, found within ``seconds``
    (default :data:`PATTERN_SECONDS`); none is refused unless ``required`` is False.

    Why the ``regex`` module and not ``re``: a pattern such as ``(a+)+$`` backtracks for longer than the
    universe lasts, and ``re`` can neither stop it nor let another thread run meanwhile (it holds the GIL:
    through ``kvc serve`` one such request froze every tenant, issue 55). ``regex`` takes a ``timeout`` and,
    with ``concurrent=True``, matches with the GIL released, so the service's event loop and other edits run on.
    Its syntax is ``re``'s (version 0) plus extensions.
    """
    import regex

    if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
        raise KvcInputError(f"the pattern must be a non-empty regular expression of at most {MAX_PATTERN_CHARS} characters")
    if _calls_a_group(pattern):
        raise KvcInputError(f"the pattern ({len(pattern)} characters) calls itself or a group ((?R), (?1), (?&name), (?P>name)): "
                            "recursion is not taken (the matcher's stack for it grows to gigabytes); name the span "
                            "without it")
    try:
        size = max(unrolled_size(pattern), parsed_size(pattern) or 0)
    except (regex.error, ValueError, TypeError, OverflowError, RecursionError, IndexError) as exc:
        raise KvcInputError(f"bad regular expression ({len(pattern)} characters): {exc}") from None
    if size > MAX_PATTERN_UNROLLED:
        raise KvcInputError(f"the pattern ({len(pattern)} characters) repeats too much: its counted repeats ({{m}}, {{m,n}}) stand "
                            f"for {size:,} elements (limit {MAX_PATTERN_UNROLLED:,}); repeat less, or use * or +")
    try:
        rx = regex.compile(pattern)
    except (regex.error, ValueError, TypeError, OverflowError, RecursionError) as exc:
        raise KvcInputError(f"bad regular expression ({len(pattern)} characters): {exc}") from None
    bound = PATTERN_SECONDS if seconds is None else seconds
    # regex's timeout counts the process's CPU time, every thread's (measured: two catastrophic matches at once, each
    # under a 2 s timeout, stopped after ~1 s of their own CPU): concurrent work makes a match's bound tighter, never
    # looser. This thread's own CPU, checked between matches, bounds the whole search.
    deadline = time.thread_time() + bound
    spans: list[tuple[int, int]] = []
    try:
        for m in rx.finditer(text, timeout=bound, concurrent=True):
            if m.end() > m.start():
                spans.append(m.span())
                if len(spans) > MAX_SPANS:
                    break
            if time.thread_time() > deadline:  # the bound is on the whole search, not each match
                raise TimeoutError
    except MemoryError:  # regex caps its backtracking stack: an endless recursion ((?R), (?&name)) reaches the cap
        raise KvcInputError(f"the pattern ({len(pattern)} characters) ran out of the matcher's memory over the {len(text)}-character "
                            "context (a recursion that never consumes a character?); simplify it") from None
    except TimeoutError:
        raise KvcPatternTimeoutError(f"the pattern ({len(pattern)} characters) did not finish within {bound:g} CPU-seconds over the "
                                     f"{len(text)}-character context (catastrophic backtracking?); simplify it") from None
    if not spans and required:
        raise KvcInputError(f"the pattern ({len(pattern)} characters) matches nothing in the stored context")
    if len(spans) > MAX_SPANS:
        raise KvcInputError(f"the pattern matches more than {MAX_SPANS} spans (limit {MAX_SPANS})")
    return spans


def text_spans(text: str, literal: str, required: bool = True) -> list[tuple[int, int]]:
    """Character spans of every occurrence of ``literal`` in ``text`` (left to right, not overlapping); none is
    refused unless ``required`` is False.

    A literal is searched as a literal (``str.find``, linear), with its own limit: a paragraph to redact is
    ordinary, and escaping it into a regex would count it against the pattern's cap (issue 55)."""
    if not isinstance(literal, str) or not literal:
        raise KvcInputError("the text to find is empty")
    if len(literal) > MAX_TEXT_CHARS:
        raise KvcInputError(f"the text to find has {len(literal)} characters (limit {MAX_TEXT_CHARS})")
    spans: list[tuple[int, int]] = []
    at = text.find(literal)
    while at >= 0:
        spans.append((at, at + len(literal)))
        if len(spans) > MAX_SPANS:
            raise KvcInputError(f"the text occurs more than {MAX_SPANS} times (limit {MAX_SPANS})")
        at = text.find(literal, at + len(literal))
    if not spans and required:
        raise KvcInputError(f"the text ({len(literal)} characters) does not occur in the stored context")
    return spans


def int_pairs(v: Any, what: str) -> list[tuple[int, int]]:
    """``v`` as (start, end) integer pairs, refused in one line otherwise: a float, a string or a bool is not
    coerced (issue 55: ``[(1.7, "3")]`` was read as ``[(1, 3)]``)."""
    try:
        pairs = list(v)
        ok = all(len(p) == 2 and all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in p)
                 for p in pairs)
    except TypeError:
        ok = False
    if not ok or isinstance(v, (str, bytes)):
        raise KvcInputError(f"{what} must be (start, end) integer pairs")
    return [(int(a), int(b)) for a, b in pairs]


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
        spans = int_pairs(token_spans, "token spans")
        if not spans or len(spans) > MAX_SPANS:
            raise KvcInputError(f"give 1 to {MAX_SPANS} token spans")
        for a, b in spans:
            if not 0 <= a < b <= n:
                raise KvcInputError(f"token span [{a}, {b}) is empty or outside the context's {n} tokens")
        return merge_ranges(spans)
    decoded, ends = token_offsets(tokenizer, ids)
    if text is not None:
        spans_c = text_spans(decoded, text)
    elif pattern is not None:
        spans_c = regex_spans(decoded, pattern)
    else:
        spans_c = int_pairs(char_spans, "character spans")
        if not spans_c or len(spans_c) > MAX_SPANS:
            raise KvcInputError(f"give 1 to {MAX_SPANS} character spans")
    return whole_characters(tokenizer, ids, char_spans_to_tokens(ends, spans_c))


_LEAD = 8  # tokens decoded before a boundary to tell whether it splits a character (a character has <= 4 bytes)
_CHAR_TOKENS = 3  # the most tokens a span's edge moves to take a split character whole (whole_characters)


def whole_characters(tokenizer: Any, ids: np.ndarray, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """``spans`` (token ranges named by characters) widened until neither edge splits a character's bytes.

    Why: a byte-level tokenizer spells a rare character (a CJK name, an emoji) with several byte tokens, and
    only the last one *owns* the character in :func:`token_offsets` (the others add no complete character). A
    span named by characters took that last token alone, so a redaction left the character's leading bytes in
    the child (removing ``龘`` kept the tokens of ``E9 BE``), and a span whose last token ended inside the next
    character left that character's trailing bytes stranded. An edge lies inside a character when the tokens
    before it decode to an incomplete one (the decoder's U+FFFD); a literal U+FFFD in the text reads the same
    and only widens the span.

    Each edge moves at most :data:`_CHAR_TOKENS` tokens: a character has at most 4 UTF-8 bytes, so its bytes
    before the token that completes it lie in at most 3 tokens. Unbounded, a context of literal U+FFFD read as
    one long character (each of 250 spans walked the whole run: 6.6 s over 6,000 tokens)."""
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    n = len(ids)

    def inside(j: int) -> bool:
        return 0 < j < n and tokenizer.decode(ids[max(0, j - _LEAD):j].tolist()).endswith("\ufffd")

    out = []
    for a, b in spans:
        for _ in range(_CHAR_TOKENS):
            if not inside(a):
                break
            a -= 1
        for _ in range(_CHAR_TOKENS):
            if not inside(b):
                break
            b += 1
        out.append((a, b))
    return merge_ranges(out)


#: how many times a redaction matches its pattern or text again over what it would keep (:func:`redaction_spans`)
REDACT_ROUNDS = 4


def redaction_spans(tokenizer: Any, ids: np.ndarray, *, pattern: str | None = None, text: str | None = None,
                    char_spans: Sequence[tuple[int, int]] | None = None,
                    token_spans: Sequence[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The token ranges a redaction removes: :func:`resolve_spans`'s, and for a ``pattern`` or a ``text``, also
    what matches in the kept context once those are gone, until nothing matches (in the parent's indices).

    Why again: removing a match joins the text around it, and the join can spell the match anew: redacting
    ``1234`` from ``12123434`` kept ``12`` + ``34``, and the child said ``1234``. A redaction promises that
    what it names is gone from the child, so it matches the child's text as well, at most
    :data:`REDACT_ROUNDS` times; a pattern that still matches then (one that matches whatever is left, such as
    ``\\d(?!\\d)``, a number's last digit) is refused in one line. The pattern's time bound
    (:data:`PATTERN_SECONDS` of this thread's CPU) is for all the rounds together, not for each."""
    if pattern is None and text is None:
        return resolve_spans(tokenizer, ids, char_spans=char_spans, token_spans=token_spans)
    if sum(x is not None for x in (pattern, text, char_spans, token_spans)) != 1:
        raise KvcInputError("name the span by exactly one of: a pattern, a text, character spans, token spans")
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    removed = np.zeros(len(ids), bool)
    deadline: float | None = None  # set at the first match: the map of the text is not the pattern's work
    for round_ in range(REDACT_ROUNDS + 1):
        kept = np.flatnonzero(~removed)
        if kept.size == 0:
            raise KvcInputError("the spans cover the whole context: nothing would be left")
        decoded, ends = token_offsets(tokenizer, ids[kept])
        if text is not None:
            found = text_spans(decoded, text, required=round_ == 0)
        else:
            if deadline is None:
                deadline, left = time.thread_time() + PATTERN_SECONDS, PATTERN_SECONDS
            else:
                left = max(deadline - time.thread_time(), 1e-3)
            found = regex_spans(decoded, str(pattern), seconds=left, required=round_ == 0)
        if not found:
            edges = np.flatnonzero(np.diff(np.concatenate([[0], removed.astype(np.int8), [0]])))
            out = [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2])]
            if len(out) > MAX_SPANS:
                raise KvcInputError(f"the redaction removes more than {MAX_SPANS} spans (limit {MAX_SPANS})")
            return out
        if round_ == REDACT_ROUNDS:
            break
        for a, b in whole_characters(tokenizer, ids[kept], char_spans_to_tokens(ends, found)):
            removed[kept[a:b]] = True
    raise KvcInputError(f"what remains still {'contains the text' if text is not None else 'matches the pattern'} after "
                        f"{REDACT_ROUNDS} rounds of removing it (each removal joins text that "
                        f"{'spells' if text is not None else 'matches'} it again); name the spans to remove directly")
