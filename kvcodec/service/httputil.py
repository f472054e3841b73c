"""HTTP helpers of the KDN service with no state of their own: JSON answers, byte ranges, the HTTP layer's log.

Why a module of its own: these are pure functions of a request's headers (RFC 9110 ranges) and small adapters to
aiohttp, used by the routes (:mod:`kvcodec.service.app`) and the admission layer
(:mod:`kvcodec.service.admission`); they know nothing of tenants, limits or the store.
"""

from __future__ import annotations

import json
import logging
import re
import time
from typing import Any

from aiohttp import web

from kvcodec.service.checks import error_line

log = logging.getLogger("kvcodec.service")

__all__ = ["LogLimiter", "HttpLayerLog", "json_reply", "parse_range", "redact_credentials", "resolve_range"]

# where a credential starts in a text quoting request bytes: the header's name, or an auth scheme's name
_CREDENTIAL = re.compile(r"(?i)authorization|bearer|basic")


def redact_credentials(text: str) -> str:
    """``text`` cut where a credential could start (``Authorization``, ``Bearer``, ``Basic``), the rest redacted.

    Why: aiohttp's parser errors quote the request's own bytes (a bad request line quotes the whole head, a bad or
    overlong header its line), so a client that ended its lines with a bare LF, or sent one byte its parser
    refuses in the Authorization header, had its bearer token written to the server's log and echoed in the
    answer. Everything after the name is dropped, not only the token: the quote may escape the token's end
    (``\\n``) or hold the rest of the head, and a log line needs none of it."""
    m = _CREDENTIAL.search(text)
    return text if m is None else text[:m.end()] + " <redacted>"


class LogLimiter:
    """One log line per bad request, at most ``rate`` a second; the lines dropped are counted in the next one."""

    def __init__(self, rate: float, burst: float = 20.0) -> None:
        self.rate, self.burst = rate, max(burst, rate)
        self._tokens = self.burst
        self._at = time.monotonic()
        self.suppressed = 0

    def line(self, level: int, msg: str) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self.rate <= 0 or self._tokens < 1:
            self.suppressed += 1
            return False
        self._tokens -= 1
        if self.suppressed:
            msg += f" ({self.suppressed} more bad requests not logged)"
            self.suppressed = 0
        log.log(level, "%s", msg)
        return True


class HttpLayerLog:
    """The logger aiohttp's connection handler writes to: malformed HTTP (bad request line, headers or framing,
    refused before any route or middleware) becomes one rate-limited line, never a traceback."""

    def __init__(self, limiter: LogLimiter) -> None:
        self.limiter = limiter

    def _line(self, level: int, msg: str, *args: Any, exc_info: Any = None, **_: Any) -> None:
        try:
            text = msg % args if args else str(msg)
        except (TypeError, ValueError):
            text = str(msg)
        if isinstance(exc_info, BaseException):
            text += f": {error_line(exc_info)}"
        self.limiter.line(level, f"kdn: {redact_credentials(text)[:400]}")

    def exception(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def error(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        self._line(logging.WARNING, msg, *args, **kw)

    def info(self, msg: str, *args: Any, **kw: Any) -> None:
        pass

    def debug(self, msg: str, *args: Any, **kw: Any) -> None:
        pass


def json_reply(obj: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON answer (keys sorted, so equal answers are equal bytes)."""
    return web.Response(status=status, text=json.dumps(obj, sort_keys=True), content_type="application/json",
                        headers=headers)


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """A ``Range`` header against an entry of ``size`` bytes (RFC 9110 §14): ``(first, stop)`` to serve,
    ``"unsatisfiable"`` (416), or ``None`` (ignore it and send the whole entry: several ranges, another unit,
    a malformed or reversed range)."""
    unit, eq, spec = header.strip().partition("=")
    if not eq or unit.strip().lower() != "bytes" or "," in spec:
        return None
    a, dash, b = spec.strip().partition("-")
    if not dash or not (a.isascii() and b.isascii()) or (a and not a.isdigit()) or (b and not b.isdigit()) or not (a or b):
        return None
    big = 1 << 63  # digits beyond 19 are larger than any entry: no int() of an attacker's 4000-digit number

    def num(s: str) -> int:
        return big if len(s) > 19 else int(s)

    if not a:  # suffix: the last n bytes
        n = num(b)
        if n == 0 or size == 0:
            return "unsatisfiable"
        return max(0, size - n), size
    first = num(a)
    last = num(b) if b else None
    if last is not None and last < first:
        return None
    if first >= size:
        return "unsatisfiable"
    return first, size if last is None else min(last + 1, size)


def resolve_range(sl: slice, size: int) -> tuple[int | None, int]:
    """``(first, stop)`` of a single byte range slice (aiohttp's form) against ``size`` bytes (first None: unsatisfiable)."""
    start, stop = sl.start, sl.stop
    if start is None or start < 0:  # suffix range bytes=-n
        n = -start if start is not None else 0
        if n <= 0 or size == 0:
            return None, 0
        return max(0, size - n), size
    if start >= size:
        return None, 0
    return start, size if stop is None else min(stop, size)
