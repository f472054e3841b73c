"""Parse and validate pruning specs: ``"h2o:0.25"``, ``"h2o:heavy=0.1,recent=0.1"``, ``"lingua:0.5"``.

Grammar::

    spec    := method ":" item ("," item)*
    method  := "h2o" | "lingua"
    item    := amount | key "=" value
    amount  := fraction | percent | count
               fraction: a number with a decimal point, 0 < f <= 1   ("0.25", "1.0")
               percent : a number followed by "%", 0 < p <= 100      ("25%")
               count   : an integer >= 2 (a number of tokens)         ("512")

A bare ``1`` is refused as ambiguous (write ``1.0``/``100%`` for the whole
context). All amounts are *kept* shares (a budget), not removed shares.

``h2o`` keys: ``heavy``, ``recent`` (amounts; either may be 0 when the other
is given), ``window`` (query window for the attention scores: a count of last
queries, or ``all``; default 64). A single bare amount is split evenly
between heavy and recent, as in the H2O paper (10 % + 10 %).

``lingua`` keys: ``keep`` (the bare amount), ``segment`` (tokens per segment,
default 200), ``spread`` (question-aware ratio spread across segments, 0..1,
default 0.5; used only when a question is given).

Every problem is a :class:`~kvcodec.errors.KvcInputError` that names the spec.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from kvcodec.errors import KvcInputError

DEFAULT_WINDOW = 64
DEFAULT_SEGMENT = 200
DEFAULT_SPREAD = 0.5

_NUM = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?$")


@dataclass(frozen=True)
class Amount:
    """A share of the context: a fraction in (0, 1] or a token count (>= 0 for a component)."""

    value: float
    is_count: bool

    def tokens(self, n: int, what: str = "budget") -> int:
        """Tokens this amount keeps out of a context of ``n`` tokens."""
        if self.is_count:
            k = int(self.value)
            if k > n:
                raise KvcInputError(f"the {what} asks for {k} tokens but the context has only {n}")
            return k
        return min(n, int(math.floor(self.value * n + 0.5)))

    def __str__(self) -> str:
        if self.is_count:
            return str(int(self.value))
        t = f"{self.value:.10g}"
        return t if ("." in t or "e" in t) else t + ".0"


ZERO = Amount(0.0, True)


def parse_amount(text: str, spec: str, what: str, allow_zero: bool = False) -> Amount:
    t = text.strip()
    if not t:
        raise KvcInputError(f"prune spec {spec!r}: {what} is empty")
    pct = t.endswith("%")
    body = t[:-1].strip() if pct else t
    if not _NUM.match(body):
        raise KvcInputError(f"prune spec {spec!r}: {what} {text!r} is not a number (use 0.25, 25% or a token count)")
    v = float(body)
    if not math.isfinite(v):
        raise KvcInputError(f"prune spec {spec!r}: {what} must be finite")
    if allow_zero and v == 0:
        return ZERO
    if v <= 0:
        raise KvcInputError(f"prune spec {spec!r}: {what} must be > 0, got {text!r}")
    if pct:
        if v > 100:
            raise KvcInputError(f"prune spec {spec!r}: {what} {text!r} is over 100%")
        return Amount(v / 100.0, False)
    is_int_literal = "." not in body and "e" not in body.lower()
    if is_int_literal:
        if v == 1:
            raise KvcInputError(
                f"prune spec {spec!r}: {what} '1' is ambiguous; write 1.0 or 100% for the whole context, or a count >= 2"
            )
        return Amount(float(int(body)), True)
    if v > 1:
        raise KvcInputError(
            f"prune spec {spec!r}: {what} {text!r} is a fraction above 1 (fractions lie in (0, 1]; counts are integers)"
        )
    return Amount(v, False)


@dataclass(frozen=True)
class H2OBudget:
    """Keep per KV head the ``recent`` last tokens plus the ``heavy`` highest-scoring others."""

    heavy: Amount
    recent: Amount
    window: int | None = DEFAULT_WINDOW  # None: scores from all queries (accumulated, as in H2O)
    total: Amount | None = None  # a single budget: split evenly (recent gets the odd token)

    method = "h2o"

    def resolve(self, n: int) -> tuple[int, int]:
        """(heavy, recent) token counts for a context of ``n`` tokens; refuses impossible budgets."""
        if n <= 0:
            raise KvcInputError("cannot prune an empty context")
        if self.total is not None:
            k = self.total.tokens(n, "budget")
            h, r = k // 2, k - k // 2
        else:
            h = self.heavy.tokens(n, "heavy budget")
            r = self.recent.tokens(n, "recent budget")
            if not self.heavy.is_count and not self.recent.is_count and h + r == n + 1:
                h -= 1  # two fractions summing to <= 1 that both rounded up
        if h + r > n:
            raise KvcInputError(f"prune spec {self.spec()!r}: heavy {h} + recent {r} tokens exceed the {n}-token context")
        if h + r == 0:
            raise KvcInputError(f"prune spec {self.spec()!r} keeps no token of the {n}-token context")
        return h, r

    def kept(self, n: int) -> int:
        return sum(self.resolve(n))

    def spec(self) -> str:
        w = "all" if self.window is None else str(self.window)
        if self.total is not None:
            return f"h2o:{self.total},window={w}"
        return f"h2o:heavy={self.heavy},recent={self.recent},window={w}"


@dataclass(frozen=True)
class LinguaBudget:
    """Keep ``keep`` of the context's tokens, dropping the most predictable ones per segment."""

    keep: Amount
    segment: int = DEFAULT_SEGMENT
    spread: float = DEFAULT_SPREAD

    method = "lingua"

    def resolve(self, n: int) -> int:
        if n <= 0:
            raise KvcInputError("cannot prune an empty context")
        k = self.keep.tokens(n, "lingua budget")
        if k < 1:
            raise KvcInputError(f"prune spec {self.spec()!r} keeps no token of the {n}-token context")
        return k

    def kept(self, n: int) -> int:
        return self.resolve(n)

    def spec(self) -> str:
        return f"lingua:keep={self.keep},segment={self.segment},spread={self.spread:g}"


PruneBudget = H2OBudget | LinguaBudget


def _int_opt(v: str, spec: str, key: str, lo: int) -> int:
    v = v.strip()
    if not re.fullmatch(r"\d+", v) or int(v) < lo:
        raise KvcInputError(f"prune spec {spec!r}: {key} must be an integer >= {lo}, got {v!r}")
    return int(v)


def parse_prune(spec: str) -> PruneBudget:
    """Parse a prune spec string into an :class:`H2OBudget` or :class:`LinguaBudget`."""
    if not isinstance(spec, str) or not spec.strip():
        raise KvcInputError("empty prune spec; expected e.g. 'h2o:0.25', 'h2o:heavy=0.1,recent=0.1' or 'lingua:0.5'")
    s = spec.strip()
    method, sep, rest = s.partition(":")
    method = method.strip().lower()
    if method not in ("h2o", "lingua"):
        raise KvcInputError(f"prune spec {spec!r}: unknown method {method!r} (expected 'h2o' or 'lingua')")
    if not sep or not rest.strip():
        raise KvcInputError(f"prune spec {spec!r}: missing budget after '{method}:' (e.g. '{method}:0.25')")
    bare: str | None = None
    kv: dict[str, str] = {}
    for item in rest.split(","):
        item = item.strip()
        if not item:
            raise KvcInputError(f"prune spec {spec!r}: empty item (stray comma?)")
        if "=" in item:
            k, _, v = item.partition("=")
            k = k.strip().lower()
            if k in kv:
                raise KvcInputError(f"prune spec {spec!r}: {k} given twice")
            kv[k] = v
        else:
            if bare is not None:
                raise KvcInputError(f"prune spec {spec!r}: more than one bare budget")
            bare = item
    if method == "h2o":
        unknown = set(kv) - {"heavy", "recent", "window"}
        if unknown:
            raise KvcInputError(f"prune spec {spec!r}: unknown h2o option(s) {sorted(unknown)} (known: heavy, recent, window)")
        window: int | None = DEFAULT_WINDOW
        if "window" in kv:
            w = kv["window"].strip().lower()
            window = None if w == "all" else _int_opt(w, spec, "window", 1)
        if bare is not None:
            if "heavy" in kv or "recent" in kv:
                raise KvcInputError(f"prune spec {spec!r}: give either one budget or heavy=/recent=, not both")
            total = parse_amount(bare, spec, "budget")
            if total.is_count:
                heavy, recent = Amount(float(int(total.value) // 2), True), Amount(total.value - int(total.value) // 2, True)
            else:
                heavy = recent = Amount(total.value / 2.0, False)
            return H2OBudget(heavy, recent, window, total)
        if "heavy" not in kv and "recent" not in kv:
            raise KvcInputError(f"prune spec {spec!r}: no budget (e.g. 'h2o:0.25' or 'h2o:heavy=0.1,recent=0.1')")
        heavy = parse_amount(kv["heavy"], spec, "heavy", allow_zero=True) if "heavy" in kv else ZERO
        recent = parse_amount(kv["recent"], spec, "recent", allow_zero=True) if "recent" in kv else ZERO
        if heavy.value == 0 and recent.value == 0:
            raise KvcInputError(f"prune spec {spec!r}: heavy and recent are both 0, nothing would be kept")
        if not heavy.is_count and not recent.is_count and heavy.value + recent.value > 1 + 1e-9:
            raise KvcInputError(f"prune spec {spec!r}: heavy + recent = {heavy.value + recent.value:g} exceeds 1")
        return H2OBudget(heavy, recent, window)

    unknown = set(kv) - {"keep", "segment", "spread"}
    if unknown:
        raise KvcInputError(f"prune spec {spec!r}: unknown lingua option(s) {sorted(unknown)} (known: keep, segment, spread)")
    if bare is not None and "keep" in kv:
        raise KvcInputError(f"prune spec {spec!r}: keep given twice")
    keep_s = bare if bare is not None else kv.get("keep")
    if keep_s is None:
        raise KvcInputError(f"prune spec {spec!r}: no budget (e.g. 'lingua:0.5')")
    keep = parse_amount(keep_s, spec, "budget")
    segment = _int_opt(kv["segment"], spec, "segment", 8) if "segment" in kv else DEFAULT_SEGMENT
    spread = DEFAULT_SPREAD
    if "spread" in kv:
        sv = kv["spread"].strip()
        if not _NUM.match(sv) or not (0.0 <= float(sv) <= 1.0):
            raise KvcInputError(f"prune spec {spec!r}: spread must lie in [0, 1], got {sv!r}")
        spread = float(sv)
    return LinguaBudget(keep, segment, spread)
