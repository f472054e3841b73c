"""The rANS bitstream vectors (spec/vectors/rans/ for spec/rans-v1.md, spec/vectors/rans-v2/ for spec/rans-v2.md).

Written through ``python kvcodec/testing/golden.py rans --write`` (``rans2`` for v2), the one generator's CLI,
never over existing ones; tests/codecs/test_rans.py and tests/codecs/test_rans_bank.py read them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.codecs.rans import RansStage, to_contexts
from kvcodec.core.stage import ChunkContext
from kvcodec.entropy.rans import encode_contexts
from kvcodec.testing.vectors import ROOT, refuse_existing

RANS_DIR = ROOT / "spec" / "vectors" / "rans"


def _renorm_example() -> np.ndarray:
    """40 symbols, mostly 0, with rare symbols in lanes 0, 3 and 5 (spec worked example 2)."""
    sym = np.zeros(40, dtype=np.uint8)
    sym[[0, 32, 3, 35, 5]] = [1, 2, 2, 1, 1]
    return sym.reshape(1, 40, 1)


# explicit tables for vectors coded with encode_contexts(symbols, freqs) instead of the stage default
_VECTOR_FREQS = {"renorm": [[4064, 16, 16]]}


def _vector_inputs() -> dict[str, tuple[np.ndarray, int | None, str]]:
    """Small, deterministic stage inputs (H, T, D) covering the corner cases."""
    rng = np.random.default_rng(20250101)

    def laplace(shape, scale):
        return np.clip(np.round(rng.laplace(0, scale, size=shape)) + 8, 0, 15).astype(np.uint8)

    return {
        "renorm": (_renorm_example(), None, "explicit table [4064, 16, 16]: two renormalisation words; spec worked example 2"),
        "tiny": (np.array([[[0, 1, 0, 2], [0, 0, 1, 0]]], dtype=np.uint8), None, "1 head, 2 tokens, 4 channels; the worked example of spec/rans-v1.md"),
        "single_symbol": (np.full((2, 5, 8), 7, dtype=np.uint8), None, "one distinct symbol: f = 4096, no words, all states L"),
        "partial_step": (laplace((1, 33, 1), 2.0), None, "33 symbols: a full step plus a 1-lane step"),
        "laplace_groups": (laplace((2, 64, 16), 1.5), 4, "2 heads x 4 channel groups of 4, 4-bit Laplace"),
        "all_symbols": (rng.permutation(np.arange(1024) % 256).astype(np.uint8).reshape(1, 32, 32), None, "all 256 symbols, uniform: two-byte LEB128 frequencies"),
        "skewed": (np.where(rng.random((3, 100, 3)) < 0.995, 0, rng.integers(1, 256, (3, 100, 3))).astype(np.uint8), None, "very skewed: rare symbols get f = 1"),
    }


def write_rans_vectors(directory: Path = RANS_DIR) -> dict:
    """Write the rANS vectors (stage inputs + encoded streams + manifest) into an empty directory."""
    refuse_existing(directory / "manifest.json")

    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": "rans", "version": 1, "vectors": []}
    for name, (arr, g, desc) in _vector_inputs().items():
        stage = RansStage(channel_group=g)
        freqs = _VECTOR_FREQS.get(name)
        if freqs is None:
            data, side = stage.encode(arr, ChunkContext())
            assert not side
        else:
            data = encode_contexts(to_contexts(arr, g), np.asarray(freqs, dtype=np.uint32))
        manifest["vectors"].append(_rans_vector(directory, name, desc, arr, data, stage.get_config(),
                                                {"freqs": freqs} if freqs is not None else {}))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _rans_vector(directory: Path, name: str, desc: str, arr: np.ndarray, data: bytes, config: dict,
                 extra: dict) -> dict[str, Any]:
    """Write one rANS vector's input and stream; its manifest entry (``extra``: an explicit table or bank)."""
    np.save(directory / f"{name}.npy", arr, allow_pickle=False)
    (directory / f"{name}.bin").write_bytes(data)
    return {"name": name, "description": desc, "shape": list(arr.shape), "dtype": "uint8", "config": config,
            "input": f"{name}.npy", "encoded": f"{name}.bin", **extra, "encoded_bytes": len(data),
            "input_sha256": hashlib.sha256(np.ascontiguousarray(arr).tobytes()).hexdigest(),
            "encoded_sha256": hashlib.sha256(data).hexdigest()}


RANS_BANK_DIR = ROOT / "spec" / "vectors" / "rans-v2"
# explicit banks (freqs, table_of) for v2 vectors coded through encode_banked(..., bank=...)
_BANK_VECTOR_BANKS = {"bank_tiny": ([[3072, 1024, 0, 0], [0, 0, 2048, 2048]], [[0, 1]])}


def _bank_vector_inputs() -> dict[str, tuple[np.ndarray, int | None, int, str]]:
    """Small, deterministic rans v2 stage inputs (H, T, D), channel group, block_tokens, description."""
    rng = np.random.default_rng(20261128)
    tiny = np.zeros((1, 64, 1), np.uint8)
    tiny[0, :32, 0] = [1 if i in (0, 5, 31) else 0 for i in range(32)]
    tiny[0, 32:, 0] = [3 if i in (1, 2, 40) else 2 for i in range(32, 64)]
    scale = np.repeat(rng.uniform(0.3, 5.0, (2, 3)), 32, axis=1)[:, :, None]  # a scale per 32-token block
    blocks = np.clip(np.abs(np.round(rng.laplace(0, 1, (2, 96, 8)) * scale)) * 2, 0, 63).astype(np.uint8)
    return {
        "bank_tiny": (tiny, None, 32, "1 context, 2 blocks of 32 tokens, an explicit bank of 2 tables; spec/rans-v2.md's worked example"),
        "bank_blocks": (blocks, 4, 32, "2 heads x 2 groups of 4 channels, 3 blocks of 32 tokens whose scale differs; the encoder's bank"),
        "bank_partial": (np.clip(np.round(rng.laplace(0, 2.0, (1, 70, 3))) + 8, 0, 15).astype(np.uint8), None, 32,
                         "70 tokens x 3 channels: the last block is partial (6 tokens)"),
        "bank_one_table": (np.full((2, 40, 4), 5, np.uint8), 2, 32, "one distinct symbol: a bank of one table f = 4096, no words"),
        "bank_all_symbols": (rng.permutation(np.arange(2048) % 256).astype(np.uint8).reshape(1, 64, 32), 32, 32,
                             "all 256 symbols: two-byte LEB128 frequencies"),
        "bank_empty": (np.zeros((2, 0, 8), np.uint8), 4, 32, "no tokens: 4 contexts of 0 symbols, one table f_0 = 4096"),
    }


def write_rans_bank_vectors(directory: Path = RANS_BANK_DIR) -> dict:
    """Write the rANS v2 vectors (stage inputs + encoded streams + manifest) into an empty directory."""
    from kvcodec.codecs.rans import RansBankStage
    from kvcodec.entropy.rans import encode_banked

    refuse_existing(directory / "manifest.json")
    directory.mkdir(parents=True, exist_ok=True)
    manifest: dict[str, Any] = {"format": "rans", "version": 2, "vectors": []}
    for name, (arr, g, block, desc) in _bank_vector_inputs().items():
        stage = RansBankStage(channel_group=g, block_tokens=block)
        bank = _BANK_VECTOR_BANKS.get(name)
        if bank is None:
            data, side = stage.encode(arr, ChunkContext())
            assert not side
        else:
            data = encode_banked(to_contexts(arr, g), stage.block_symbols(arr.shape),
                                 bank=(np.asarray(bank[0], np.uint32), np.asarray(bank[1], np.uint8)))
        manifest["vectors"].append(_rans_vector(directory, name, desc, arr, data, stage.get_config(),
                                                {"bank": {"freqs": bank[0], "table_of": bank[1]}} if bank is not None else {}))
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest
