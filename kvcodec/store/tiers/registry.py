"""Which tier a store URL opens: one table of URL schemes, each tier's module imported only when a URL uses it.

Every tier class declares the ``schemes`` it serves; :data:`TIERS` repeats them
so that finding the tier of a URL, listing the known schemes and writing the
"unsupported" message import nothing (redis-py, boto3 and the HTTP client load
only when a URL names their tier).  :func:`tier_class` checks that the class
it imports declares the scheme it was found under, and
``tests/store/test_tier_registry.py`` that the table and the classes agree.

A URL without ``scheme://`` is a directory path: it opens the ``file`` tier.

Adding a tier: a module in this package with a :class:`~kvcodec.store.tiers.base.Tier`
subclass declaring ``schemes`` and its capability flags, one line in
:data:`TIERS` (or :func:`register` from outside the package), and one subclass
of :class:`kvcodec.testing.store.TierTests` in ``tests/store/``.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from kvcodec.errors import KvcInputError
from kvcodec.store.options import TierDefaults
from kvcodec.store.tiers.base import Tier

PATH_SCHEME = "file"  # the scheme of a URL that has none (a plain directory path)


class TierEntry(NamedTuple):
    target: str                 # "package.module:Class"; ".module:Class" is a module of kvcodec.store.tiers
    schemes: tuple[str, ...]    # lower case, without "://"

    @property
    def class_name(self) -> str:
        return self.target.rpartition(":")[2]


TIERS: list[TierEntry] = [
    TierEntry(".base:MemoryTier", ("mem",)),  # the Store's in-process LRU: mem:// sets its size
    TierEntry(".directory:DirectoryTier", ("file",)),
    TierEntry(".redis:RedisTier", ("redis", "rediss", "unix")),
    TierEntry(".redis_cluster:RedisClusterTier", ("redis+cluster", "rediss+cluster")),
    TierEntry(".s3:S3Tier", ("s3",)),
    TierEntry(".kdn:KdnTier", ("kvc+http", "kvc+https")),
    TierEntry(".http:HttpTier", ("http", "https")),
]


def register(target: str, schemes: tuple[str, ...]) -> None:
    """Add a tier defined outside this package (``"package.module:Class"``) for ``schemes``.

    A scheme already in the table is refused: a URL names exactly one tier.
    """
    schemes = tuple(s.lower() for s in schemes)
    taken = sorted(set(schemes) & set(known_schemes()))
    if taken or not schemes or ":" not in target:
        raise KvcInputError(f"cannot register {target!r} for {schemes}: "
                            + (f"scheme(s) {taken} already taken" if taken else "give 'module:Class' and schemes"))
    TIERS.append(TierEntry(target, schemes))


def known_schemes() -> list[str]:
    """Every scheme a store URL may use, in table order."""
    return [s for e in TIERS for s in e.schemes]


def scheme_of(url: str) -> str:
    """The lower-case scheme of a store URL part (:data:`PATH_SCHEME` for a plain path)."""
    return url.split("://", 1)[0].lower() if "://" in url else PATH_SCHEME


def entry_for(scheme: str) -> TierEntry | None:
    for e in TIERS:
        if scheme in e.schemes:
            return e
    return None


def load(entry: TierEntry) -> type[Tier]:
    """Import the class of a table entry."""
    module, _, name = entry.target.rpartition(":")
    cls = getattr(importlib.import_module(module, __package__), name)
    if not (isinstance(cls, type) and issubclass(cls, Tier)):
        raise TypeError(f"{entry.target} is not a Tier subclass")
    return cls


def unsupported(url: str) -> KvcInputError:
    """The error for a URL part whose scheme no tier serves; lists every scheme in the table."""
    names = [f"{s}://" for s in known_schemes()]
    return KvcInputError(f"unsupported store tier {ascii(url)}: use a directory path, "
                         + ", ".join(names[:-1]) + f" or {names[-1]}")


def tier_class(url: str) -> type[Tier]:
    """The tier class that serves ``url`` (a store URL part); ``KvcInputError`` for an unknown scheme."""
    scheme = scheme_of(url)
    entry = entry_for(scheme)
    if entry is None:
        raise unsupported(url)
    cls = load(entry)
    if scheme not in cls.schemes:
        raise TypeError(f"{entry.target} is registered for {scheme}:// but declares schemes {cls.schemes}")
    return cls


def open_tier(url: str, defaults: TierDefaults | None = None) -> Tier:
    """The tier one part of a store URL names, opened (``defaults``: Store.open's keywords)."""
    return tier_class(url).from_url(url, defaults if defaults is not None else TierDefaults())


def tier_by_name(name: str) -> type[Tier] | None:
    """The tier class called ``name`` (``"RedisTier"``), imported; None if the table has none."""
    for e in TIERS:
        if e.class_name == name:
            return load(e)
    return None
