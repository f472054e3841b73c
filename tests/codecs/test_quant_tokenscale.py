"""The ``tokenscale`` stage: bit-exact round trip, golden vectors, malformed side data, class mapping."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcodec.errors import KvcCodecError, KvcFormatError
from kvcodec.testing import vectors as V
from kvcodec.plan.importance import token_multipliers
from kvcodec.codecs.quantize import QuantizeStage
from kvcodec.codecs.tokenscale import TokenClasses, TokenScaleStage, pack_classes, unpack_classes, vector_cases
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline, stage_from_json
from kvcodec.codecs.rans import RansStage

rng = np.random.default_rng(11)
TABLE = np.exp2(-2.0 + np.arange(16)).astype(np.float32)  # powers of two: encode/decode exact


def _inputs(T, skip=0, n=16):
    """Encoder inputs (ChunkContext.encoder) with random classes for T tokens after ``skip``."""
    return {"tokenscale": TokenClasses(rng.integers(0, n, T + skip).astype(np.uint8), TABLE[:n], skip)}


@pytest.mark.parametrize("bits", [1, 2, 4, 8])
@pytest.mark.parametrize("T", [0, 1, 7, 33])
def test_pack_roundtrip(bits, T):
    c = rng.integers(0, 1 << bits, T).astype(np.uint8)
    p = pack_classes(c, bits)
    assert p.shape == (-(-T * bits // 8),) and p.dtype == np.uint8
    u = unpack_classes(p, bits, T)
    assert np.array_equal(u[:T], c) and not u[T:].any()


def test_pack_layout_lsb_first():
    assert pack_classes(np.array([1, 2, 3], np.uint8), 4).tolist() == [0x21, 0x03]
    assert pack_classes(np.array([1, 0, 3, 2, 1], np.uint8), 2).tolist() == [0b10110001, 0b01]


def test_roundtrip_exact_and_formula():
    x = rng.standard_normal((3, 40, 16)).astype(np.float32)
    st, enc = TokenScaleStage(bits=4), _inputs(40, skip=4)
    ctx = ChunkContext(token_start=10)
    y, side = st.encode(x, ChunkContext(token_start=0, encoder=enc))
    cls = enc["tokenscale"].classes[4:44]
    np.testing.assert_array_equal(y, x / TABLE[cls][None, :, None])
    out = st.decode(y, side, ArraySpec(x.shape, "float32"), ctx)
    assert np.array_equal(out, x)  # power-of-two multipliers: divide and multiply are exact
    assert np.array_equal(out, y * side["mult"][cls.astype(np.int64)][None, :, None])  # the spec formula, one rounding
    assert np.array_equal(st.multipliers(side, 40), side["mult"][cls.astype(np.int64)])
    assert side["class"].shape == (20,) and side["mult"].dtype == np.float32


def test_token_start_indexes_encoder_classes():
    st = TokenScaleStage(bits=4)
    enc = {"tokenscale": TokenClasses(np.arange(30, dtype=np.uint8) % 16, TABLE, 2)}
    x = np.ones((1, 5, 2), np.float32)
    y, side = st.encode(x, ChunkContext(token_start=20, encoder=enc))
    assert np.array_equal(unpack_classes(side["class"], 4, 5)[:5], np.arange(22, 27) % 16)


def test_pipeline_with_quantize_is_exact_and_saves_bits():
    x = rng.standard_normal((2, 256, 16)).astype(np.float32)
    st = TokenScaleStage(bits=2)
    enc = {"tokenscale": TokenClasses(np.repeat(np.array([0, 3], np.uint8), 128), np.array([1.0, 2.0, 4.0, 8.0], np.float32))}
    p_ts = Pipeline([st, QuantizeStage(mode="step", step=0.1), RansStage(channel_group=8)])
    p_u = Pipeline([QuantizeStage(mode="step", step=0.1), RansStage(channel_group=8)])
    ctx = ChunkContext(encoder=enc)
    b1, b2 = p_ts.encode(x, ctx)[0], p_u.encode(x, ctx)[0]
    assert len(b1) < 0.9 * len(b2)  # half the tokens at 8x the step
    spec = ArraySpec(x.shape, "float32")
    y, side = st.encode(x, ctx)
    q, qs = QuantizeStage(mode="step", step=0.1).encode(y, ctx)
    out = st.decode(QuantizeStage(mode="step", step=0.1).decode(q, qs, spec, ctx), side, spec, ctx)
    err = np.abs(out - x)
    assert err[:, :128].max() <= 0.0501 and err[:, 128:].max() <= 0.401  # step 0.1 rounded up to float16


def test_no_classes_is_identity():
    x = rng.standard_normal((2, 9, 4)).astype(np.float32)
    st = TokenScaleStage(bits=1)
    y, side = st.encode(x, ChunkContext())
    assert np.array_equal(y, x) and side["mult"].tolist() == [1.0]
    assert np.array_equal(st.decode(y, side, ArraySpec(x.shape, "float32"), ChunkContext()), x)


# ------------------------------------------------------------------ golden vectors
@pytest.mark.parametrize("name", sorted(vector_cases()))
def test_golden(name):
    d = V.VECTOR_DIR / name
    mfile = d / vector_cases()[name]["meta"]
    meta = json.loads(mfile.read_text())
    x, enc, dec = np.load(d / "input.npy"), np.load(d / "encoded.npy"), np.load(d / "decoded.npy")
    side = {k: np.load(d / f"side.{k}.npy") for k in meta["side"]}
    st = stage_from_json(meta["stage"])
    spec = ArraySpec(tuple(meta["spec"]["shape"]), meta["spec"]["dtype"])
    out = st.decode(enc, side, spec, ChunkContext())
    assert out.dtype == dec.dtype and np.array_equal(out.view(np.uint8), dec.view(np.uint8))
    enc_in = {}
    if "encoder" in meta:
        enc_in = {"tokenscale": TokenClasses(np.array(meta["encoder"]["classes"], np.uint8),
                                             np.array(meta["encoder"]["table"], np.float32))}
    e2, s2 = st.encode(x, ChunkContext(encoder=enc_in))
    assert np.array_equal(e2, enc) and sorted(s2) == sorted(side)
    for k in side:
        assert np.array_equal(s2[k], side[k])
    # normative formula: one float32 multiply
    cls = unpack_classes(side["class"], meta["stage"]["config"]["bits"], x.shape[1])[: x.shape[1]]
    ref = (enc.astype(np.float32) * side["mult"][cls.astype(np.int64)][None, :, None]).astype(np.float32)
    assert np.array_equal(out.view(np.uint32), ref.view(np.uint32))


def test_classes_vector_is_nontrivial():
    d = V.VECTOR_DIR / "tokenscale_classes"
    side_c, mult = np.load(d / "side.class.npy"), np.load(d / "side.mult.npy")
    assert len(set(unpack_classes(side_c, 4, 13)[:13].tolist())) > 2 and (mult != 1).any()
    x, dec = np.load(d / "input.npy"), np.load(d / "decoded.npy")
    assert not np.array_equal(x, dec)  # 11.31... is not a power of two: the round trip rounds


# ------------------------------------------------------------------ malformed side data
def _good(T=13, bits=4):
    st = TokenScaleStage(bits=bits)
    x = rng.standard_normal((2, T, 4)).astype(np.float32)
    y, side = st.encode(x, ChunkContext(encoder=_inputs(T, n=5)))
    return TokenScaleStage(bits=bits), y, side, ArraySpec(x.shape, "float32")


@pytest.mark.parametrize("mutate", [
    lambda s: s.pop("class"),
    lambda s: s.pop("mult"),
    lambda s: s.update(extra=np.zeros(1, np.uint8)),
    lambda s: s.update({"class": s["class"][:-1]}),
    lambda s: s.update({"class": s["class"].astype(np.uint16)}),
    lambda s: s.update({"class": np.full_like(s["class"], 0xFF)}),  # class 15 >= 5 entries (and padding)
    lambda s: s.update({"mult": s["mult"].astype(np.float16)}),
    lambda s: s.update({"mult": np.ones(17, np.float32)}),
    lambda s: s.update({"mult": np.ones(0, np.float32)}),
    lambda s: s.update({"mult": np.ones((5, 1), np.float32)}),
    lambda s: s.update({"mult": np.array([1, 2, np.nan, 1, 1], np.float32)}),
    lambda s: s.update({"mult": np.array([1, 2, np.inf, 1, 1], np.float32)}),
    lambda s: s.update({"mult": np.array([1, 2, 0, 1, 1], np.float32)}),
    lambda s: s.update({"mult": np.array([1, 2, -1, 1, 1], np.float32)}),
])
def test_malformed_side_data(mutate):
    st, y, side, spec = _good()
    side = dict(side)
    mutate(side)
    with pytest.raises(KvcFormatError):
        st.decode(y, side, spec, ChunkContext())


def test_nonzero_padding_rejected():
    st, y, side, spec = _good(T=13)
    c = side["class"].copy()
    c[-1] |= 0x10  # token 13 (padding) of the last byte
    with pytest.raises(KvcFormatError):
        st.decode(y, {"class": c, "mult": side["mult"]}, spec, ChunkContext())


def test_wrong_payload_rejected():
    st, y, side, spec = _good()
    with pytest.raises(KvcFormatError):
        st.decode(y.astype(np.float16), side, spec, ChunkContext())
    with pytest.raises(KvcFormatError):
        st.decode(y[:, :-1], side, spec, ChunkContext())


@pytest.mark.parametrize("bits", [0, 3, 16, True, "4"])
def test_bad_config(bits):
    with pytest.raises(KvcCodecError):
        TokenScaleStage(bits=bits)


def test_encoder_class_out_of_table():
    st = TokenScaleStage(bits=4)
    enc = {"tokenscale": TokenClasses(np.array([0, 5], np.uint8), np.ones(3, np.float32))}
    with pytest.raises(KvcCodecError):
        st.encode(np.ones((1, 2, 2), np.float32), ChunkContext(encoder=enc))


# ------------------------------------------------------------------ class mapping
def test_token_multipliers_normalised_and_monotone():
    w = np.exp(rng.standard_normal(500) * 3)
    cls, table = token_multipliers(w, sink=4, n_classes=16, log2_step=0.5, min_log2=-2.0, power=0.25, max_log2=3.0)
    assert cls.shape == (496,) and table.size == 11 and table[0] == 0.25 and table[-1] == 8.0
    m = table[cls].astype(np.float64)
    ww = w[4:]
    assert abs((ww * m * m).sum() / ww.sum() - 1) < 0.5  # equal weighted noise power (up to class rounding)
    order = np.argsort(ww)
    assert (np.diff(cls[order].astype(int)) <= 0).all()  # more important -> finer step


# ------------------------------------------------------------------ merged pipelines (issue 18's bug)
def test_equal_config_layers_keep_their_own_encoder_classes(small_cache):
    """Layers whose pipelines share one config share one header entry and here one stage object;
    each layer must still be encoded with its own token classes, which travel in the write options'
    ``encoder_inputs`` (the stage is pure configuration). Before the fix every merged layer was
    encoded with layer 0's classes (a silent quality loss)."""
    from kvcodec.format import KvcReader, encode_kvc_bytes

    L = small_cache.num_layers
    T = small_cache.keys[0].shape[1]
    table = np.array([1.0, 2.0, 4.0, 8.0], np.float32)
    shared = Pipeline([TokenScaleStage(bits=2), QuantizeStage(mode="step", step=0.05), RansStage(channel_group=8)])

    def inputs(layer: int, kind: str) -> dict:
        return {"tokenscale": TokenClasses(((np.arange(T) + layer) % 4).astype(np.uint8), table)}  # differs per layer

    data = encode_kvc_bytes(small_cache, shared, chunk_tokens=T, encoder_inputs=inputs)
    with KvcReader(data) as r:
        assert len(r.header.pipelines) == 1  # one config: merged in the header
        got = r.read_cache()
    for layer in (0, 1, L - 1):
        for kind, src, dst in (("k", small_cache.keys, got.keys), ("v", small_cache.values, got.values)):
            x = src[layer].float().numpy()
            ctx = ChunkContext(layer=layer, kind=kind, token_start=0, encoder=inputs(layer, kind))
            payload, sides, sizes = shared.encode(x, ctx)
            assert np.array_equal(sides[0]["class"], pack_classes(inputs(layer, kind)["tokenscale"].classes, 2))
            want = shared.decode(payload, sides, sizes, ArraySpec(x.shape, "float32"), ctx)
            np.testing.assert_array_equal(dst[layer].float().numpy(), want.astype(np.float32))
    # the layers' class maps differ, so a file that used one layer's classes for all would not match the above
    assert not np.array_equal(got.keys[1].float().numpy(), small_cache.keys[1].float().numpy())


def test_stages_are_immutable():
    """A stage is configuration: nothing may be attached to it after construction (encoder inputs go in ctx)."""
    from dataclasses import FrozenInstanceError

    st = TokenScaleStage(bits=2)
    with pytest.raises(FrozenInstanceError):
        st.bits = 4
    with pytest.raises(FrozenInstanceError):
        st.encoder_classes = np.zeros(3, np.uint8)
