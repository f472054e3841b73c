"""Byte-level KV-cache store: deterministic keys, tiers (LRU, directory, Redis, HTTP).

Entries are opaque bytes (typically a ``.kvc`` file) plus a small JSON
metadata dict.  Typical use::

    from kvcodec.store import Store, StoreKey

    key = StoreKey.for_tokens(ids, model=fp_id, codec=codec_hash, namespace="tenant-a")
    with Store.open("/var/cache/kvc,redis://127.0.0.1:6379/0") as st:
        st.put(key, kvc_bytes, {"n_layers": 30})
        data = st.get(key)                       # bytes or None
        key2, n = st.longest_prefix(ids2, model=fp_id, codec=codec_hash, namespace="tenant-a")

A Store acts for one tenant: ``Store.open(url, key=TenantKey.load(path))``;
the default key is ``$KVC_STORE_KEY``, ``$KVC_STORE_KEY_FILE`` or the
per-user ``~/.config/kvcodec/store.key`` (spec/store-keys.md §8).

Only ``keys``, ``ranged``, ``tenant`` and ``store`` are imported eagerly; redis-py loads only
when a Redis tier is opened.
"""

from kvcodec.store.keys import (
    DEFAULT_CHUNK,
    StoreKey,
    chunk_hashes,
    prefix_keys,
    root_digest,
    token_bytes,
)
from kvcodec.store.ranged import BytesRangeReader, FileRangeReader, HttpLimits, HttpRangeReader, RangeReader, open_range_reader
from kvcodec.store.options import parse_size
from kvcodec.store.store import PutResult, Store
from kvcodec.store.tenant import TenantKey
from kvcodec.store.tiers.base import Entry, EntryInfo, MemoryTier, Tier

__all__ = [
    "DEFAULT_CHUNK", "StoreKey", "chunk_hashes", "prefix_keys", "root_digest",
    "token_bytes", "RangeReader", "FileRangeReader", "HttpRangeReader", "BytesRangeReader",
    "open_range_reader", "HttpLimits", "TenantKey", "Store", "PutResult", "parse_size", "Entry", "EntryInfo",
    "MemoryTier", "Tier", "DirectoryTier", "RedisTier", "HttpTier",
]


def __getattr__(name: str):  # lazy tier classes
    if name == "DirectoryTier":
        from kvcodec.store.tiers.directory import DirectoryTier
        return DirectoryTier
    if name == "RedisTier":
        from kvcodec.store.tiers.redis import RedisTier
        return RedisTier
    if name == "HttpTier":
        from kvcodec.store.tiers.http import HttpTier
        return HttpTier
    raise AttributeError(name)
