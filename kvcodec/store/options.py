"""Option values of store URLs (``?max_bytes=512M&fsync=0``), shared by the store and every tier."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult, urlsplit, urlunsplit

from kvcodec.errors import KvcInputError

_SIZE_RE = re.compile(r"\s*([0-9]{1,15}(?:\.[0-9]{1,6})?)\s*([kmgt]?)(i?b?)\s*", re.I | re.ASCII)

DEFAULT_MEMORY_BYTES = 256 << 20  # the in-process LRU in front of every Store


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


def parse_number(text: Any, what: str, positive: bool = False, integer: bool = False) -> float:
    """A finite number written in ASCII digits, as a URL option gives it (``float`` alone accepts Arabic-Indic
    digits, nan, inf and -1: an S3 or KDN ``timeout=nan`` opened a store whose every call then failed).
    Raises ``ValueError``, which each tier words as its own bad-option line."""
    pat = r"[0-9]{1,12}" if integer else r"[0-9]{1,12}(\.[0-9]{1,9})?"
    if not re.fullmatch(pat, str(text).strip()):
        raise ValueError(f"{what}={ascii(str(text)[:40])} is not a {'whole ' if integer else ''}number "
                         "in ASCII digits")
    v = float(text)
    if positive and v <= 0:
        raise ValueError(f"{what} must be > 0")
    return v


def url_port(p: SplitResult, what: str) -> int | None:
    """The port a parsed store URL names (None: the scheme's default), refused in one line when malformed, out
    of range or 0. Why 0 too: no server listens on port 0, and each tier read it its own way (``kvc+http://h:0``
    connected to port 80, ``redis+cluster://h:0`` to 6379, ``http://h:0`` opened and then missed every read)."""
    try:
        port = p.port
    except ValueError as e:
        raise KvcInputError(f"bad port in {what} URL: {e}") from None
    if port == 0:
        raise KvcInputError(f"{what} URL names port 0, where no server listens: give the server's port or none")
    return port


def parse_port(text: str, what: str) -> int:
    """A port written as 1 to 65535 in ASCII digits (``int`` alone took ``"\u0663"`` as 3, and 0 or 99999)."""
    if not re.fullmatch(r"[0-9]{1,5}", text) or not 0 < int(text) < 65536:
        raise KvcInputError(f"bad port {ascii(text[:20])} in {what}: a number from 1 to 65535")
    return int(text)


def parse_flag(v: str) -> bool:
    """A boolean URL option: 1/true/yes/on or 0/false/no/off."""
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise KvcInputError(f"bad boolean option {v!r}")


def redact(url: str) -> str:
    """The URL with any password replaced by ``***``."""
    p = urlsplit(url)
    if p.password is None:
        return url
    user = p.username or ""
    host = p.hostname or ""
    if p.port:
        host = f"{host}:{p.port}"
    return urlunsplit((p.scheme, f"{user}:***@{host}", p.path, p.query, p.fragment))


@dataclass
class TierDefaults:
    """``Store.open``'s keywords: values for the options a tier's URL does not set itself.

    ``memory_bytes`` sizes the in-process LRU (``mem://`` without ``max_bytes``);
    ``fsync`` and ``max_bytes`` apply to directory tiers.
    """

    memory_bytes: int = DEFAULT_MEMORY_BYTES
    fsync: bool | None = None
    max_bytes: int | str | None = None
