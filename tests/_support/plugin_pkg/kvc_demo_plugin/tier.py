"""``demo://``: a store tier over one dict in this process (a stand-in for a real backend)."""

from __future__ import annotations

from typing import Any, Iterator, Mapping

from kvcodec.store import EntryInfo, StoreKey
from kvcodec.store.tiers.base import MAX_TIER_META, Entry, Tier, as_bytes, check_meta

SHELF: dict[StoreKey, Entry] = {}


class DemoTier(Tier):
    kind = "demo"
    schemes = ("demo",)

    def __init__(self, url: str) -> None:
        super().__init__("demo", url)

    def get_entry(self, key: StoreKey) -> Entry | None:
        e = SHELF.get(key)
        self.counters.add(**({"hits": 1} if e else {"misses": 1}))
        return e

    def put(self, key: StoreKey, data: bytes, meta: Mapping[str, Any] | None = None, created: float | None = None) -> None:
        SHELF[key] = Entry(key, as_bytes(data), check_meta(meta, MAX_TIER_META), created)

    def contains(self, key: StoreKey) -> bool:
        return key in SHELF

    def delete(self, key: StoreKey) -> bool:
        return SHELF.pop(key, None) is not None

    def ls(self, with_meta: bool = False) -> Iterator[EntryInfo]:
        for k, e in list(SHELF.items()):
            yield EntryInfo(k, len(e.data), self.name, dict(e.meta) if with_meta else None)
