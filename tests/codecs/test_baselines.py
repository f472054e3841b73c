"""Baselines are real .kvc encoders that reconstruct exactly what their published scheme specifies.

Every decoded tensor is compared bit for bit with an independent numpy
implementation of the baseline's quantize-dequantize (written here with
explicit group loops, not the stage's vectorised code), on a real capture
written to and read back from a real .kvc file.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.plan.baselines import BASELINES, get_baseline_plan
from kvcodec.plan.baseline_plans import cachegen_bins
from kvcodec.codecs.baselines import CacheGenStage, KiviStage, pack_bits, renorm_cdf, unpack_bits
from kvcodec.errors import KvcFormatError, KvcInputError
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline

N_TOKENS = 200  # > 128 fp16 recent values (72 quantized = 2 full groups + a partial one); keys: 128 quantized, 72 fp16


@pytest.fixture(scope="module")
def cache(lm, gpl3_ids):
    from kvcodec.models.capture import capture

    return capture(lm, token_ids=gpl3_ids[:N_TOKENS])


@pytest.fixture(scope="module")
def files(cache, tmp_path_factory):
    """Every baseline written to a real .kvc file and read back: name -> (path, decoded cache)."""
    from kvcodec.eval.curve import read_kvc_cache
    from kvcodec.format import write_kvc

    d = tmp_path_factory.mktemp("baselines")
    out = {}
    for name in BASELINES:
        plan = get_baseline_plan(name, cache)
        path = d / f"{name}.kvc"
        n = write_kvc(cache, path, plan)
        assert n == path.stat().st_size
        out[name] = (path, read_kvc_cache(path))
    return out


def tensors(c):
    for layer in range(c.num_layers):
        yield layer, "k", c.keys[layer].numpy()
        yield layer, "v", c.values[layer].numpy()


# -- independent reference implementations ---------------------------------------------------
def ref_fp16(x):
    return x.astype(np.float16).astype(np.float32)


def ref_int8(x):
    H, T, D = x.shape
    out = np.zeros_like(x, dtype=np.float32)
    for h in range(H):
        for t in range(T):
            row = x[h, t].astype(np.float32)
            s = np.float32(np.float16(np.abs(row).max() / np.float32(127)))
            if s == 0:
                continue
            q = np.clip(np.rint(row / s), -127, 127)
            out[h, t] = q.astype(np.float32) * s
    return out


def _minmax_qdq(g, bits):
    """Asymmetric min/max quantize-dequantize of one group (any shape), fp16 scale and zero."""
    L = np.float32(2**bits - 1)
    mn, mx = g.min(), g.max()
    s = np.float32(np.float16((mx - mn) / L))
    z = np.float32(np.float16(mn))
    if s == 0:
        return np.full(g.shape, z, np.float32)
    q = np.clip(np.rint((g - z) / s), 0, L)
    return q.astype(np.float32) * s + z


def ref_kivi(x, bits, kind, group=32, residual=128, layout="code"):
    """KIVI's code: keys quantized in whole blocks of `residual` tokens (the last T % residual fp16), the last
    `residual` values fp16; layout "window": the last `residual` tokens of both fp16."""
    H, T, D = x.shape
    x = x.astype(np.float32)
    tq = T - T % residual if (layout == "code" and kind == "k") else max(T - residual, 0)
    out = np.empty_like(x)
    out[:, tq:] = ref_fp16(x[:, tq:])
    for h in range(H):
        if kind == "k":  # per channel, groups of `group` tokens
            for d in range(D):
                for t0 in range(0, tq, group):
                    out[h, t0 : min(t0 + group, tq), d] = _minmax_qdq(x[h, t0 : min(t0 + group, tq), d], bits)
        else:  # per token, groups of `group` channels
            for t in range(tq):
                for d0 in range(0, D, group):
                    out[h, t, d0 : d0 + group] = _minmax_qdq(x[h, t, d0 : d0 + group], bits)
    return out


def ref_cachegen(x, bins):
    H, T, D = x.shape
    mx = np.float32(bins // 2 - 1)
    out = np.empty((H, T, D), np.float32)
    for t in range(T):
        tok = x[:, t, :].astype(np.float32)  # all heads and channels of this token share one scale
        s = np.float32(np.float16(np.abs(tok).max()))
        if s == 0:
            out[:, t, :] = 0
            continue
        q = np.clip(np.rint(tok * (mx / s) + mx), 0, 2 * mx)
        out[:, t, :] = (q - mx) / mx * s
    return out


# -- round trips through real files ----------------------------------------------------------
@pytest.mark.model
@pytest.mark.parametrize("name", ["fp16", "fp16+zstd", "int8", "kivi2", "kivi4", "kivi2-window", "cachegen", "cachegen-ctx"])
def test_decode_equals_reference(name, cache, files):
    _, dec = files[name]
    L = cache.num_layers
    for (layer, kind, x), (_, _, y) in zip(tensors(cache), tensors(dec)):
        if name in ("fp16", "fp16+zstd"):
            want = ref_fp16(x)
        elif name == "int8":
            want = ref_int8(x)
        elif name.startswith("kivi"):
            want = ref_kivi(x, int(name[4]), kind, layout="window" if name.endswith("window") else "code")
        else:
            want = ref_cachegen(x, cachegen_bins(layer, kind, L))  # the table granularity changes only the coding
        assert y.dtype == np.float32 and y.shape == x.shape
        np.testing.assert_array_equal(y, want, err_msg=f"{name} layer {layer} {kind}")


@pytest.mark.model
@pytest.mark.parametrize("name", ["kivi2", "kivi4"])
def test_kivi_fp16_tokens_as_kivis_code(name, cache, files):
    """The last 128 values and the last 200 % 128 = 72 keys are fp16; everything older is quantized."""
    _, dec = files[name]
    for (_, kind, x), (_, _, y) in zip(tensors(cache), tensors(dec)):
        n = 128 if kind == "v" else N_TOKENS % 128
        np.testing.assert_array_equal(y[:, -n:], ref_fp16(x[:, -n:]))
        assert not np.array_equal(y[:, :-n], ref_fp16(x[:, :-n]))  # the older tokens really are quantized


@pytest.mark.model
def test_sizes_are_real_file_bytes(cache, files):
    from kvcodec.eval.curve import rate_fields
    from kvcodec.format import KvcReader

    sizes = {}
    for name, (path, _) in files.items():
        with KvcReader(str(path)) as r:
            assert r.sizes()["file"] == path.stat().st_size
            assert r.header.codec == f"baseline:{name}"
        sizes[name] = rate_fields(path.stat().st_size, cache)["bits_per_element"]
    # the payloads alone set floors the real files must exceed (headers, side data, index on top)
    assert sizes["fp16"] > 16.0
    assert sizes["fp16+zstd"] < sizes["fp16"]
    assert 8.25 < sizes["int8"] < 9.0  # 8 bits + a 16-bit scale per 64 channels
    # KIVI: values 128 fp16 tokens of 200, keys 72; the others at b bits + fp16 scale/zero per group of 32
    for b in (2, 4):
        floor = ((128 + 72) * 16 + (72 + 128) * (b + 2 * 16 / 32)) / (2 * N_TOKENS)
        assert floor < sizes[f"kivi{b}"] < floor + 0.5
        assert sizes[f"kivi{b}"] < sizes[f"kivi{b}-window"]
    # CacheGen: the 33-entry int16 CDF per channel alone costs 33*16/200 bits per element here
    assert sizes["cachegen"] > 33 * 16 / N_TOKENS
    assert sizes["cachegen-lo"] < sizes["cachegen"] < sizes["cachegen-hi"]
    assert sizes["cachegen-ctx"] <= sizes["cachegen"]  # one table per context (200 tokens < 256: one table both ways)


@pytest.mark.model
def test_cachegen_stream_is_a_real_range_code(cache):
    """Payload = range-coded symbols: >= their ideal code length under the stored CDF, within the per-stream flush."""
    x = cache.keys[3].numpy()
    st = CacheGenStage(bins=32)
    data, side = st.encode(x, ChunkContext(layer=3, kind="k"))
    from kvcodec.codecs.baselines import cachegen_quant

    q, _ = cachegen_quant(x, 32)
    cdf = side["cdf"].view(np.uint16).astype(np.int64)
    cdf[..., -1] += 1 << 16
    assert side["cdf"].shape == (1, x.shape[0] * x.shape[2], 33) and side["cdf"].dtype == np.int16
    freq = np.diff(cdf[0], axis=-1)  # (C, 32)
    ideal = -np.log2(freq[np.arange(q.shape[1])[None, :], q] / 65536.0).sum()
    n_streams = side["length"].size
    assert ideal <= len(data) * 8 <= ideal + 64 * n_streams
    np.testing.assert_array_equal(side["length"].sum() * 4, len(data))
    # the stored CDF is LMCache's renormalised histogram of each channel's symbols
    hist = np.stack([np.bincount(q[:, c], minlength=32) for c in range(q.shape[1])])
    np.testing.assert_array_equal(cdf[0], renorm_cdf(hist))


# -- stage-level edge cases (synthetic data) ---------------------------------------------------
@pytest.mark.parametrize("bits", [1, 2, 4, 8])
def test_pack_bits_roundtrip(bits):
    rng = np.random.default_rng(bits)
    for n in (0, 1, 7, 8, 33, 1000):
        q = rng.integers(0, 2**bits, n).astype(np.uint8)
        data = pack_bits(q, bits)
        assert len(data) == -(-n * bits // 8)
        np.testing.assert_array_equal(unpack_bits(data, bits, n), q)


def _roundtrip(stages, x, layer=0, kind="k"):
    p = Pipeline(stages)
    ctx = ChunkContext(layer=layer, kind=kind)
    data, sides, sizes = p.encode(x, ctx)
    return p.decode(data, sides, sizes, ArraySpec(x.shape, str(x.dtype)), ctx)


@pytest.mark.parametrize("T", [1, 31, 128, 129, 161, 300])
@pytest.mark.parametrize("mode", ["key", "value"])
def test_kivi_shapes_and_constant_groups(T, mode):
    rng = np.random.default_rng(T)
    x = rng.standard_normal((2, T, 64)).astype(np.float32)
    x[:, : min(T, 40), :5] = 0.5  # constant groups: scale 0, decode to the zero point
    for layout in ("code", "window"):
        y = _roundtrip([KiviStage(2, mode, layout=layout)], x, kind="k" if mode == "key" else "v")
        np.testing.assert_array_equal(y, ref_kivi(x, 2, "k" if mode == "key" else "v", layout=layout))


def test_int8_and_cachegen_zero_rows():
    from kvcodec.codecs.baselines import Int8TokenStage
    from kvcodec.core.stage import stage_from_json

    x = np.random.default_rng(0).standard_normal((3, 300, 64)).astype(np.float32)
    x[:, 5] = 0.0
    y = _roundtrip([Int8TokenStage(), stage_from_json({"name": "raw"})], x)
    np.testing.assert_array_equal(y, ref_int8(x))
    y = _roundtrip([CacheGenStage(bins=16)], x)
    np.testing.assert_array_equal(y, ref_cachegen(x, 16))
    assert not y[:, 5].any()


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf, 1e30])
def test_a_value_the_baselines_cannot_code_is_refused(bad):
    """One NaN, inf or 1e30 made every other value of its token (int8, cachegen) NaN in the decoded file, silently;
    the codec presets already refused such input."""
    from kvcodec.codecs.baselines import Int8TokenStage
    from kvcodec.errors import KvcCodecError

    x = np.random.default_rng(0).standard_normal((2, 40, 8)).astype(np.float32)
    x[1, 7, 3] = bad
    for st in (Int8TokenStage(), KiviStage(bits=2, group=32, residual=0, mode="key"), CacheGenStage(bins=16)):
        with pytest.raises(KvcCodecError, match="NaN or inf|overflows"):
            st.encode(x, ChunkContext())


def test_cachegen_layer_split_is_lmcache_literal():
    L = 30
    assert [cachegen_bins(l, "k", L) for l in (0, 9, 10, 29)] == [32, 32, 16, 16]
    assert [cachegen_bins(l, "v", L) for l in (0, 1, 2, 29)] == [32, 32, 16, 16]
    assert cachegen_bins(9, "k", L, split="proportional") == 16  # round(10 * 30 / 32) = 9 layers at 32 bins


def test_corrupt_cachegen_stream_is_a_format_error():
    x = np.random.default_rng(1).standard_normal((1, 40, 8)).astype(np.float32)
    st = CacheGenStage(bins=32)
    ctx = ChunkContext()
    data, side = st.encode(x, ctx)
    with pytest.raises(KvcFormatError):
        st.decode(data[:-4], side, ArraySpec(x.shape, "float32"), ctx)
    bad = dict(side, cdf=np.zeros_like(side["cdf"]))
    with pytest.raises(KvcFormatError):
        st.decode(data, bad, ArraySpec(x.shape, "float32"), ctx)


def test_unknown_baseline_is_an_input_error(small_cache):
    with pytest.raises(KvcInputError, match="unknown baseline"):
        get_baseline_plan("kivi3", small_cache)
