"""Bearer tokens of the KDN service: each token names a tenant and the namespaces it may use.

A token file is JSON::

    {"tokens": [
        {"token": "s3cret-a", "tenant": "a", "namespaces": ["a"], "write": true},
        {"token_sha256": "<64 hex>", "tenant": "b", "namespaces": ["b", "b-shared"], "write": false}
    ]}

``token_sha256`` keeps the secret itself out of the file.  ``namespaces``
defaults to ``[tenant]``; ``write`` defaults to true.  Tokens are looked up by
their SHA-256, so the comparison does not leak the secret through timing.

The namespace is the isolation unit of the store today (it is bound into
every key digest, ``spec/store-keys.md``).  When the store gains per-tenant
credentials (HMAC-derived keys), the tenant named here is what the service
passes to the store as that credential.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from kvcodec.errors import KvcInputError, json_loads

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+=-]{0,127}$")
SERVE_TOKEN_ENV = "KVC_SERVE_TOKEN"


@dataclass(frozen=True)
class Principal:
    """Who a request is: the tenant, the namespaces it may touch, and whether it may write."""

    tenant: str
    namespaces: tuple[str, ...]
    write: bool = True

    def may_use(self, namespace: str) -> bool:
        return namespace in self.namespaces


def token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


class TokenTable:
    """SHA-256(token) -> :class:`Principal`."""

    def __init__(self, principals: dict[str, Principal]) -> None:
        if not principals:
            raise KvcInputError("the kdn service needs at least one token (--tokens FILE or $KVC_SERVE_TOKEN)")
        self._by_hash = dict(principals)

    def lookup(self, token: str) -> Principal | None:
        """The token's principal, or ``None``. A header's bytes that are not UTF-8 reach us as surrogates (aiohttp
        decodes headers with ``surrogateescape``): no token file can hold them, and hashing them raised
        UnicodeEncodeError (a 500 for ``Authorization: Bearer \\xff``), so they are an unknown token (401)."""
        try:
            h = token_hash(token)
        except UnicodeEncodeError:
            return None
        return self._by_hash.get(h)

    def __len__(self) -> int:
        return len(self._by_hash)

    def tenants(self) -> set[str]:
        """The tenants the tokens name (each gets its own store view and cache: the memory bound counts them)."""
        return {p.tenant for p in self._by_hash.values()}

    @classmethod
    def single(cls, token: str, namespace: str = "default") -> "TokenTable":
        """One read-write token for one namespace (the one-command setup)."""
        _check_token(token)
        _check_name(namespace, "namespace")
        return cls({token_hash(token): Principal(namespace, (namespace,), True)})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> "TokenTable":
        p = Path(path)
        try:
            # a FIFO blocked for good and /dev/zero was read without end: only a regular file of bounded size
            mode = os.stat(p).st_mode
            if not stat.S_ISREG(mode):
                raise KvcInputError(f"token file {p} is not a regular file")
            with p.open("rb") as f:
                raw = f.read(MAX_TOKEN_FILE + 1)
            if len(raw) > MAX_TOKEN_FILE:
                raise KvcInputError(f"token file {p} is larger than {MAX_TOKEN_FILE:,} bytes")
            obj = json_loads(raw.decode("utf-8"))
        except FileNotFoundError:
            raise KvcInputError(f"no such token file: {p}") from None
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise KvcInputError(f"token file {p} is not readable JSON: {str(e)[:200]}") from None
        rows = obj.get("tokens") if isinstance(obj, dict) else None
        if not isinstance(rows, list):
            raise KvcInputError(f"token file {p}: expected {{\"tokens\": [...]}}")
        out: dict[str, Principal] = {}
        for i, r in enumerate(rows):
            where = f"token file {p}, entry {i}"
            if not isinstance(r, dict):
                raise KvcInputError(f"{where}: not an object")
            unknown = set(r) - {"token", "token_sha256", "tenant", "namespaces", "write"}
            if unknown:
                raise KvcInputError(f"{where}: unknown fields {sorted(unknown)}")
            if ("token" in r) == ("token_sha256" in r):
                raise KvcInputError(f"{where}: give exactly one of token / token_sha256")
            if "token" in r:
                h = token_hash(_check_token(r["token"], where))
            else:
                h = r["token_sha256"]
                if not isinstance(h, str) or not _HEX64.match(h):
                    raise KvcInputError(f"{where}: token_sha256 must be 64 lowercase hex characters")
            tenant = _check_name(r.get("tenant"), "tenant", where)
            nss = r.get("namespaces", [tenant])
            if not isinstance(nss, list) or not nss:
                raise KvcInputError(f"{where}: namespaces must be a non-empty list")
            write = r.get("write", True)
            if not isinstance(write, bool):
                raise KvcInputError(f"{where}: write must be true or false")
            if h in out:
                raise KvcInputError(f"{where}: duplicate token")
            out[h] = Principal(tenant, tuple(_check_name(n, "namespace", where) for n in nss), write)
        return cls(out)


#: the largest token file read (some 100,000 tokens)
MAX_TOKEN_FILE = 16 << 20


def _check_token(t: object, where: str = "token") -> str:
    if not isinstance(t, str) or len(t) < 8 or len(t) > 512 or not t.isascii() or not t.isprintable() or " " in t:
        raise KvcInputError(f"{where}: a token is 8-512 printable ASCII characters without spaces")
    return t


def _check_name(v: object, what: str, where: str = "") -> str:
    if not isinstance(v, str) or not _NAME.match(v):
        raise KvcInputError(f"{where + ': ' if where else ''}{what} {v!r} is invalid: 1-128 characters "
                            "from [A-Za-z0-9._+=-], starting with a letter or digit")
    return v
