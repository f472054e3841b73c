"""Option values of store URLs (``?max_bytes=512M&fsync=0``), shared by the store and every tier."""

from __future__ import annotations

import re

from kvcodec.errors import KvcInputError

_SIZE_RE = re.compile(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([kmgt]?)(i?b?)\s*", re.I | re.ASCII)


def parse_size(s: str | int) -> int:
    """``"512M"``, ``"10GiB"``, ``"1.5g"``, ``"1000"`` -> bytes (binary multiples)."""
    if isinstance(s, int) and not isinstance(s, bool):
        if s < 0:
            raise KvcInputError(f"bad size {s}: must be >= 0")
        return s
    m = _SIZE_RE.fullmatch(str(s))
    if not m:
        raise KvcInputError(f"bad size {ascii(str(s)[:40])}: use e.g. 1000, 512M, 10G (ASCII digits)")
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def parse_flag(v: str) -> bool:
    """A boolean URL option: 1/true/yes/on or 0/false/no/off."""
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise KvcInputError(f"bad boolean option {v!r}")
