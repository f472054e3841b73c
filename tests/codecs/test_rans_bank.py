"""rans v2 (spec/rans-v2.md): a bank of tables chosen per block of tokens.

Round trips on every decoder of this machine (the numba kernel, the lane-vectorised reference, the fused
CPU chain), the golden vectors and the spec's worked example byte for byte, the encoder's bank, and a
decoder that refuses every malformed stream with one KvcFormatError line.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest

from kvcodec.codecs.rans import RansBankStage, RansStage, to_contexts
from kvcodec.core.stage import ArraySpec, ChunkContext, stage_from_json
from kvcodec.entropy import model, rans
from kvcodec.errors import KvcCodecError, KvcFormatError
from ransvectors import load_vector, manifest

CTX = ChunkContext()
VEC = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "rans-v2"


def drifting(rng, shape, block=32, top=63):
    """Symbols whose scale changes every ``block`` tokens, as a real cache's do along its tokens."""
    H, T, D = shape
    scale = np.repeat(rng.uniform(0.2, 6.0, (H, T // block + 1)), block, axis=1)[:, :T, None]
    return np.clip(np.abs(np.round(rng.laplace(0, 1, shape) * scale)) * 2, 0, top).astype(np.uint8)


def roundtrip(arr, g=None, block=32, tables=8) -> bytes:
    st = RansBankStage(g, block_tokens=block, tables=tables)
    data, side = st.encode(arr, CTX)
    assert side == {}
    spec = ArraySpec(arr.shape, "uint8")
    np.testing.assert_array_equal(st.decode(data, {}, spec, CTX), arr)
    s = st.parse(data, spec)
    assert s.version == 2 and s.freqs.shape[0] <= tables
    np.testing.assert_array_equal(rans.decode_reference(s), to_contexts(arr, g).ravel())
    b = rans.size_breakdown(data, s)
    assert b.total_bytes == len(data) == b.header_bytes + b.table_bytes + b.flush_bytes + b.payload_bits // 8 + b.padding_bytes
    return data


@pytest.mark.parametrize("shape,g,block", [
    ((2, 100, 16), 8, 32), ((1, 70, 3), None, 32), ((3, 1, 8), 4, 64), ((2, 0, 8), None, 32), ((0, 5, 8), 4, 32),
    ((1, 300, 2), 1, 64), ((1, 33, 1), None, 32), ((2, 64, 8), 8, 1 << 20), ((1, 31, 5), None, 32),
])
def test_roundtrip_shapes(shape, g, block):
    roundtrip(drifting(np.random.default_rng(sum(shape) + block), shape), g, block)


def test_bank_beats_one_table_per_context_when_the_scale_drifts():
    arr = drifting(np.random.default_rng(3), (4, 512, 32), block=64)
    v2 = roundtrip(arr, 8, 64)
    v1, _ = RansStage(8).encode(arr, CTX)
    assert len(v2) < 0.95 * len(v1)
    flat = np.random.default_rng(3).integers(0, 3, (1, 64, 2), dtype=np.uint8)  # tiny and stationary: one table
    assert rans.parse_banked(roundtrip(flat, None, 32), 1, 128, 64).freqs.shape[0] == 1


def test_learned_bank():
    sym = to_contexts(drifting(np.random.default_rng(4), (3, 256, 8), block=32), 4)
    freqs, table_of = model.learn_bank(sym, 128, 5)
    assert freqs.shape[0] <= 5 and table_of.shape == (6, 8) and (freqs.sum(axis=1) == 4096).all()
    assert set(np.unique(table_of)) == set(range(freqs.shape[0]))  # every table used
    hist = model.block_counts(sym, 128)
    assert not ((hist[:, : freqs.shape[1]] > 0) & (freqs[table_of.ravel()] == 0)).any()  # every symbol codable
    f2, t2 = model.learn_bank(sym, 128, 5)
    assert np.array_equal(freqs, f2) and np.array_equal(table_of, t2)
    one, t1 = model.learn_bank(sym, 128, 1)
    assert one.shape[0] == 1 and not t1.any()


def test_explicit_bank_is_checked():
    sym = np.array([[0, 1, 2, 3] * 16], np.uint8)
    good = (np.array([[1024] * 4], np.uint32), np.zeros((1, 2), np.uint8))
    rans.encode_banked(sym, 32, bank=good)
    for freqs, table_of in [
        (np.array([[2048, 2048, 0, 0]]), np.zeros((1, 2))),  # symbols 2, 3 uncodable
        (np.array([[1024] * 4, [1024] * 4]), np.zeros((1, 2))),  # table 1 unused
        (np.array([[1024] * 4]), np.ones((1, 2))),  # index out of range
        (np.array([[1024] * 4]), np.zeros((1, 3))),  # wrong block count
        (np.array([[1000] * 4]), np.zeros((1, 2))),  # sum != 4096
    ]:
        with pytest.raises(ValueError):
            rans.encode_banked(sym, 32, bank=(freqs, table_of))
    with pytest.raises(ValueError):
        rans.encode_banked(sym, 48)


def test_stage_config():
    st = stage_from_json({"name": "rans", "version": 2, "config": {"channel_group": 4, "block_tokens": 64, "tables": 3}})
    assert isinstance(st, RansBankStage) and st.get_config() == {"channel_group": 4, "block_tokens": 64, "tables": 3}
    for cfg in [{"block_tokens": 48}, {"block_tokens": 0}, {"block_tokens": True}, {"tables": 0}, {"tables": 256},
                {"tables": 2.0}, {"block_tokens": 1 << 21}]:
        with pytest.raises(KvcCodecError):
            stage_from_json({"name": "rans", "version": 2, "config": cfg})


# ----------------------------------------------------------------- golden vectors


@pytest.mark.parametrize("entry", manifest(VEC)["vectors"], ids=lambda e: e["name"])
def test_golden_vectors(entry):
    arr, data, stage = load_vector(VEC, entry, 2)
    spec = ArraySpec(arr.shape, "uint8")
    np.testing.assert_array_equal(stage.decode(data, {}, spec, CTX), arr)
    np.testing.assert_array_equal(rans.decode_reference(stage.parse(data, spec)), to_contexts(arr, stage.channel_group).ravel())
    if "bank" in entry:
        enc = rans.encode_banked(to_contexts(arr, stage.channel_group), stage.block_symbols(arr.shape),
                                 bank=(np.asarray(entry["bank"]["freqs"]), np.asarray(entry["bank"]["table_of"])))
    else:
        enc, _ = stage.encode(arr, CTX)
    assert enc == data


def test_worked_example_in_spec():
    """spec/rans-v2.md's worked example is the 'bank_tiny' vector, byte for byte."""
    spec = (VEC.parents[1] / "rans-v2.md").read_text()
    (block,) = [b.split("```", 1)[0] for b in spec.split("```hex\n")[1:]]
    hexdump = "".join(line.split("|")[0].split(":", 1)[1] for line in block.splitlines())
    assert bytes.fromhex(hexdump) == (VEC / "bank_tiny.bin").read_bytes()


# ----------------------------------------------------------------- malformed streams

SHAPE = (2, 96, 8)


@pytest.fixture(scope="module")
def good():
    arr = drifting(np.random.default_rng(9), SHAPE)
    st = RansBankStage(4, block_tokens=32, tables=4)
    return st, st.encode(arr, CTX)[0], arr


def _decode(st, data):
    return st.decode(bytes(data), {}, ArraySpec(SHAPE, "uint8"), CTX)


def _expect(st, data, words):
    with pytest.raises(KvcFormatError) as e:
        _decode(st, data)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_each_violation_is_named(good):
    st, data, _ = good
    s = st.parse(data, ArraySpec(SHAPE, "uint8"))
    K, A = s.freqs.shape
    tables_end = 8 + int(np.where(s.freqs >= 128, 2, 1).sum())
    C, nb = s.table_of.shape
    b = bytearray(data)
    _expect(st, b[:5], "shorter than its 8-byte header")
    _expect(st, struct.pack("<I", 5) + b[4:], "has 5 contexts, expected 4")
    _expect(st, b[:4] + struct.pack("<H", 0) + b[6:], "alphabet size 0")
    _expect(st, b[:6] + bytes([0]) + b[7:], "holds no table")
    _expect(st, b[:7] + bytes([1]) + b[8:], "reserved header byte")
    _expect(st, b[:6] + bytes([K + 1]) + b[7:], "")  # one table more: the layout no longer adds up
    bad = bytearray(b)
    bad[tables_end] = K  # an index past the bank
    _expect(st, bad, "not below the bank's")
    if K > 1:
        bad = bytearray(b)
        bad[tables_end: tables_end + C * nb] = bytes(C * nb)  # every block on table 0: the others unused
        _expect(st, bad, "used by no block")
    bad = bytearray(b)
    bad[tables_end + C * nb: tables_end + C * nb + 4] = struct.pack("<I", 96 * 4 + 1)
    _expect(st, bad, "words for 384 symbols")
    _expect(st, b + b"\0\0\0\0", "its header describes")
    bad = bytearray(b)
    bad[-1] ^= 0xFF if s.n_words[-1] % 2 == 0 else 0  # the last word (or padding) changes
    if bad != b:
        with pytest.raises(KvcFormatError):
            _decode(st, bad)
    with pytest.raises(KvcFormatError, match="multiple of 32"):
        rans.parse_banked(data, 4, 384, 40)


def test_every_truncation_and_many_mutations_fail_cleanly(good):
    st, data, arr = good
    for n in range(len(data)):
        with pytest.raises(KvcFormatError):
            _decode(st, data[:n])
    rng = np.random.default_rng(11)
    caught = 0
    for _ in range(3000):
        b = bytearray(data)
        for _ in range(int(rng.integers(1, 4))):
            b[int(rng.integers(0, len(b)))] ^= int(rng.integers(1, 256))
        try:
            out = _decode(st, b)
        except KvcFormatError:
            caught += 1
            continue
        assert out.shape == SHAPE and out.dtype == np.uint8  # an undetected change decodes to some array, never a crash
    assert caught > 2500


def test_v1_reader_never_accepts_a_v2_stream(good):
    """Versions are told apart by the stage's config in the container, not by the bytes: a v2 stream given to v1 is
    refused (a v1 stream given to v2 likewise), never misread."""
    st, data, _ = good
    with pytest.raises(KvcFormatError):
        RansStage(4).decode(data, {}, ArraySpec(SHAPE, "uint8"), CTX)
    v1, _ = RansStage(4).encode(good[2], CTX)
    with pytest.raises(KvcFormatError):
        _decode(st, v1)


# ----------------------------------------------------------------- the fused CPU chain


@pytest.mark.model
def test_fused_decoder_on_a_real_v2_file(tmp_path, lm):
    """A real `balanced` encode with rans v2: the fused decoder is chosen and matches the stage-by-stage decode
    chunk for chunk, and the decoded cache is the v1 file's (same symbols, other entropy coding)."""
    import kvcodec
    from kvcodec.decode import registry
    from kvcodec.texts import load_text

    text = load_text("gpl3")
    files = {}
    for blocks in (0, 32):
        files[blocks] = tmp_path / f"b{blocks}.kvc"
        kvcodec.encode(None, files[blocks], preset="balanced", model=lm, text=text, max_tokens=200,
                       overrides={"rans_blocks": blocks})
    with kvcodec.open(str(files[32])) as r, kvcodec.open(str(files[0])) as r1:
        for j in range(r.num_chunks):
            pipeline, payload, sides, sizes, spec, ctx = r.chunk_inputs(j)
            assert isinstance(pipeline.bytes_stage, RansBankStage)
            assert registry.select(pipeline, spec, "cpu")[0].name == "numba-fused"
            ref = pipeline.decode(payload, sides, sizes, spec, ctx)
            np.testing.assert_array_equal(np.asarray(r.read_chunk(j, backend="cpu")).view(np.uint16), ref.view(np.uint16))
        a, b = r.read_cache(), r1.read_cache()
        for x, y in zip(a.keys + a.values, b.keys + b.values):
            assert np.array_equal(x.numpy(), y.numpy())
    assert files[32].stat().st_size < files[0].stat().st_size
