"""``xor_demo`` v1: a bytes->bytes stage that XORs every byte with ``key`` (its own inverse)."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcodec.core.stage import BytesToBytes, ChunkContext
from kvcodec.errors import KvcCodecError, KvcFormatError


def xor_bytes(data: bytes | memoryview, key: int) -> bytes:
    return (np.frombuffer(data, dtype=np.uint8) ^ np.uint8(key)).tobytes()


class XorStage(BytesToBytes):
    name = "xor_demo"
    version = 1

    def __init__(self, key: int = 0x5A) -> None:
        if not isinstance(key, int) or isinstance(key, bool) or not 0 <= key <= 255:
            raise KvcCodecError(f"codec 'xor_demo': key must be an int in [0, 255], got {key!r}")
        self.key = key

    def get_config(self) -> dict[str, Any]:
        return {"key": self.key}

    def encode(self, data: bytes, ctx: ChunkContext) -> bytes:
        return xor_bytes(data, self.key)

    def decode(self, data: bytes | memoryview, max_size: int, ctx: ChunkContext) -> bytes:
        if len(data) > max_size:
            raise KvcFormatError(f"codec 'xor_demo': {len(data)} bytes, at most {max_size} expected")
        return xor_bytes(data, self.key)
