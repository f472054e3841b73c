"""Byte-level KV-cache store: deterministic keys, tiers (LRU, directory, Redis, Redis Cluster, S3, HTTP, KDN).

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

Only ``keys``, ``ranged``, ``tenant``, ``store`` and the tier base and registry are imported
eagerly; every tier class (``DirectoryTier``, ``RedisTier``, ``RedisClusterTier``, ``S3Tier``,
``HttpTier``, ``KdnTier``) is exported lazily, and redis-py or boto3 load only when their tier is
opened.  Which URL scheme opens which tier: :mod:`kvcodec.store.tiers.registry`.
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
from kvcodec.store.tiers.registry import tier_by_name

__all__ = [
    "DEFAULT_CHUNK", "StoreKey", "chunk_hashes", "prefix_keys", "root_digest",
    "token_bytes", "RangeReader", "FileRangeReader", "HttpRangeReader", "BytesRangeReader",
    "open_range_reader", "HttpLimits", "TenantKey", "Store", "PutResult", "parse_size", "Entry", "EntryInfo",
    "Tier", "MemoryTier", "DirectoryTier", "RedisTier", "RedisClusterTier", "S3Tier", "HttpTier", "KdnTier",
]


def __getattr__(name: str) -> type[Tier]:
    """The tier classes, imported on first use (each one named in the registry's table)."""
    cls = tier_by_name(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
