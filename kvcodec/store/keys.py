"""Deterministic store keys for cached KV prefixes.

A cached entry is addressed by :class:`StoreKey` = (model fingerprint id,
codec config hash, namespace, number of tokens, chained prefix digest).
Everything is computed with BLAKE2b from fixed-width little-endian bytes, so
the same token ids give the same key in every process, on every machine and
under every ``PYTHONHASHSEED`` (Python's salted ``hash`` is never used).

Chaining (``spec/store-keys.md`` has the normative text and a worked example)::

    h_0 = BLAKE2b-256( "kvcodec.store.key.v1\\0"
                       || u32le(len(model))     || model
                       || u32le(len(codec))     || codec
                       || u32le(len(namespace)) || namespace )
    h_i = BLAKE2b-256( h_{i-1} || u32le(n_i) || int32le(ids of chunk i) )

Chunk ``i`` holds tokens ``[(i-1)*chunk, min(i*chunk, N))``, so every chunk
has ``chunk`` tokens except possibly the last one.  ``n_i`` (the chunk's token
count) is hashed, so a partial last chunk can never collide with a full one.
Because ``h_0`` binds model, codec and namespace, two different models,
codec configurations or tenants never share a digest, even for equal tokens.

An entry covers the prefix ending at a chunk boundary: ``k*chunk`` tokens, or
the whole token list (``N`` tokens, whose last chunk may be partial).
:func:`prefix_keys` lists exactly these candidates.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any, Mapping

from kvcodec.errors import KvcInputError, is_int

KEY_VERSION = 1
DEFAULT_CHUNK = 256
DOMAIN = b"kvcodec.store.key.v1\x00"
DIGEST_SIZE = 32  # bytes; 64 hex characters

# Identifiers that appear in key strings, file listings and Redis key names.
# ``fullmatch`` (not ``match`` with ``$``, which accepts a trailing newline) and
# explicit ASCII classes: ``str.isdigit``/``\d`` accept Arabic-Indic digits
# and superscripts, which ``int`` then either converts silently or rejects
# with a bare ValueError.
_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}")
_HEX_RE = re.compile(r"[0-9a-f]{64}")
_COUNT_RE = re.compile(r"(0|[1-9][0-9]{0,17})")  # < 10**18: far beyond any context, far below int limits
MAX_KEY_STR = 512


def check_id(what: str, value: str) -> str:
    if not isinstance(value, str) or not _ID_RE.fullmatch(value):
        shown = ascii(value[:80]) if isinstance(value, str) else type(value).__name__
        raise KvcInputError(
            f"store key {what} {shown} is invalid: use 1-128 characters from "
            "[A-Za-z0-9._+=-], starting with a letter or digit"
        )
    return value


def codec_key(preset: str, options: Mapping[str, Any] | None = None) -> str:
    """The ``codec`` field of a store key (spec/store-keys.md §1): the ONE derivation, used by ``kvc ask``,
    ``kvc store put``, the KDN service's clients and the vLLM connector alike, so one encoding of one
    context is one entry whoever wrote it.

    16 hex digits of sha256 over the canonical JSON ``{"options": options or {}, "preset": preset}``:
    ``preset`` names the codec configuration and ``options`` are its overrides. (Multi-level entries use
    the reserved codecs of spec/levels-v1.md, which no digest can equal.)
    """
    if not isinstance(preset, str) or not preset:
        raise KvcInputError(f"codec preset must be a non-empty string, got {preset!r}")
    blob = json.dumps({"preset": preset, "options": dict(options or {})}, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<I", len(b)) + b


def root_digest(model: str, codec: str, namespace: str) -> bytes:
    """``h_0``: the domain-separated seed of the chain (32 bytes)."""
    check_id("model", model)
    check_id("codec", codec)
    check_id("namespace", namespace)
    return hashlib.blake2b(
        DOMAIN + _lp(model) + _lp(codec) + _lp(namespace), digest_size=DIGEST_SIZE
    ).digest()


def _kind(token_ids: Any) -> str:
    if isinstance(token_ids, (list, tuple)) and any(isinstance(x, bool) for x in token_ids):
        return f"a {type(token_ids).__name__} holding booleans"
    return f"a {type(token_ids).__name__}"


def token_bytes(token_ids: Any) -> bytes:
    """Token ids as contiguous little-endian int32 bytes (validated).

    Accepts a sequence of ints, a numpy array or anything with ``__array__``
    (e.g. a CPU torch tensor).  Ids must be integers in ``[0, 2**31)``.
    """
    if hasattr(token_ids, "__array__") and not isinstance(token_ids, (list, tuple)):
        import numpy as np

        a = np.asarray(token_ids)
        if a.ndim != 1:
            a = a.reshape(-1) if a.ndim == 2 and a.shape[0] == 1 else a
        if a.ndim != 1:
            raise KvcInputError(f"token ids must be one-dimensional, got shape {a.shape}")
        if a.size and a.dtype.kind not in "iu":
            raise KvcInputError(f"token ids must be integers, got dtype {a.dtype}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= 2**31):
            raise KvcInputError("token ids must lie in [0, 2**31)")
        return a.astype("<i4", copy=False).tobytes()
    # a list, tuple or range only, and no bools: array() takes any iterable, so a dict was keyed by its keys, a set in
    # its arbitrary order, [True, False] as [1, 0], and an iterator was consumed here before the key counted it (TypeError)
    if not isinstance(token_ids, (list, tuple, range)) or any(isinstance(x, bool) for x in token_ids):
        raise KvcInputError(f"token ids must be a list, tuple or array of integers, got {_kind(token_ids)}")
    try:
        arr = array("i", token_ids)
    except (TypeError, OverflowError) as e:
        raise KvcInputError(f"token ids must be integers in [0, 2**31): {e}") from None
    if arr.itemsize != 4:  # pragma: no cover - exotic platforms
        raise KvcInputError("platform C int is not 32-bit")
    if len(arr) and min(arr) < 0:
        raise KvcInputError("token ids must lie in [0, 2**31)")
    if sys.byteorder != "little":  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def chunk_hashes(
    token_ids: Any,
    chunk: int = DEFAULT_CHUNK,
    *,
    model: str = "any",
    codec: str = "any",
    namespace: str = "default",
) -> list[bytes]:
    """Chained digests ``[h_1, ..., h_m]``, one per chunk of ``chunk`` tokens.

    ``h_i`` identifies the prefix ``token_ids[:min(i*chunk, N)]``; the last
    chunk may be partial.  An empty token list gives an empty list.
    """
    if not is_int(chunk, lo=1):  # True was a chunk of 1: keys of another chunking, so every probe a miss
        raise KvcInputError(f"chunk must be a positive integer, got {chunk!r:.40}")
    raw = token_bytes(token_ids)
    h = root_digest(model, codec, namespace)
    out: list[bytes] = []
    step = 4 * chunk
    for off in range(0, len(raw), step):
        piece = raw[off:off + step]
        h = hashlib.blake2b(
            h + struct.pack("<I", len(piece) // 4) + piece, digest_size=DIGEST_SIZE
        ).digest()
        out.append(h)
    return out


@dataclass(frozen=True, order=True)
class StoreKey:
    """Address of one cached entry.

    ``digest`` (64 lowercase hex) already binds model, codec, namespace and the
    token prefix; the other fields are kept in clear for listing and
    filtering.  String form (``to_str``/``from_str``)::

        kvc1:<model>:<codec>:<namespace>:<n_tokens>:<digest>
    """

    model: str
    codec: str
    namespace: str
    n_tokens: int
    digest: str

    def __post_init__(self) -> None:
        check_id("model", self.model)
        check_id("codec", self.codec)
        check_id("namespace", self.namespace)
        if not isinstance(self.n_tokens, int) or isinstance(self.n_tokens, bool) or self.n_tokens < 0:
            raise KvcInputError(f"store key n_tokens must be a non-negative int, got {self.n_tokens!r}")
        if not isinstance(self.digest, str) or not _HEX_RE.fullmatch(self.digest):
            shown = ascii(self.digest[:80]) if isinstance(self.digest, str) else type(self.digest).__name__
            raise KvcInputError(f"store key digest must be 64 lowercase hex characters, got {shown}")

    # -- constructors -----------------------------------------------------
    @classmethod
    def for_tokens(
        cls,
        token_ids: Any,
        *,
        model: str,
        codec: str,
        namespace: str = "default",
        chunk: int = DEFAULT_CHUNK,
    ) -> "StoreKey":
        """Key of an entry covering all of ``token_ids`` (last chunk may be partial)."""
        hs = chunk_hashes(token_ids, chunk, model=model, codec=codec, namespace=namespace)
        if not hs:
            raise KvcInputError("cannot key an empty token list")
        return cls(model, codec, namespace, _count(token_ids), hs[-1].hex())

    @classmethod
    def from_str(cls, s: str) -> "StoreKey":
        """Parse ``kvc1:<model>:<codec>:<namespace>:<n_tokens>:<digest>`` (ASCII only)."""
        if not isinstance(s, str):
            raise KvcInputError(f"store key must be a string, got {type(s).__name__}")
        shown = ascii(s[:80]) + ("..." if len(s) > 80 else "")  # one printable line, whatever s holds
        if len(s) > MAX_KEY_STR:
            raise KvcInputError(f"bad store key {shown}: longer than {MAX_KEY_STR} characters")
        parts = s.strip().split(":")
        if len(parts) != 6 or parts[0] != f"kvc{KEY_VERSION}":
            raise KvcInputError(
                f"bad store key {shown}: expected kvc{KEY_VERSION}:<model>:<codec>:<namespace>:<n_tokens>:<digest>"
            )
        _, model, codec, ns, n, digest = parts
        if not _COUNT_RE.fullmatch(n):
            raise KvcInputError(f"bad store key {shown}: n_tokens {ascii(n)} is not a number in ASCII digits")
        return cls(model, codec, ns, int(n), digest)

    def to_str(self) -> str:
        return f"kvc{KEY_VERSION}:{self.model}:{self.codec}:{self.namespace}:{self.n_tokens}:{self.digest}"

    def __str__(self) -> str:
        return self.to_str()


def _count(token_ids: Any) -> int:
    if hasattr(token_ids, "__array__") and not isinstance(token_ids, (list, tuple)):
        import numpy as np

        return int(np.asarray(token_ids).size)
    return len(token_ids)


def prefix_keys(
    token_ids: Any,
    *,
    model: str,
    codec: str,
    namespace: str = "default",
    chunk: int = DEFAULT_CHUNK,
    min_tokens: int = 1,
) -> list[StoreKey]:
    """Every key an entry for a prefix of ``token_ids`` may have, longest first.

    Candidates are the chunk boundaries ``k*chunk`` and the full length ``N``
    (when ``N`` is not a multiple of ``chunk``).
    """
    if not is_int(min_tokens):  # "x" escaped as TypeError at the first comparison
        raise KvcInputError(f"min_tokens must be an integer >= 0, got {min_tokens!r:.40}")
    hs = chunk_hashes(token_ids, chunk, model=model, codec=codec, namespace=namespace)
    n = _count(token_ids)
    keys = []
    for i, h in enumerate(hs):
        n_i = min((i + 1) * chunk, n)
        if n_i >= min_tokens:
            keys.append(StoreKey(model, codec, namespace, n_i, h.hex()))
    keys.reverse()
    return keys
