"""The ``kvcodec`` serde inside the real lmcache 0.5.6 (its own L1 manager, ``fs`` L2 adapter, serde wrapper and
``AsyncSerdeProcessor``), on real SmolLM2 KV chunks. Runs in .venv-lmcache (``bash .ci/lmcache.sh``); skipped in a
venv without lmcache.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lmcache.v1.distributed.serde", reason="lmcache is not installed (bash .ci/lmcache.sh builds its venv)")

from lmcache.v1.distributed.api import MemoryLayoutDesc  # noqa: E402
from lmcache.v1.distributed.serde.factory import get_registered_serde_types  # noqa: E402

import kvcodec  # noqa: E402
from kvcodec.errors import KvcError  # noqa: E402
from kvcodec.integrations.lmcache import register  # noqa: E402
from kvcodec.integrations.lmcache.chunks import MAGIC, chunk_layout, unframe, upper_bound  # noqa: E402
from kvcodec.integrations.lmcache.serde import make_codec  # noqa: E402
from lmc import CHUNK, MODEL_NAME, adapter, key, layout, load, lookup, store  # noqa: E402

pytestmark = pytest.mark.model
MODELS = {MODEL_NAME: "smollm2"}


def fs_spec(path, **serde):
    return {"type": "fs", "base_path": str(path), "serde": {"type": "kvcodec", "models": MODELS, **serde}}


def test_registered_by_one_call():
    register()
    assert register() is False  # idempotent
    assert "kvcodec" in get_registered_serde_types()
    assert {"fp8"} <= set(get_registered_serde_types())  # beside LMCache's own


def test_lossless_bit_exact_through_fs(tmp_path, chunks, l1):
    register()
    _, ts = chunks
    ad = adapter(fs_spec(tmp_path), l1)
    try:
        keys = [key(0), key(1)]
        assert store(ad, l1, keys, ts)
        assert lookup(ad, keys, layout(ts[0])) == [True, True]
        hits, got = load(ad, l1, keys, ts[0])
        assert hits == [True, True]
        for a, b in zip(ts, got):
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))  # bit for bit
    finally:
        ad.close()
    files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
    assert len(files) == 2
    # the stored object is LMCache's buffer: the frame, a .kvc that kvc verify accepts, zero padding
    with open(files[0], "rb") as f:
        blob = f.read()
    assert blob[:8] == MAGIC
    out = tmp_path / "x.kvc"
    r = subprocess.run([sys.executable, "-m", "kvcodec.integrations.lmcache", "extract", files[0], str(out)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    v = subprocess.run([sys.executable, "-m", "kvcodec", "verify", str(out)], capture_output=True, text=True)
    assert v.returncode == 0, v.stdout + v.stderr
    with kvcodec.open(str(out)) as rd:
        assert rd.header.num_tokens == CHUNK and rd.header.meta["source"] == "lmcache"
    # before: the object itself as the output was replaced by its .kvc, a FIFO as the object or the output hung
    os.mkfifo(tmp_path / "fifo")
    for args in ([files[0], files[0]], [str(tmp_path / "fifo"), str(tmp_path / "y.kvc")], [files[0], str(tmp_path / "fifo")],
                 ["/dev/zero", str(tmp_path / "y.kvc")]):
        r = subprocess.run([sys.executable, "-m", "kvcodec.integrations.lmcache", "extract", *args],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    with open(files[0], "rb") as f:
        assert f.read() == blob


def test_wrong_model_or_chunk_is_a_miss(tmp_path, chunks, l1):
    """An object stored under one key and read under another (a renamed file), or of another model, is refused
    at deserialize: LMCache counts a miss, and the buffer is not filled from it."""
    register()
    _, ts = chunks
    ad = adapter(fs_spec(tmp_path), l1)
    try:
        assert store(ad, l1, [key(0)], [ts[0]])
        files = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path) for f in fs]
        src = files[0]
        # the same bytes under chunk 7's file name: the fs adapter finds it, the serde refuses it
        os.link(src, src.replace((0).to_bytes(8, "big").hex(), (7).to_bytes(8, "big").hex()))
        assert lookup(ad, [key(7)], layout(ts[0])) == [True]
        hits, got = load(ad, l1, [key(7)], ts[0])
        assert hits == [False]
        # hostile bytes in the object: a miss, never a crash
        with open(src, "r+b") as f:
            f.seek(200)
            f.write(os.urandom(4096))
        hits, _ = load(ad, l1, [key(0)], ts[0])
        assert hits == [False]
    finally:
        ad.close()


def test_deserialize_refuses_other_model_and_codec(chunks):
    _, ts = chunks
    ser, de = make_codec({"models": MODELS})
    data = ser.encode(ts[0], key(0))
    dst = torch.empty_like(ts[0])
    de.decode_into(data, dst, key(0))
    assert torch.equal(dst.view(torch.int16), ts[0].view(torch.int16))
    with pytest.raises(KvcError):
        de.decode_into(data, dst, key(1))  # another chunk
    with pytest.raises(KvcError):
        de.decode_into(data, dst, key(0, salt="tenant-b"))  # another user's salt
    with pytest.raises(KvcError):
        make_codec({"models": {"other/model": "no-such-model"}})  # at configuration
    fp8 = ts[0].to(torch.float8_e4m3fn).view(torch.uint8).reshape(-1).numpy().tobytes()
    for hostile in (b"", b"KVCLMC01", fp8, MAGIC + (1 << 60).to_bytes(8, "little") + b"x" * 64,
                    MAGIC + len(data).to_bytes(8, "little") + data[:-9] + bytes(9)):
        with pytest.raises(KvcError):
            de.decode_into(unframe(hostile), dst, key(0))


def test_another_dtype_buffer_is_a_miss(chunks):
    """LMCache's ObjectKey has no dtype: a bfloat16 chunk's object read into a float16 or float32 buffer (an engine
    serving the model in another dtype, on a shared store) is refused. Before, it was cast: a bfloat16 value past
    65504 loaded as inf in float16."""
    _, ts = chunks
    big = ts[0].clone()
    big[0, 0, 0, 0] = 1e30
    # near-lossless on the second chunk: found at offset 32, re-based, its header says float32
    for preset, t in (("lossless", big), ("near-lossless", ts[1])):
        ser, de = make_codec({"models": MODELS, "preset": preset})
        data = ser.encode(t, key(0))
        with kvcodec.open(data) as r:
            assert (r.header.meta.get("rope_offset", 0) > 0) == (preset != "lossless")
        for dt in (torch.float16, torch.float32):
            with pytest.raises(KvcError, match="values, the buffer is"):
                de.decode_into(data, torch.zeros(t.shape, dtype=dt), key(0))
        out = torch.empty_like(t)
        de.decode_into(data, out, key(0))
        if preset == "lossless":
            assert torch.equal(out.view(torch.int16), t.view(torch.int16))


@pytest.mark.parametrize("shape,dtype", [((30, 32, 192), torch.bfloat16), ((2, 30, 32, 192), torch.int8),
                                         ((3, 30, 32, 192), torch.bfloat16), ((2, 30, 32), torch.float16)])
def test_unsupported_layouts_refused_in_one_line(shape, dtype):
    ser, _ = make_codec({"models": MODELS})
    with pytest.raises(KvcError) as e:
        ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[dtype]))
    assert "\n" not in str(e.value)
    with pytest.raises(KvcError):  # two kernel groups in one object
        ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[torch.Size((2, 30, 32, 192))] * 2,
                                                      dtypes=[torch.bfloat16] * 2))


def test_bad_options_refused_at_configuration():
    for bad in ({"preset": "nope"}, {"pad": "yes"}, {"verify": 1}, {"max_workers": 0}, {"colour": 1},
                {"models": ["smollm2"]}, {"rope_offset": "guess"}, {"rope_offset": 0}):
        with pytest.raises(KvcError):
            make_codec({"models": MODELS, **bad})


@pytest.mark.parametrize("bad", [
    {"overrides": {"step0": -0.1}}, {"overrides": {"step0": "0.12"}}, {"overrides": {"step0": float("nan")}},
    {"overrides": {"colour": 1}}, {"overrides": [0.12]}, {"overrides": {"sink": -1}},
    {"preset": "lossless", "overrides": {"step0": 0.12}},  # lossless takes no step
])
def test_bad_overrides_refused_at_configuration(bad):
    """A bad ``overrides`` is one KvcError line when the serde is built (make_codec, and LMCache's own factory from
    an adapter's serde dict), before any chunk is stored."""
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    register()
    spec = {"models": MODELS, "preset": "faithful", **bad}
    with pytest.raises(KvcError) as e:
        make_codec(spec)
    assert "\n" not in str(e.value) and "overrides" in str(e.value)
    with pytest.raises(KvcError):
        create_serde_processor(SerdeConfig("kvcodec", spec))


class _Obj:  # LMCache's MemoryObj as the serializer sees it: a tensor
    def __init__(self, tensor):
        self.tensor = tensor


def _round_trip(spec, t):
    """(serialized bytes, decoded chunk) of chunk ``t`` through the serde built from ``spec``."""
    ser, de = make_codec(spec)
    dst = _Obj(torch.zeros(ser.estimate_serialized_size(layout(t)), dtype=torch.uint8))
    n = ser.serialize(_Obj(t), dst, key(0))
    back = _Obj(torch.full_like(t, float("nan")))
    de.deserialize(_Obj(dst.tensor[:n].clone()), back, key(0))
    return dst.tensor[:n].clone(), back.tensor


def test_overrides_step_round_trips(chunks):
    """``overrides: {"step0": X}`` reaches the encoder: a coarser step than faithful's is fewer bytes and a larger
    error, and the object decodes through the deserializer, which needs no overrides (the steps are in the `.kvc`)."""
    _, ts = chunks
    base = {"models": MODELS, "preset": "faithful", "pad": False}
    got = {s: _round_trip({**base, "overrides": {"step0": s}} if s else base, ts[0]) for s in (None, 0.2)}
    err = {s: float((b.float() - ts[0].float()).abs().mean()) for s, (_, b) in got.items()}
    assert all(torch.isfinite(b).all() for _, b in got.values())
    assert len(got[0.2][0]) < len(got[None][0]) and err[0.2] > err[None]
    assert err[0.2] < 0.2  # within the step: decoded, not garbage
    # and a deserializer built without the overrides (another LMCache process) decodes it the same
    _, de = make_codec(base)
    back = _Obj(torch.full_like(ts[0], float("nan")))
    de.deserialize(_Obj(got[0.2][0]), back, key(0))
    assert torch.equal(back.tensor.view(torch.int16), got[0.2][1].view(torch.int16))


def test_rope_offset_found_recorded_and_undone(chunks):
    """``rope_offset: search`` (the default) finds the second chunk's true start (CHUNK) from its keys alone, records
    it in the `.kvc`, and the deserializer rotates the keys back: the chunk comes back as close as with ``zero``, in
    no more bytes; the first chunk (offset 0) is encoded as before, byte for byte."""
    _, ts = chunks
    base = {"models": MODELS, "preset": "faithful", "pad": False}
    for i, t in enumerate(ts):
        data, back = _round_trip(base, t)
        zdata, zback = _round_trip({**base, "rope_offset": "zero"}, t)
        with kvcodec.open(unframe(data.numpy().tobytes())) as r:
            assert r.header.meta.get("rope_offset", 0) == i * CHUNK
        err, zerr = ((b.float() - t.float()).pow(2).mean().item() for b in (back, zback))
        assert torch.isfinite(back).all() and err <= 1.5 * zerr
        if i == 0:
            assert torch.equal(data, zdata)
        else:
            assert len(data) < len(zdata)


@pytest.mark.parametrize("preset", ["lossless", "zstd", "balanced", "small"])
def test_estimate_is_an_upper_bound(preset, chunks):
    """Real chunks and incompressible ones (uniform random bits in every value for the lossless presets; wide
    Gaussian noise, no structure, for the lossy ones), in every preset: the output never exceeds the estimate."""
    _, ts = chunks
    ser, _ = make_codec({"models": MODELS, "preset": preset, "pad": False})
    g = torch.Generator().manual_seed(1)
    bits = torch.randint(-(1 << 15), 1 << 15, ts[0].shape, generator=g, dtype=torch.int32).to(torch.int16)
    bits = bits.view(torch.bfloat16).clone()
    bits[bits.isnan() | bits.isinf()] = 1.0
    gauss = (torch.randn(ts[0].shape, generator=g) * 50).to(torch.bfloat16)
    lossy = preset in ("balanced", "small")

    class Obj:  # LMCache's MemoryObj as the serializer sees it: a tensor
        def __init__(self, tensor):
            self.tensor = tensor

    for t in (ts[0], gauss if lossy else bits):
        est = ser.estimate_serialized_size(layout(t))
        assert est == upper_bound(chunk_layout([t.shape], [t.dtype]), ser._any_fingerprint())
        dst = Obj(torch.zeros(est, dtype=torch.uint8))  # a buffer of exactly the estimate, as LMCache allocates
        n = ser.serialize(Obj(t), dst, key(0))
        assert 0 < n <= est
    if lossy:  # values no lossy code can hold (up to 3e38): stored lossless (kvcodec.integrations.fidelity), in bound
        n = ser.serialize(Obj(bits), Obj(torch.zeros(est, dtype=torch.uint8)), key(0))
        assert 0 < n <= est


def _kl(lm, cache, restored, ids):
    """Mean KL(original || restored) of the next-token distributions over ``ids`` continued from each cache."""
    outs = []
    for c in (cache, restored):
        with torch.no_grad():
            out = lm.model(input_ids=torch.as_tensor(ids)[None], past_key_values=c.to_dynamic_cache(torch.float32),
                           use_cache=True)
        outs.append(torch.log_softmax(out.logits[0].float(), -1))
    p, q = outs
    return float((p.exp() * (p - q)).sum(-1).mean())


@pytest.mark.parametrize("preset", [
    "near-lossless",
    # Measured 2.8e-2 against the promise's 1e-2 (issue 54): LMCache's server has no model, so the serde encodes at
    # the preset's fixed step without rate control (the whole 64-token cache, encoded the same way: 1.8e-2; with
    # the model: 8.6e-3), and each chunk is a context of its own. Strict: this fails once the promise holds.
    pytest.param("balanced", marks=pytest.mark.xfail(strict=True, reason="no rate control without the model (issue 54)")),
])
def test_lossy_within_promise(preset, tmp_path, chunks, l1, lm):
    """The restored chunks, put back together, continue the text within the preset's KL promise."""
    from kvcodec.core.kvcache import KVCache
    from kvcodec.models.capture import tokenize
    from kvcodec.plan.presets import preset_info
    from kvcodec.texts import load_text

    register()
    cache, ts = chunks
    ad = adapter(fs_spec(tmp_path, preset=preset), l1)
    try:
        keys = [key(0), key(1)]
        assert store(ad, l1, keys, ts)
        hits, got = load(ad, l1, keys, ts[0])
    finally:
        ad.close()
    assert hits == [True, True]
    fp = lm.fingerprint
    h, d = fp.num_kv_heads, fp.head_dims[0]

    def as_cache(chunk_list):
        ks = [torch.cat([c[0, i].reshape(CHUNK, h, d).transpose(0, 1) for c in chunk_list], 1).float() for i in range(fp.num_layers)]
        vs = [torch.cat([c[1, i].reshape(CHUNK, h, d).transpose(0, 1) for c in chunk_list], 1).float() for i in range(fp.num_layers)]
        return KVCache(ks, vs, cache.token_ids, fp)

    ids = tokenize(lm.tokenizer, load_text("gpl3"))[2 * CHUNK:2 * CHUNK + 32]
    kl = _kl(lm, as_cache(ts), as_cache(got), ids)
    promise = preset_info(preset).target
    assert promise is not None
    print(f"{preset}: KL {kl:.2e} (promise {promise.kl})")
    assert kl <= promise.kl  # NaN (a buffer the load left unfilled: load() NaN-fills first) fails too


def _degenerate(t):
    zeros = torch.zeros_like(t)
    const = torch.full_like(t, 3.0)
    huge = (torch.randn(t.shape, generator=torch.Generator().manual_seed(2)) * 1e4).to(t.dtype)
    outlier = zeros.clone()
    outlier[0, 3, 5, 7] = 5000.0
    nan, past = zeros.clone(), zeros.clone()  # ones the lossy codec refuses: before, not stored at all
    nan[1, 2, 3, 4] = float("nan")
    past[0, 1, 2, 3] = 1e38  # past what float16 steps reach
    return {"zeros": zeros, "constant": const, "huge": huge, "one-outlier": outlier, "nan": nan, "past-fp16": past}


@pytest.mark.parametrize("preset", ["balanced", "faithful"])
def test_a_chunk_unlike_the_models_kv_is_stored_lossless(preset, chunks):
    """Before: a lossy preset decoded an all-zero chunk with errors up to 2.2 (the calibration's mean outside the
    kept PCA coefficients came back), a constant one, one of values near 1e4 and one hot outlier with errors far
    past the preset's step, silently. Now such a chunk is stored lossless (bit-exact), the decision in the `.kvc`'s
    meta; the real chunks keep their lossy bytes, the same as with the check off."""
    from kvcodec.integrations import fidelity

    _, ts = chunks
    base = {"models": MODELS, "preset": preset, "pad": False}
    for name, t in _degenerate(ts[0]).items():
        data, back = _round_trip(base, t)
        assert torch.equal(back.view(torch.int16), t.view(torch.int16)), name
        with kvcodec.open(unframe(data.numpy().tobytes()), max_decoded_ratio=0) as r:
            assert r.header.meta["fallback_from"] == preset and r.header.codec == "lossless", name
    ser, _ = make_codec(base)
    real = [ser.encode(t, key(0)) for t in ts]
    orig = fidelity.misfit
    fidelity.misfit = lambda *a: None  # the check off: the plain lossy bytes
    try:
        assert real == [ser.encode(t, key(0)) for t in ts]
    finally:
        fidelity.misfit = orig


def test_a_lossless_chunk_of_zeros_loads(chunks):
    """A zero chunk is a few KB lossless for megabytes of K/V: the reader's default ratio limit (256x the file)
    refused it at every load (a miss for ever). The buffer bounds what the object may declare instead."""
    _, ts = chunks
    z = torch.zeros(2, ts[0].shape[1], 256, ts[0].shape[3], dtype=ts[0].dtype)  # 256 tokens
    data, back = _round_trip({"models": MODELS, "pad": False}, z)
    assert len(data) * 256 < z.numel() * 4 and torch.equal(back.view(torch.int16), z.view(torch.int16))


def test_buffers_without_memory_or_sharing_it_are_refused(chunks):
    """Before: a destination chunk whose K and V planes share memory (``expand``) got V written over K and the load
    reported success; a ``meta`` destination "loaded" with nothing written; a ``meta`` source and a non-contiguous
    float destination buffer escaped as NotImplementedError / RuntimeError. Now each is one KvcError line, and a
    strided destination whose elements are distinct (a permutation, a slice) is written correctly."""
    _, ts = chunks
    t = ts[0]
    ser, de = make_codec({"models": MODELS, "pad": False})
    buf = torch.zeros(ser.estimate_serialized_size(layout(t)), dtype=torch.uint8)
    n = ser.serialize(_Obj(t), _Obj(buf), key(0))
    src = _Obj(buf[:n].clone())
    L, T, W = t.shape[1:]
    for dst in (torch.empty(T, L, 2, W, dtype=t.dtype).permute(2, 1, 0, 3),
                torch.empty(2, L, T, 2 * W, dtype=t.dtype)[..., ::2]):
        de.deserialize(src, _Obj(dst), key(0))
        assert torch.equal(dst.contiguous().view(torch.int16), t.view(torch.int16))
    for dst in (torch.zeros(1, L, T, W, dtype=t.dtype).expand(2, -1, -1, -1),
                torch.empty(t.shape, dtype=t.dtype, device="meta")):
        with pytest.raises(KvcError) as e:
            de.deserialize(src, _Obj(dst), key(0))
        assert "\n" not in str(e.value)
    for s, d in ((torch.empty(t.shape, dtype=t.dtype, device="meta"), buf.clone()),
                 (t, torch.zeros(buf.numel() // 4 + 1, 2, dtype=torch.float32)[:, 0])):
        with pytest.raises(KvcError):
            ser.serialize(_Obj(s), _Obj(d), key(0))


def test_another_presets_object_is_a_miss(chunks):
    """LMCache's ``fs`` adapter names an object by its key alone: a deployment switched from ``small`` to
    ``lossless`` on the same path served the old ``small`` objects (errors up to 5) as lossless ones. Now an object
    records its serde's preset and another preset's is refused (objects from before: their header's codec), while
    another step of the same preset and the exact ``raw`` fallback still load."""
    from kvcodec.integrations.lmcache.chunks import key_meta, to_cache

    _, ts = chunks
    t = ts[0]
    small, _ = make_codec({"models": MODELS, "preset": "small"})
    _, lossless = make_codec({"models": MODELS})
    out = torch.empty_like(t)
    with pytest.raises(KvcError, match="preset 'small'"):
        lossless.decode_into(small.encode(t, key(0)), out, key(0))
    fp = small.resolver.fingerprint(MODEL_NAME)
    old = kvcodec.encode(to_cache(t, fp, key_meta(key(0))), None, preset="small",
                         calibration=small.resolver.calibration(MODEL_NAME)).data  # no serde_preset
    with pytest.raises(KvcError, match="preset 'small'"):
        lossless.decode_into(old, out, key(0))
    raw = kvcodec.encode(to_cache(t, fp, key_meta(key(0))), None, preset="raw").data
    for de in (lossless, make_codec({"models": MODELS, "preset": "small"})[1]):
        de.decode_into(raw, out, key(0))
        assert torch.equal(out.view(torch.int16), t.view(torch.int16))
    ser, _ = make_codec({"models": MODELS})
    lossless.decode_into(ser.encode(t, key(0)), out, key(0))
    assert torch.equal(out.view(torch.int16), t.view(torch.int16))
