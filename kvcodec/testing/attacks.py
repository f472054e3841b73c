"""Hostile requests against a KDN service or a store tier, for the tests and the load-under-attack benchmark
(``benchmarks/bench_kdn_attack.py``; issue 35).  Loopback only; every loop is bounded by its caller.

Each helper builds bytes a client could legally send: valid ``.kvc`` entries of a synthetic model (no
model download), entries that are tiny but declare a huge decoded size, JSON that nests deeply or arrives
chunked, a connection that sends its request head a byte at a time.
"""

from __future__ import annotations

import socket
import time
from functools import lru_cache
from typing import Any

import numpy as np

from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.store.keys import StoreKey

#: the honest engines' model: tiny (2 layers, 2 KV heads of 4 channels)
SMALL_FP = ModelFingerprint("synthetic", 2, 2, (4, 4), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, "float32",
                            config_sha256="c" * 64)
#: the attacker's model: 16 layers, 8 KV heads of 128 channels (128 KiB of float32 K and V per token)
BIG_FP = ModelFingerprint("synthetic-big", 16, 8, (128,) * 16, '{"rope_theta": 10000.0}', "a" * 64, "b" * 64,
                          "float32", config_sha256="c" * 64)


def _encode(fp: ModelFingerprint, first: int, n_tokens: int, zeros: bool, preset: str, seed: int) -> bytes:
    import torch

    from kvcodec.api import encode
    from kvcodec.core.kvcache import KVCache

    g = np.random.default_rng(seed)
    H, L = fp.num_kv_heads, fp.num_layers

    def t(d: int) -> torch.Tensor:
        if zeros:
            return torch.zeros(H, n_tokens, d)
        return torch.from_numpy(g.standard_normal((H, n_tokens, d)).astype(np.float32))

    cache = KVCache([t(fp.head_dims[i]) for i in range(L)], [t(fp.head_dims[i]) for i in range(L)],
                    np.arange(first, first + n_tokens), fp)
    data = encode(cache, preset=preset, verify="off").data
    assert data is not None
    return data


@lru_cache(maxsize=256)
def honest_entry(first: int, n_tokens: int = 256, namespace: str = "default", codec: str = "c",
                 variant: int = 0) -> tuple[StoreKey, bytes]:
    """A sound lossless ``.kvc`` of the small model holding token ids ``first .. first+n_tokens-1``, and its key."""
    key = StoreKey.for_tokens(np.arange(first, first + n_tokens), model=SMALL_FP.id, codec=codec, namespace=namespace)
    return key, _encode(SMALL_FP, first, n_tokens, False, "lossless", first * 1000 + variant)


@lru_cache(maxsize=8)
def amplification_entry(first: int, n_tokens: int = 500, namespace: str = "default",
                        codec: str = "c") -> tuple[StoreKey, bytes]:
    """A *valid* ``.kvc`` of the big model whose K/V are zeros: ~9 KB that declare (and decode to)
    ``n_tokens`` x 128 KiB (500 tokens: 65.5 MB, some 7,000 times the file).  Its token ids hash to its key,
    so only a limit on the declared size relative to the file's stops it before the decode."""
    key = StoreKey.for_tokens(np.arange(first, first + n_tokens), model=BIG_FP.id, codec=codec, namespace=namespace)
    return key, _encode(BIG_FP, first, n_tokens, True, "lossless", 0)


@lru_cache(maxsize=8)
def costly_entry(first: int, n_tokens: int = 64, namespace: str = "default", codec: str = "c") -> tuple[StoreKey, bytes]:
    """A sound entry of the big model with random K/V: within every ratio limit (lossless: ~1x), but each put
    costs a real decode of ``n_tokens`` x 128 KiB (64 tokens: 8 MiB in 32 chunks)."""
    key = StoreKey.for_tokens(np.arange(first, first + n_tokens), model=BIG_FP.id, codec=codec, namespace=namespace)
    return key, _encode(BIG_FP, first, n_tokens, False, "lossless", first)


def deep_json(depth: int = 100_000) -> bytes:
    return b'{"keys": ' + b"[" * depth + b"]" * depth + b"}"


def chunked(body: bytes, piece: int = 1 << 16) -> bytes:
    """``body`` in HTTP/1.1 chunked transfer coding (no Content-Length: a limit on it cannot see the size)."""
    out = bytearray()
    for i in range(0, len(body), piece):
        c = body[i:i + piece]
        out += b"%x\r\n" % len(c) + c + b"\r\n"
    return bytes(out + b"0\r\n\r\n")


def raw_request(port: int, head: bytes, body: bytes = b"", timeout: float = 30.0,
                source: str | None = None) -> tuple[int, bytes]:
    """Send ``head`` + ``body`` on a fresh loopback connection; ``(status, response bytes)`` (status 0: none).

    ``source``: the local address to send from (any of 127.0.0.0/8 is this machine on Linux), so a test can be
    a second client address."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout,
                                  source_address=None if source is None else (source, 0)) as s:
        try:
            s.sendall(head + body)
        except OSError:
            pass  # the server may answer and close before reading everything: read what it said
        out = bytearray()
        try:
            while True:
                d = s.recv(1 << 16)
                if not d:
                    break
                out += d
        except OSError:
            pass
    status = 0
    if out.startswith(b"HTTP/1."):
        try:
            status = int(out.split(b" ", 2)[1])
        except (IndexError, ValueError):
            status = 0
    return status, bytes(out)


def slow_head(port: int, *, interval: float = 0.5, limit_s: float = 30.0, source: str | None = None) -> float:
    """Slowloris: open a connection and send a request head one byte every ``interval`` seconds until the
    server closes it (or ``limit_s`` passes); the seconds the connection stayed open. ``source``: as
    :func:`raw_request`'s."""
    head = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 10_000
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=interval * 4,
                                  source_address=None if source is None else (source, 0)) as s:
        for b in head:
            if time.monotonic() - t0 > limit_s:
                break
            try:
                s.sendall(bytes([b]))
            except OSError:
                break
            try:
                s.settimeout(interval)
                s.recv(1)
                break  # the server answered or closed: either way it stopped waiting for this head
            except socket.timeout:
                continue
            except OSError:
                break
    return time.monotonic() - t0


def bearer(token: str) -> bytes:
    return b"Authorization: Bearer " + token.encode() + b"\r\n"


def request_head(method: str, path: str, token: str | None, extra: dict[str, Any] | None = None) -> bytes:
    h = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n".encode()
    if token:
        h += bearer(token)
    for k, v in (extra or {}).items():
        h += f"{k}: {v}\r\n".encode()
    return h + b"\r\n"
