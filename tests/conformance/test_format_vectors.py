"""Golden vectors: decode exactly, re-encode byte for byte, and agree with the independent reader."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import zstandard

from kvcodec.format import KvcReader
from kvcodec.testing.golden import LOSSY_DIR, VECTOR_DIR, cache_from_vector, encode_case, lossy_decoded_digest, stacked

import independent_reader  # noqa: E402

MANIFEST = json.loads((VECTOR_DIR / "manifest.json").read_text())
NAMES = sorted(MANIFEST["vectors"])


def _load(name: str) -> tuple[bytes, np.ndarray, dict]:
    v = MANIFEST["vectors"][name]
    data = (VECTOR_DIR / v["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == v["sha256"], f"{v['file']} changed: vectors are never regenerated silently"
    exp_bytes = (VECTOR_DIR / v["expected"]).read_bytes()
    assert hashlib.sha256(exp_bytes).hexdigest() == v["expected_sha256"]
    return data, np.load(VECTOR_DIR / v["expected"], allow_pickle=False), v


def _synthetic_ids(n: int) -> np.ndarray:
    return (np.arange(n) * 7919 + 13) % 49152


def test_vector_set_is_complete():
    assert {"f16_raw_chunked", "bf16_lossless_pruned", "f32_zstd_attachment", "f16_lossless_idhash",
            "smollm2_8tok_f16_lossless"} <= set(NAMES)
    assert sum(v["bytes"] for v in MANIFEST["vectors"].values()) < 256 << 10


@pytest.mark.parametrize("name", NAMES)
def test_vector_decodes_exactly(name):
    data, exp, v = _load(name)
    with KvcReader(data) as r:
        assert r.verify() == []
        cache = r.read_cache(token_ids=_synthetic_ids(r.header.num_context_tokens))
        got = stacked(cache)
        assert got.dtype == exp.dtype and np.array_equal(got.view(np.uint8), exp.view(np.uint8))
        for j, e in enumerate(r.entries):
            want = exp[e.layer, "kv".index(e.kind), e.head_start : e.head_end, e.token_start : e.token_end]
            assert np.array_equal(r.read_chunk(j).view(np.uint8), np.ascontiguousarray(want).view(np.uint8))


@pytest.mark.parametrize("name", NAMES)
def test_vector_reencodes_byte_for_byte(name):
    if zstandard.ZSTD_VERSION != tuple(MANIFEST["zstd_version"]):
        pytest.skip(f"zstd {zstandard.ZSTD_VERSION} differs from the vectors' {MANIFEST['zstd_version']}: compressed bytes may differ")
    data, exp, v = _load(name)
    with KvcReader(data) as r:
        cache = cache_from_vector(r, exp)
        params = dict(v["params"])
        params.pop("meta", None)
        assert encode_case(cache, params, writer=r.header.writer) == data


@pytest.mark.parametrize("name", NAMES)
def test_independent_reader_agrees(name):
    data, exp, v = _load(name)
    ind = independent_reader.read(data)
    assert np.array_equal(ind["tensors"].view(np.uint8), exp.view(np.uint8))
    with KvcReader(data) as r:
        assert ind["dtype"] == r.header.dtype
        assert ind["model"] == r.fingerprint.to_json()
        if r.token_ids is None:
            assert ind["token_ids"] is None
        else:
            assert np.array_equal(ind["token_ids"], r.token_ids)
        assert (ind["positions"] is None) == (r.positions is None)
        if r.positions is not None:
            assert np.array_equal(ind["positions"], r.positions)
        assert ind["meta"] == r.header.meta
        assert set(ind["attachments"]) == set(r.attachments)
        for k, a in ind["attachments"].items():
            assert np.array_equal(a, r.attachments[k])


def test_independent_reader_rejects_corruption():
    data, _, _ = _load("f16_raw_chunked")
    bad = bytearray(data)
    bad[900] ^= 1
    with pytest.raises(independent_reader.SpecError):
        independent_reader.read(bytes(bad))


# ------------------------------------------------------------------ lossy end-to-end vectors (spec/vectors/kvc-lossy)
LOSSY = json.loads((LOSSY_DIR / "manifest.json").read_text())


@pytest.mark.parametrize("name", sorted(LOSSY["vectors"]))
def test_lossy_vector_decodes_exactly(name, monkeypatch):
    """A real cache encoded with a lossy preset decodes to exactly the recorded tensors, through the
    registry's pick and through the reference (the normative stage-by-stage decode) alike."""
    import kvcodec.decode.registry as B

    v = LOSSY["vectors"][name]
    data = (LOSSY_DIR / v["file"]).read_bytes()
    assert hashlib.sha256(data).hexdigest() == v["sha256"], f"{v['file']} changed: vectors are never regenerated silently"
    want = (v["decoded_sha256"], v["decoded_dtype"], v["decoded_shape"])
    assert lossy_decoded_digest(data) == want
    with KvcReader(data) as r:
        assert r.verify() == []
        stages = {s.name for p in r.header.pipelines for s in p.stages}
    assert {"keep", "transform", "quantize", "rans"} <= stages
    monkeypatch.setattr(B, "select", lambda *a, **k: [B.backend("reference")])
    assert lossy_decoded_digest(data) == want


def test_lossy_vectors_cover_the_lossy_chain():
    """Between them the lossy vectors use every stage of the lossy presets' chain, tokenscale included."""
    stages = set()
    for v in LOSSY["vectors"].values():
        with KvcReader((LOSSY_DIR / v["file"]).read_bytes()) as r:
            stages |= {s.name for p in r.header.pipelines for s in p.stages}
    assert {"rope", "keep", "transform", "tokenscale", "quantize", "rans"} <= stages
