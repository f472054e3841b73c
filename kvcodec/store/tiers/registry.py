"""Which tier a store URL opens: the tier group of the one plugin registry, each tier's module imported only when a URL uses it.

A name in the group is a URL scheme (lower case, without ``://``) and its target a
:class:`~kvcodec.store.tiers.base.Tier` subclass that declares that scheme. kvcodec's own tiers are
declared in :mod:`kvcodec.plugins`; an installed package adds one through its ``kvcodec.tiers``
entry points (one per scheme), code through :func:`register`. So finding the tier of a URL,
listing the known schemes and writing the "unsupported" message import nothing (redis-py, boto3
and the HTTP client load only when a URL names their tier), and ``tests/store/test_tier_registry.py``
checks that the declarations and the classes agree.

A URL without ``scheme://`` is a directory path: it opens the ``file`` tier.

Adding a tier: docs/extending.md (a Tier subclass declaring ``schemes`` and its capability flags,
its schemes declared, and one subclass of :class:`kvcodec.testing.store.TierTests` in ``tests/store/``).
"""

from __future__ import annotations

from typing import Any

from kvcodec.errors import KvcInputError
from kvcodec.registry import TIERS_GROUP, Registry
from kvcodec.store.options import TierDefaults
from kvcodec.store.tiers.base import Tier

PATH_SCHEME = "file"  # the scheme of a URL that has none (a plain directory path)


def _check_tier(scheme: str, obj: Any, builtin: bool) -> str | None:
    """What the tier group holds: a Tier subclass that declares the scheme it is found under."""
    if not (isinstance(obj, type) and issubclass(obj, Tier)):
        return f"is a {type(obj).__name__}, not a kvcodec.store.tiers.base.Tier subclass"
    if scheme not in obj.schemes:
        return f"is registered for {scheme}:// but declares schemes {obj.schemes}"
    return None


TIERS: Registry[type[Tier]] = Registry(TIERS_GROUP, "store tier", KvcInputError, _check_tier)


def register(target: str | type[Tier], schemes: tuple[str, ...]) -> None:
    """Add a tier from code (``"package.module:Class"`` or the class) for ``schemes``; an installed package
    declares ``kvcodec.tiers`` entry points instead (docs/extending.md).

    A scheme already declared is refused: a URL names exactly one tier."""
    schemes = tuple(s.lower() for s in schemes)
    taken = [s for s in schemes if s in TIERS.names(entry_points=False)]
    if taken or not schemes or (isinstance(target, str) and ":" not in target):
        raise KvcInputError(f"cannot register {target!r} for {schemes}: "
                            + (f"scheme(s) {taken} already taken" if taken else "give 'module:Class' and schemes"))
    for s in schemes:
        TIERS.register(s, target)


def known_schemes() -> list[str]:
    """Every scheme a store URL may use: kvcodec's in declaration order, then the others."""
    return TIERS.names()


def scheme_of(url: str) -> str:
    """The lower-case scheme of a store URL part (:data:`PATH_SCHEME` for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else PATH_SCHEME


def unsupported(url: str) -> KvcInputError:
    """The error for a URL part whose scheme no tier serves; lists every known scheme."""
    names = [f"{s}://" for s in known_schemes()]
    return KvcInputError(f"unsupported store tier {ascii(url)}: use a directory path, "
                         + ", ".join(names[:-1]) + f" or {names[-1]}")


def tier_class(url: str) -> type[Tier]:
    """The tier class that serves ``url`` (a store URL part); ``KvcInputError`` for an unknown scheme or a broken plugin."""
    scheme = scheme_of(url)
    if not TIERS.has(scheme):
        raise unsupported(url)
    return TIERS.get(scheme)


def open_tier(url: str, defaults: TierDefaults | None = None) -> Tier:
    """The tier one part of a store URL names, opened (``defaults``: Store.open's keywords)."""
    return tier_class(url).from_url(url, defaults if defaults is not None else TierDefaults())


def tier_by_name(name: str) -> type[Tier] | None:
    """kvcodec's tier class called ``name`` (``"RedisTier"``), imported; None if it has none (the lazy exports
    of :mod:`kvcodec.store`: entry points are not read for an attribute lookup)."""
    for s in TIERS.builtin_names():
        if TIERS.target(s).rpartition(":")[2] == name:
            return TIERS.get(s)
    return None
