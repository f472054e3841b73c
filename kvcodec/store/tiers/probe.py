"""``contains`` of a remote tier (Redis, S3) as ``get`` would answer it, from the head of the value only.

Why: those tiers answered ``contains`` from the name alone, so a truncated value, or one with a damaged head or
another key's envelope, was reported present while every get missed: ``longest_prefix`` chose it over an intact
shorter prefix, and ``PUT If-None-Match: *`` refused to replace it. Why the head only (the fixed part, the size it
announces against the value's, and the header naming the key), as the directory tier's ``contains``: a
``/v1/contains`` names up to 4,096 keys, and a probe must not read 4,096 whole entries; damage inside a payload is
found by the first get, which drops the value, and ``contains`` says False from then on. A probe never deletes.
"""

from __future__ import annotations

from typing import Callable

from kvcodec.errors import KvcFormatError
from kvcodec.store.keys import StoreKey
from kvcodec.store.tiers.localfs import check_head

PROBE_READ = 4096  # bytes of a value a probe reads first: the fixed part and (nearly always) the whole header
PROBE_BATCH = 256  # keys probed in one pipelined round (at most PROBE_READ each)


class _Head:
    """A forward reader over ``head``, then ``more(offset, n)`` for what lies past it (a long header)."""

    def __init__(self, head: bytes, more: Callable[[int, int], bytes]) -> None:
        self.head, self.more, self.pos = head, more, 0

    def read(self, n: int) -> bytes:
        out = self.head[self.pos:self.pos + n]
        self.pos += len(out)
        if len(out) < n:
            rest = self.more(self.pos, n - len(out))
            self.pos += len(rest)
            out += rest
        return out


def head_names_key(head: bytes, size: int, key: StoreKey, limit: int, what: str,
                   more: Callable[[int, int], bytes]) -> bool:
    """Whether a value of ``size`` bytes starting with ``head`` is an entry of ``key`` that get would take as far
    as its head tells: False for no value (``size`` 0), one over the tier's ``limit`` (get refuses it unread),
    a damaged head, or another key's envelope. ``more(offset, n)``: the value's bytes past ``head`` (may raise
    :class:`~kvcodec.errors.KvcStoreError`)."""
    if size <= 0 or size > limit:
        return False
    try:
        return check_head(_Head(head, more), size, what) == key  # type: ignore[arg-type]  # reads only
    except KvcFormatError:
        return False
