"""Tenant credentials: on-tier names and entry authentication derived from a secret.

A namespace alone is a label anyone can type, so isolation cannot rest on it.
Every :class:`~kvcodec.store.Store` holds a :class:`TenantKey` (a 32-byte
secret).  For each namespace the secret derives (HMAC-SHA256, spec/store-keys.md
section 8):

* a *tag*, the opaque on-tier namespace (a directory per tag, a Redis name
  component), so a tier can partition quotas without learning names;
* the *physical* key of each logical key: the name an entry really has on a
  tier.  Without the secret nobody can compute it, so nobody can name, read,
  overwrite or delete another tenant's entry through kvcodec;
* a MAC key.  Every entry carries a *seal*: the logical key, the user metadata,
  the payload size and BLAKE3 hashes of fixed-size payload blocks, MACed
  together with the physical name.  An entry from any tier is used only after
  its seal verifies, so a forged, tampered or moved entry is a miss, and range
  reads verify each block they touch (:class:`AuthRangeReader`).

Provisioning (first match wins): an explicit key, ``$KVC_STORE_KEY`` (64 hex
characters), ``$KVC_STORE_KEY_FILE``, else the per-user default key file
``$XDG_CONFIG_HOME/kvcodec/store.key`` (``~/.config/...``), created on first
use with mode 0600.  Processes of one user therefore share entries with no
setup; two parties share entries only if they share the key.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import stat
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from blake3 import blake3

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.lru import BoundedLRU
from kvcodec.store.keys import StoreKey, check_id
from kvcodec.store.ranged import RangeReader

SEAL_VERSION = 2
KEY_BYTES = 32
NS_CACHE = 4096  # namespaces whose derived keys a TenantKey keeps (more are derived again: four HMACs)
MIN_BLOCK = 1 << 20
MAX_BLOCKS = 4096
PHYS_MODEL = "kvs2"          # model field of every physical key
PHYS_CODEC = "hmac-sha256"   # codec field of every physical key
ENV_KEY = "KVC_STORE_KEY"
ENV_KEY_FILE = "KVC_STORE_KEY_FILE"
_DOMAIN_NS = b"kvcodec.store.namespace.v2\x00"
_DOMAIN_ENTRY = b"kvcodec.store.entry.v2\x00"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def default_key_path() -> Path:
    """``$XDG_CONFIG_HOME/kvcodec/store.key`` (``~/.config/kvcodec/store.key``)."""
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "kvcodec" / "store.key"


def _hmac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _lp(s: str) -> bytes:
    b = s.encode("utf-8")
    return len(b).to_bytes(4, "little") + b


def block_size_for(size: int) -> int:
    """Power-of-two block size >= 1 MiB giving at most 4096 blocks (header stays small)."""
    b = MIN_BLOCK
    while (size + b - 1) // b > MAX_BLOCKS:
        b <<= 1
    return b


def block_hash(piece: bytes | memoryview) -> bytes:
    """BLAKE3 (32 bytes) of one block: ~7x faster than BLAKE2b here (benchmarks/BENCHMARKS.md)."""
    return blake3(piece).digest()


def block_hashes(data: bytes | memoryview, block: int) -> bytes:
    """Concatenated BLAKE3 digests of ``data`` cut into ``block``-byte pieces."""
    mv = memoryview(data)
    return b"".join(block_hash(mv[o:o + block]) for o in range(0, len(mv), block))


def _canonical(d: Mapping[str, Any]) -> bytes:
    return json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


@dataclass(frozen=True)
class Seal:
    """An authenticated entry header: what the entry claims, already verified against the MAC."""

    key: StoreKey
    meta: dict[str, Any]
    size: int
    block: int
    hashes: bytes

    def check_data(self, data: bytes | memoryview, what: str) -> None:
        """Raise :class:`KvcFormatError` unless ``data`` is exactly the sealed payload."""
        if len(data) != self.size:
            raise KvcFormatError(f"{what}: payload is {len(data)} bytes, sealed size {self.size}")
        if not hmac.compare_digest(block_hashes(data, self.block), self.hashes):
            raise KvcFormatError(f"{what}: payload does not match its sealed block hashes")


@dataclass(frozen=True)
class NamespaceKeys:
    """Keys of one namespace under one tenant secret (see module doc)."""

    namespace: str
    tag: str
    name_key: bytes = field(repr=False)
    mac_key: bytes = field(repr=False)

    def physical(self, key: StoreKey) -> StoreKey:
        """The on-tier key of ``key``: nothing in it reveals the logical key."""
        d = _hmac(self.name_key, key.to_str().encode()).hex()
        return StoreKey(PHYS_MODEL, PHYS_CODEC, self.tag, 0, d)

    def _mac(self, phys: StoreKey, body: Mapping[str, Any]) -> str:
        return _hmac(self.mac_key, _DOMAIN_ENTRY, phys.to_str().encode(), b"\x00", _canonical(body)).hex()

    def seal(self, key: StoreKey, data: bytes, meta: dict[str, Any]) -> dict[str, Any]:
        """The envelope metadata stored with ``data`` under ``physical(key)``."""
        block = block_size_for(len(data))
        body = {"v": SEAL_VERSION, "key": key.to_str(), "meta": meta, "size": len(data), "block": block,
                "hashes": block_hashes(data, block).hex()}
        return {**body, "mac": self._mac(self.physical(key), body)}

    def open(self, phys: StoreKey, sealed: Any, what: str) -> Seal:
        """Verify a seal read from ``phys``; raise :class:`KvcFormatError` if it is not ours or damaged."""
        if not isinstance(sealed, dict):
            raise KvcFormatError(f"{what}: no kvcodec v{SEAL_VERSION} seal")
        mac = sealed.get("mac")
        if sealed.get("v") != SEAL_VERSION or not isinstance(mac, str) or not _HEX64.fullmatch(mac):
            raise KvcFormatError(f"{what}: no kvcodec v{SEAL_VERSION} seal")
        body = {k: v for k, v in sealed.items() if k != "mac"}
        if set(body) != {"v", "key", "meta", "size", "block", "hashes"}:
            raise KvcFormatError(f"{what}: seal has unexpected fields")
        try:
            want = self._mac(phys, body)
        except (TypeError, ValueError, RecursionError) as e:
            raise KvcFormatError(f"{what}: seal is not canonical JSON: {type(e).__name__}") from None
        if not hmac.compare_digest(want, mac):
            raise KvcFormatError(f"{what}: seal does not authenticate (another tenant's entry, or forged)")
        # Authentic from here on: the fields were written by a holder of this key.
        try:
            key = StoreKey.from_str(body["key"])
            size, block, hashes = int(body["size"]), int(body["block"]), bytes.fromhex(body["hashes"])
        except (KvcInputError, TypeError, ValueError) as e:
            raise KvcFormatError(f"{what}: bad sealed fields: {e}") from None
        if key.namespace != self.namespace or self.physical(key) != phys or not isinstance(body["meta"], dict):
            raise KvcFormatError(f"{what}: seal names another key")
        if block <= 0 or len(hashes) != 32 * ((size + block - 1) // block):
            raise KvcFormatError(f"{what}: sealed block list does not fit the size")
        return Seal(key, body["meta"], size, block, hashes)


class TenantKey:
    """A tenant's secret.  Whoever holds it owns every namespace derived from it."""

    def __init__(self, secret: bytes, source: str = "explicit") -> None:
        if not isinstance(secret, (bytes, bytearray)) or len(secret) < 16:
            raise KvcInputError("a tenant key must be at least 16 bytes")
        self._secret = bytes(secret)
        self.source = source
        self.id = _hmac(self._secret, b"kvcodec.store.key-id")[:8].hex()
        # bounded: a KDN client's physical keys name any namespace string it likes (each /v1/contains up to
        # 4,096 of them), and an unbounded dict grew by some 0.5 kB per name for the life of the service
        self._ns: BoundedLRU[NamespaceKeys] = BoundedLRU(NS_CACHE)

    # -- provisioning -------------------------------------------------------------
    @classmethod
    def from_hex(cls, text: str, source: str = "explicit") -> "TenantKey":
        t = text.strip() if isinstance(text, str) else ""
        if len(t) != 2 * KEY_BYTES or not all(c in "0123456789abcdefABCDEF" for c in t):
            raise KvcInputError(f"{source}: a store key is {2 * KEY_BYTES} hex characters")
        return cls(bytes.fromhex(t), source)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "TenantKey":
        """Read a key file (64 hex characters); refuse one that others may write.

        Why the type check: the engine integrations pass a config's ``key_file`` as is, and a number, a null or a
        path with a NUL byte escaped as a TypeError / ValueError traceback instead of one line."""
        if not isinstance(path, (str, os.PathLike)) or "\0" in str(path):
            raise KvcInputError(f"store key file must be a path, got {ascii(path)[:80]}")
        p = os.fspath(path)
        try:
            fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))  # a FIFO must not block us
        except FileNotFoundError:
            raise KvcInputError(f"{p}: no such store key file (create one with `kvc store keygen -o {p}`)") from None
        except OSError as e:
            raise KvcInputError(f"{p}: cannot open store key file: {e.strerror or e}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise KvcInputError(f"{p}: store key file is not a regular file")
            if st.st_mode & 0o022:
                raise KvcInputError(f"{p}: store key file is writable by group or others; chmod 600 it")
            if st.st_mode & 0o004:  # was taken: every local user could read every entry of the tenant, and forge one
                raise KvcInputError(f"{p}: store key file is readable by others (any local user could read and forge "
                                    "this tenant's entries); chmod 600 it")
            text = os.read(fd, 4 * KEY_BYTES + 8)
        finally:
            os.close(fd)
        try:
            return cls.from_hex(text.decode("ascii"), source=p)
        except UnicodeDecodeError:
            raise KvcInputError(f"{p}: a store key is {2 * KEY_BYTES} hex characters") from None

    @staticmethod
    def generate(path: str | os.PathLike[str]) -> "TenantKey":
        """Create a new random key file (mode 0600); refuses to replace an existing one."""
        p = os.fspath(path)
        secret = secrets.token_bytes(KEY_BYTES)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(p)), mode=0o700, exist_ok=True)
            tmp = f"{p}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                os.write(fd, secret.hex().encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            try:
                os.link(tmp, p)  # atomic and never replaces: a concurrent creator's key wins
            except FileExistsError:
                raise KvcInputError(f"{p}: exists; refusing to replace a store key") from None
            finally:
                os.unlink(tmp)
        except OSError as e:
            raise KvcStoreError(f"{p}: cannot create store key file: {e.strerror or e}") from None
        return TenantKey(secret, p)

    @classmethod
    def default(cls) -> "TenantKey":
        """``$KVC_STORE_KEY``, else ``$KVC_STORE_KEY_FILE``, else the per-user key file (created once)."""
        env = os.environ.get(ENV_KEY)
        if env:
            return cls.from_hex(env, source=f"${ENV_KEY}")
        f = os.environ.get(ENV_KEY_FILE)
        if f:
            return cls.load(f)
        p = default_key_path()
        if not p.exists():
            try:
                return cls.generate(p)
            except KvcInputError:  # another process created it first
                pass
            except KvcStoreError as e:
                raise KvcStoreError(f"{e}; set ${ENV_KEY} or ${ENV_KEY_FILE}") from None
        return cls.load(p)

    @classmethod
    def ephemeral(cls) -> "TenantKey":
        """A random key for this process only (memory-only stores)."""
        return cls(secrets.token_bytes(KEY_BYTES), "ephemeral")

    # -- derivation -----------------------------------------------------------------
    def namespace(self, ns: str) -> NamespaceKeys:
        """Keys of namespace ``ns`` (cached)."""
        k = self._ns.get(ns)
        if k is None:
            check_id("namespace", ns)
            root = _hmac(self._secret, _DOMAIN_NS, _lp(ns))
            k = NamespaceKeys(ns, _hmac(root, b"tag")[:16].hex(), _hmac(root, b"name"), _hmac(root, b"mac"))
            self._ns.put(ns, k)
        return k

    def __repr__(self) -> str:
        return f"TenantKey(id={self.id}, source={self.source!r})"


class AuthRangeReader(RangeReader):
    """Range reads of a sealed payload: every block touched is hashed and compared first.

    A block that does not match raises :class:`KvcFormatError`; bytes are never
    returned before their whole block verified.  Verified blocks are kept in a
    small LRU so that sequential small reads do not refetch.
    """

    def __init__(self, inner: RangeReader, seal: Seal, name: str, cache_blocks: int = 4) -> None:
        if inner.size != seal.size:
            raise KvcFormatError(f"{name}: payload is {inner.size} bytes, sealed size {seal.size}")
        self.inner, self.seal, self.name, self.size = inner, seal, name, seal.size
        self._cache: OrderedDict[int, bytes] = OrderedDict()
        self._cache_blocks = cache_blocks
        self._lock = threading.Lock()

    def _blocks(self, first: int, last: int) -> list[bytes]:
        with self._lock:
            have = {i: self._cache[i] for i in range(first, last + 1) if i in self._cache}
        out: list[bytes] = []
        i = first
        b = self.seal.block
        while i <= last:
            if i in have:
                out.append(have[i])
                i += 1
                continue
            j = i
            while j + 1 <= last and (j + 1) not in have:
                j += 1
            start, end = i * b, min((j + 1) * b, self.size)
            buf = self.inner.read(start, end - start)
            for n in range(i, j + 1):
                piece = buf[(n - i) * b:(n - i + 1) * b]
                if not hmac.compare_digest(block_hash(piece), self.seal.hashes[32 * n:32 * n + 32]):
                    raise KvcFormatError(f"{self.name}: block {n} does not match its sealed hash (tampered)")
                out.append(piece)
                with self._lock:
                    self._cache[n] = piece
                    while len(self._cache) > self._cache_blocks:
                        self._cache.popitem(last=False)
            i = j + 1
        return out

    def _read(self, offset: int, length: int) -> bytes:
        b = self.seal.block
        first, last = offset // b, (offset + length - 1) // b
        joined = b"".join(self._blocks(first, last))
        lo = offset - first * b
        return joined[lo:lo + length]

    def close(self) -> None:
        self.inner.close()
