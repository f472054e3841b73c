"""Crash-test writer for tests/store/test_store_crash.py (stdlib + kvcodec only, no pytest).

Run in multiprocessing forkserver children so each writer starts in milliseconds.
"""

from __future__ import annotations


# -- crash-test writer (run in forkserver children, so each start costs milliseconds) ---------

CRASH_BASE_SEED = 42
_crash_base: bytes | None = None


def crash_base() -> bytes:
    global _crash_base
    if _crash_base is None:
        import random

        _crash_base = random.Random(CRASH_BASE_SEED).randbytes(4 << 20)
    return _crash_base


def crash_key(i: int):
    from kvcodec.store import StoreKey

    return StoreKey.for_tokens([i] * 3, model="m", codec="c", namespace="crash")


def crash_payload(seed: int, n: int, size: int) -> bytes:
    import struct

    return struct.pack("<QQQ", seed, n, size) + crash_base()[:size]


def crash_payload_valid(b: bytes) -> bool:
    import struct

    if len(b) < 24:
        return False
    _seed, _n, size = struct.unpack_from("<QQQ", b)
    return len(b) == 24 + size and b[24:] == crash_base()[:size]


def crash_writer(root: str, seed: int, nkeys: int, lo: int, hi: int, counter) -> None:
    """Put self-verifying entries forever; ``counter.value`` = puts completed."""
    import random

    from kvcodec.store.tiers.directory import DirectoryTier

    rng = random.Random(seed)
    tier = DirectoryTier(root, fsync=True)
    n = 0
    while True:
        i = rng.randrange(nkeys)
        n += 1
        tier.put(crash_key(i), crash_payload(seed, n, rng.randrange(lo, hi)), {"i": i, "w": seed})
        counter.value = n


crash_base()  # computed once in the forkserver that preloads this module
