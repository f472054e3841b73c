"""What the KDN service checks in a request, as pure functions: run inline for small requests, in a worker
process (:mod:`kvcodec.service.worker`) for everything whose cost grows with the request.

The order is the cost model of ``spec/kdn-v1.md`` §5: the cheap facts first
(JSON size and depth, field types, the key; for an entry its structure, its
declared decoded size against the per-file limits, token ids, model and key
digest), and only then the expensive work (decoding every chunk), which the
caller admits through its per-tenant quota between :func:`open_entry` and
:func:`verify_entry`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from kvcodec.errors import KvcError, KvcFormatError, KvcInputError
from kvcodec.kdn_protocol import MAX_CONTAINS
from kvcodec.store.keys import DEFAULT_CHUNK, StoreKey, chunk_hashes, prefix_keys
from kvcodec.store.tenant import PHYS_MODEL

MAX_LOOKUP_TOKENS = 1 << 20    # token ids per lookup
MAX_LOOKUP_CANDIDATES = 4096   # prefixes one lookup may test (ceil(tokens / chunk))
HASH_BUDGET_FACTOR = 64        # an entry's digest check hashes at most this many times its token ids


class HttpError(Exception):
    """A clean 4xx/5xx answer: status and a one-line message."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(" ".join(message.split()))
        self.status = status
        self.headers = headers or {}


# -- JSON ------------------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> dict[str, Any]:
    """A JSON object from a request body, or :class:`HttpError` 400 with one line.

    The size is the caller's limit (bytes actually read); nesting needs no pre-scan: the parser refuses
    deep nesting with ``RecursionError`` (caught here), and every field we accept is flat, so the
    schema checks that follow refuse any structure deeper than the documented one.
    """
    try:
        obj = json.loads(raw)
    except RecursionError:
        raise HttpError(400, "body is not JSON: it nests too deeply") from None
    except (UnicodeDecodeError, ValueError) as e:
        raise HttpError(400, f"body is not JSON: {str(e)[:200]}") from None
    if not isinstance(obj, dict):
        raise HttpError(400, "body must be a JSON object")
    return obj


# -- /v1/contains ----------------------------------------------------------------------------------------
def contains_key_strings(obj: dict[str, Any]) -> list[str]:
    """The body's key strings, its shape checked; parsing each is left to the caller (the service parses them in
    store-thread turns, not on the event loop)."""
    ks = obj.get("keys")
    if not isinstance(ks, list) or len(ks) > MAX_CONTAINS or not all(isinstance(k, str) for k in ks):
        raise HttpError(400, f"'keys' must be a list of at most {MAX_CONTAINS} key strings")
    return ks


def contains_keys(obj: dict[str, Any]) -> list[StoreKey]:
    try:
        return [StoreKey.from_str(k) for k in contains_key_strings(obj)]
    except KvcInputError as e:
        raise HttpError(400, str(e)) from None


# -- /v1/lookup ------------------------------------------------------------------------------------------
@dataclass
class Lookup:
    model: str
    codec: str
    namespace: str
    chunk: int
    token_ids: list[int] | None
    text: str | None


def parse_lookup(obj: dict[str, Any], namespaces: list[str], *, max_tokens: int = MAX_LOOKUP_TOKENS,
                 max_text: int = 4 << 20) -> Lookup:
    """The lookup's fields, checked (400; 403 for a namespace outside ``namespaces``)."""
    model, codec = obj.get("model"), obj.get("codec")
    ns = obj.get("namespace", namespaces[0])
    chunk = obj.get("chunk", DEFAULT_CHUNK)
    if not isinstance(model, str) or not isinstance(codec, str) or not isinstance(ns, str):
        raise HttpError(400, "lookup needs string fields 'model' (fingerprint id) and 'codec'")
    if not isinstance(chunk, int) or isinstance(chunk, bool) or not 1 <= chunk <= 1 << 16:
        raise HttpError(400, "'chunk' must be an integer in [1, 65536]")
    if ns not in namespaces:
        raise HttpError(403, f"this token may not use namespace {ns[:128]!r}")
    if ("token_ids" in obj) == ("text" in obj):
        raise HttpError(400, "give exactly one of 'token_ids' and 'text'")
    if "text" in obj:
        text = obj["text"]
        if not isinstance(text, str) or not text:
            raise HttpError(400, "'text' must be a non-empty string")
        if len(text) > max_text:
            raise HttpError(413, f"'text' is longer than {max_text} characters")
        return Lookup(model, codec, ns, chunk, None, text)
    ids = obj["token_ids"]
    if not isinstance(ids, list) or len(ids) > max_tokens or \
            not all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 31 for x in ids):
        raise HttpError(400, f"'token_ids' must be a list of at most {max_tokens} integers in [0, 2^31)")
    return Lookup(model, codec, ns, chunk, ids, None)


def lookup_candidates(q: Lookup, ids: Any, max_tokens: int = MAX_LOOKUP_TOKENS) -> list[StoreKey]:
    """Every chunk-boundary prefix key of ``ids`` under the lookup's model, codec and namespace, longest first."""
    n = len(ids)
    if n > max_tokens:
        raise HttpError(413, f"the text is {n} tokens, more than the {max_tokens} a lookup may test")
    if -(-n // q.chunk) > MAX_LOOKUP_CANDIDATES:
        raise HttpError(400, f"{n} tokens in chunks of {q.chunk} are more than {MAX_LOOKUP_CANDIDATES} prefixes "
                             "to test; use a larger 'chunk'")
    try:
        return prefix_keys(ids, model=q.model, codec=q.codec, namespace=q.namespace, chunk=q.chunk) if n else []
    except KvcInputError as e:
        raise HttpError(400, str(e)) from None


# -- entries -------------------------------------------------------------------------------------------
def logical_key(key: StoreKey, meta: dict[str, Any]) -> StoreKey:
    """The key whose tokens the entry must hold: ``key``, or for a physical key the one its seal names."""
    if key.model != PHYS_MODEL:
        return key
    try:
        return StoreKey.from_str(meta["key"])
    except (KeyError, TypeError, KvcInputError):
        raise HttpError(422, "an entry under a physical key must carry its seal (metadata naming the "
                             "logical key)") from None


def chunk_candidates(n_tokens: int) -> list[int]:
    """Chunk sizes a key digest of ``n_tokens`` tokens may have been chained with.

    ``ask`` and blend chain in chunks of 256 (the last one may be partial); the vLLM
    connector keys chunk entries covering ``k * chunk_tokens`` tokens, so its
    chunk size divides the entry's token count.  256 first, then every divisor, largest first.
    """
    divs = {DEFAULT_CHUNK}
    i = 1
    while i * i <= n_tokens:
        if n_tokens % i == 0:
            divs.update((i, n_tokens // i))
        i += 1
    return [DEFAULT_CHUNK] + sorted(divs - {DEFAULT_CHUNK}, reverse=True)


def check_digest(ids: Any, key: StoreKey) -> None:
    """:class:`KvcInputError` unless ``ids`` hash to ``key`` for chunk 256 or a divisor of its token count.

    Bounded: the candidates are tried largest first, and the work (bytes hashed, plus 64 per hash call)
    stops at :data:`HASH_BUDGET_FACTOR` times the token ids' size (so a digest chained with a chunk of a
    few tokens over a huge, highly divisible token count is refused rather than searched for).
    """
    n = key.n_tokens
    budget = HASH_BUDGET_FACTOR * 4 * max(n, DEFAULT_CHUNK)
    spent = 0
    for c in chunk_candidates(n):
        spent += 4 * n + 64 * -(-n // c)
        if spent > budget:
            break
        hs = chunk_hashes(ids, c, model=key.model, codec=key.codec, namespace=key.namespace)
        if hs and hs[-1].hex() == key.digest:
            return
    raise KvcInputError("the .kvc's token ids do not hash to the key's digest (spec/store-keys.md)")


def open_entry(key: StoreKey, data: bytes, *, max_decoded_bytes: int, max_decoded_ratio: float,
               max_chunk_bytes: int | None = None) -> Any:
    """The cheap checks of an entry; returns its open :class:`~kvcodec.format.KvcReader` (``None`` for a
    multi-level manifest, which is fully checked here).  Raises :class:`KvcError` when refused.

    Nothing is decoded: the header and index are parsed, the declared decoded size is held against
    the per-file limits, the token ids are read (CRC and hash checked), and model, token count and key
    digest are compared.  ``reader.declared_bytes`` is then the cost of :func:`verify_entry`.
    """
    from kvcodec.format import KvcReader
    from kvcodec.store.levels import LEVELS_CODEC, LevelManifest

    if key.codec == LEVELS_CODEC:
        LevelManifest.from_bytes(data, key)
        return None
    r = KvcReader(data, max_decoded_bytes=max_decoded_bytes, max_decoded_ratio=max_decoded_ratio,
                  max_chunk_bytes=max_chunk_bytes)
    try:
        if r.fingerprint.id != key.model:
            raise KvcInputError(f"the .kvc is for model {r.fingerprint.id}, the key names model {key.model}")
        if r.header.token_ids_blob is None:
            raise KvcInputError("the .kvc carries no token ids (encode with token ids stored)")
        if r.header.num_context_tokens != key.n_tokens:
            raise KvcInputError(f"the .kvc holds {r.header.num_context_tokens} token ids, the key says {key.n_tokens}")
        ids = r.token_ids
        check_digest(ids, key)
    except BaseException:
        r.close()
        raise
    return r


def verify_entry(r: Any) -> None:
    """Decode every chunk of an entry opened by :func:`open_entry` (on the CPU); :class:`KvcFormatError` if any fails."""
    problems = r.verify(backend="cpu")
    if problems:
        raise KvcFormatError(f"the .kvc does not verify: {problems[0]}")


def check_entry(key: StoreKey, data: bytes, *, max_decoded_bytes: int, max_decoded_ratio: float,
                max_chunk_bytes: int | None = None, verify: bool = True) -> int:
    """Both steps at once (tests, tools); returns the declared decoded bytes."""
    r = open_entry(key, data, max_decoded_bytes=max_decoded_bytes, max_decoded_ratio=max_decoded_ratio,
                   max_chunk_bytes=max_chunk_bytes)
    if r is None:
        return 0
    with r:
        if verify:
            verify_entry(r)
        return int(r.declared_bytes)


def error_line(e: BaseException) -> str:
    """One line naming what went wrong (a KvcError's message, else the exception type and message)."""
    msg = str(e) if isinstance(e, KvcError) else f"{type(e).__name__}: {e}"
    return " ".join(msg.split())[:1000]
