"""Multi-level entries: one document's chunks at several codec presets, under one logical key.

Normative text: ``spec/levels-v1.md``.  A streaming client picks, chunk by
chunk, how much quality the network and its time-to-first-token budget can
afford (CacheGen's adaptation), so the store must hold every chunk at more
than one level and say which levels exist without the client probing for
them.  The design reuses the store as it is:

* the **manifest** is an ordinary entry under the document's logical key
  ``K`` (codec field ``levels-v1``): canonical JSON listing the levels (in
  ascending quality), the chunk boundaries and each chunk's size per level;
* each **level chunk** (a `.kvc` of one chunk's tokens at one preset, holding
  the prefix's token ids and the chunk's positions) is an ordinary entry under
  the standard prefix key of the tokens up to the chunk's end, with codec
  ``levels-v1.<level>``.

Both go through :meth:`Store.put`, so every level chunk is sealed and named by
the tenant key exactly like any other entry (tenant isolation, tamper
evidence and per-partition caps hold for every level), and any tier that
stores entries stores multi-level entries.  This module is pure: no codec,
no model (those live in :mod:`kvcodec.runtime.stream`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvcodec.errors import KvcFormatError, KvcInputError, json_loads
from kvcodec.store.keys import DEFAULT_CHUNK, StoreKey, chunk_hashes

LEVELS_CODEC = "levels-v1"
MANIFEST_FORMAT = "kvcodec-levels"
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 1 << 20
MAX_CHUNKS = 4096
# Ascending quality; a manifest lists its levels in this order (spec/levels-v1.md §3).
LEVEL_RANK = ("small", "balanced", "faithful", "near-lossless", "fp16", "lossless")


def parse_levels(spec: str | list[str] | tuple[str, ...]) -> list[str]:
    """Level names from ``"small,balanced"`` (or a list), checked and sorted into ascending quality."""
    names = [s.strip() for s in spec.split(",")] if isinstance(spec, str) else [str(s).strip() for s in spec]
    names = [n for n in names if n]
    if not names:
        raise KvcInputError("give at least one level (e.g. --levels small,balanced,near-lossless)")
    bad = [n for n in names if n not in LEVEL_RANK]
    if bad:
        raise KvcInputError(f"unknown level(s) {bad}: levels are presets among {', '.join(LEVEL_RANK)}")
    if len(set(names)) != len(names):
        raise KvcInputError(f"a level is named twice in {names}")
    return sorted(names, key=LEVEL_RANK.index)


def manifest_key(token_ids: Any, *, model: str, namespace: str = "default") -> StoreKey:
    """The logical key ``K`` of a document's multi-level entry (its manifest)."""
    return StoreKey.for_tokens(token_ids, model=model, codec=LEVELS_CODEC, namespace=namespace)


def level_codec(level: str) -> str:
    """The codec field of a level chunk's key: ``levels-v1.<level>``."""
    if level not in LEVEL_RANK:
        raise KvcInputError(f"unknown level {level!r}")
    return f"{LEVELS_CODEC}.{level}"


def level_keys(token_ids: Any, level: str, ends: list[int], *, model: str, namespace: str = "default") -> list[StoreKey]:
    """Keys of the level chunks ending at ``ends``: the ordinary chained key of ``token_ids[:end]``.

    A chunk's KV depends only on the tokens up to its end (causal model), so
    its key is the standard prefix key (spec/store-keys.md §2, 256-token
    chain) under the codec ``levels-v1.<level>``: two documents sharing a
    prefix share its level chunks, every chunk's ``.kvc`` holds token ids that
    hash to its key (so the KDN service verifies it like any entry), and the
    key binds model, level, namespace and tenant like every other key.
    Every end must be a multiple of 256 or the last token.
    """
    codec = level_codec(level)
    hs = chunk_hashes(token_ids, DEFAULT_CHUNK, model=model, codec=codec, namespace=namespace)
    n = len(hs) and int(np.asarray(token_ids).size)
    out = []
    for e in ends:
        if not (0 < e <= n) or (e % DEFAULT_CHUNK and e != n):
            raise KvcInputError(f"a level chunk cannot end at token {e} of {n} (multiples of {DEFAULT_CHUNK} or the end)")
        out.append(StoreKey(model, codec, namespace, e, hs[-(-e // DEFAULT_CHUNK) - 1].hex()))
    return out


@dataclass(frozen=True)
class ChunkLevels:
    """One chunk: tokens ``[start, end)`` and its payload size at each level."""

    start: int
    end: int
    bytes: dict[str, int]

    @property
    def n_tokens(self) -> int:
        return self.end - self.start


@dataclass
class LevelManifest:
    """What a multi-level entry holds (spec/levels-v1.md §3)."""

    key: StoreKey
    chunk_tokens: int
    levels: list[str]
    chunks: list[ChunkLevels] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def n_tokens(self) -> int:
        return self.key.n_tokens

    def level_keys(self, token_ids: Any, level: str) -> list[StoreKey]:
        """The key of every chunk at ``level`` (``token_ids``: the entry's tokens)."""
        if level not in self.levels:
            raise KvcInputError(f"level {level!r} is not in this entry (has {', '.join(self.levels)})")
        return level_keys(token_ids, level, [c.end for c in self.chunks], model=self.key.model,
                          namespace=self.key.namespace)

    def validate(self) -> None:
        k = self.key
        if k.codec != LEVELS_CODEC:
            raise KvcFormatError(f"manifest key {k} is not a multi-level key")
        if not isinstance(self.chunk_tokens, int) or isinstance(self.chunk_tokens, bool) or \
                not 1 <= self.chunk_tokens // DEFAULT_CHUNK <= 256 or self.chunk_tokens % DEFAULT_CHUNK:
            raise KvcFormatError(f"manifest chunk_tokens {self.chunk_tokens!r} is not a multiple of {DEFAULT_CHUNK} "
                                 f"in [{DEFAULT_CHUNK}, {256 * DEFAULT_CHUNK}]")
        try:
            ordered = parse_levels(list(self.levels))
        except KvcInputError as e:
            raise KvcFormatError(f"manifest levels: {e}") from None
        if ordered != list(self.levels):
            raise KvcFormatError(f"manifest levels {self.levels!r} are not in ascending quality {LEVEL_RANK}")
        want = -(-k.n_tokens // self.chunk_tokens)
        if len(self.chunks) != want or want > MAX_CHUNKS:
            raise KvcFormatError(f"manifest has {len(self.chunks)} chunks, {k.n_tokens} tokens in chunks of "
                                 f"{self.chunk_tokens} need {want} (at most {MAX_CHUNKS})")
        for i, c in enumerate(self.chunks):
            if (c.start, c.end) != (i * self.chunk_tokens, min((i + 1) * self.chunk_tokens, k.n_tokens)):
                raise KvcFormatError(f"manifest chunk {i} covers [{c.start}, {c.end}), not the chunk grid")
            if sorted(c.bytes) != sorted(self.levels):
                raise KvcFormatError(f"manifest chunk {i} has levels {sorted(c.bytes)}, manifest lists {self.levels}")
            for lv, n in c.bytes.items():
                if not isinstance(n, int) or isinstance(n, bool) or not 0 < n < 1 << 40:
                    raise KvcFormatError(f"manifest chunk {i} level {lv}: size {n!r} is not a positive integer")

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no spaces, ASCII): the manifest entry's payload."""
        body = {
            "format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "key": self.key.to_str(),
            "chunk_tokens": self.chunk_tokens, "levels": list(self.levels),
            "chunks": [{"start": c.start, "end": c.end, "bytes": {lv: c.bytes[lv] for lv in self.levels}}
                       for c in self.chunks],
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")

    @classmethod
    def from_bytes(cls, data: bytes, key: StoreKey) -> "LevelManifest":
        """Parse and validate a manifest read under ``key`` (it must name that key)."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise KvcFormatError(f"multi-level manifest of {key} is {len(data)} bytes (limit {MAX_MANIFEST_BYTES})")
        try:
            obj = json_loads(bytes(data).decode("ascii"))
        except (UnicodeDecodeError, ValueError) as e:
            raise KvcFormatError(f"multi-level manifest of {key} is not ASCII JSON: {e}") from None
        want = {"format", "version", "key", "chunk_tokens", "levels", "chunks"}
        if not isinstance(obj, dict) or set(obj) != want:
            raise KvcFormatError(f"multi-level manifest of {key} must have exactly the fields {sorted(want)}")
        if obj["format"] != MANIFEST_FORMAT or obj["version"] != MANIFEST_VERSION:
            raise KvcFormatError(f"multi-level manifest of {key}: unsupported format {obj['format']!r} v{obj['version']!r}")
        if obj["key"] != key.to_str():
            raise KvcFormatError(f"multi-level manifest read under {key} names {str(obj['key'])[:200]!r}")
        if not isinstance(obj["levels"], list) or not all(isinstance(x, str) for x in obj["levels"]) or \
                not isinstance(obj["chunks"], list) or len(obj["chunks"]) > MAX_CHUNKS:
            raise KvcFormatError(f"multi-level manifest of {key}: malformed levels or chunks")
        chunks = []
        for c in obj["chunks"]:
            if not isinstance(c, dict) or set(c) != {"start", "end", "bytes"} or not isinstance(c["bytes"], dict) or \
                    not all(isinstance(c[f], int) and not isinstance(c[f], bool) for f in ("start", "end")):
                raise KvcFormatError(f"multi-level manifest of {key}: malformed chunk {str(c)[:200]}")
            chunks.append(ChunkLevels(c["start"], c["end"], dict(c["bytes"])))
        try:
            m = cls(key, obj["chunk_tokens"], list(obj["levels"]), chunks)
        except KvcInputError as e:
            raise KvcFormatError(f"multi-level manifest of {key}: {e}") from None
        if m.to_bytes() != bytes(data):
            raise KvcFormatError(f"multi-level manifest of {key} is not in canonical form")
        return m


def level_meta(level: str, start: int, end: int) -> dict[str, Any]:
    """The user metadata sealed with a level chunk (informational: ``kvc store ls`` shows it)."""
    return {"level": level, "start": start, "end": end}
