"""Bit-exact round trips capture -> .kvc -> read on real KV, from every kind of byte source."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelMismatchError, KvcBackendError
from kvcodec.format import (
    ExternalAttachment, KvcReader, encode_kvc_bytes, lossless_pipeline, raw_pipeline, read_kvc, write_kvc,
)
from kvcodec.decode.device import resolve_device
from kvcodec.plan.presets import get_plan
from kvcodec.core.kvcache import KVCache

from formatutil import RangeObj, assert_same_cache, synthetic_cache  # noqa: E402

PIPES = {
    "raw": lambda dt: raw_pipeline(dt),
    "lossless": lambda dt: lossless_pipeline(dt),
    "zstd": lambda dt: lossless_pipeline(dt, shuffle=False),
}


def _dt(cache: KVCache) -> str:
    return str(cache.dtype).removeprefix("torch.")


@pytest.mark.model
@pytest.mark.parametrize("pipe", sorted(PIPES))
@pytest.mark.parametrize("n", [64, 200])
def test_real_roundtrip_whole_layer_chunk(real_cache, pipe, n):
    cache = real_cache(n)
    p = PIPES[pipe](_dt(cache))
    data = encode_kvc_bytes(cache, p, chunk_tokens=48 if n == 200 else None, preset=pipe)
    with KvcReader(data) as r:
        assert r.fingerprint == cache.fingerprint
        assert np.array_equal(r.token_ids, cache.token_ids)
        back = r.read_cache()
        assert_same_cache(back, cache)
        for i in (0, 13, cache.num_layers - 1):
            k, v = r.read_layer(i)
            assert torch.equal(k, cache.keys[i]) and torch.equal(v, cache.values[i])
            assert k.dtype == cache.keys[i].dtype
        for j, e in enumerate(r.entries):
            src = (cache.keys if e.kind == "k" else cache.values)[e.layer]
            want = src[e.head_start : e.head_end, e.token_start : e.token_end].numpy()
            got = r.read_chunk(j)
            assert got.dtype == want.dtype and np.array_equal(got.view(np.uint8), want.view(np.uint8))
        assert [i for i, _, _ in r.iter_layers()] == list(range(cache.num_layers))


@pytest.mark.model
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_real_roundtrip_half_dtypes_head_chunks(real_cache, dtype):
    cache = real_cache(64).to(dtype)
    for pipe in ("raw", "lossless"):
        data = encode_kvc_bytes(cache, PIPES[pipe](_dt(cache)), chunk_tokens=20, chunk_heads=2)
        with KvcReader(data) as r:
            assert_same_cache(r.read_cache(), cache)
            assert r.header.dtype == _dt(cache)
            assert len(r.entries) == cache.num_layers * 2 * 4 * 2


@pytest.mark.model
def test_sources_bytes_path_fileobj_range(real_cache, tmp_path):
    cache = real_cache(64)
    path = tmp_path / "c.kvc"
    n = write_kvc(cache, path, lossless_pipeline("float32"), preset="lossless")
    data = path.read_bytes()
    assert n == len(data)
    ref = read_kvc(data)
    assert_same_cache(ref, cache)
    for src in (path, str(path), bytearray(data), memoryview(data)):
        assert_same_cache(read_kvc(src), cache)
    with open(path, "rb") as f:
        assert_same_cache(read_kvc(f), cache)
    assert_same_cache(read_kvc(io.BytesIO(data)), cache)
    rng = RangeObj(data)
    with KvcReader(rng) as r:
        opened = rng.calls
        k, v = r.read_layer(0)
        assert torch.equal(k, cache.keys[0])
    # opening needs at most 3 reads (preamble, tail with footer+index, header); layer 0 then reads only its chunks
    assert opened <= 3
    assert_same_cache(read_kvc(RangeObj(data)), cache)


@pytest.mark.model
def test_layer0_touches_only_its_bytes(real_cache):
    cache = real_cache(64)
    data = encode_kvc_bytes(cache, lossless_pipeline("float32"))
    rng = RangeObj(data)
    with KvcReader(rng) as r:
        before = len(rng.touched)
        r.read_layer(0)
        chunk_reads = rng.touched[before:]
        e0, e1 = r.entries[0], r.entries[1]
        lo, hi = r.header.data_start + e0.offset, r.header.data_start + e1.offset + e1.length
    blob_end = r.header.data_start + r.header.blobs[-1].offset + r.header.blobs[-1].length
    assert all((lo <= a and b <= hi) or b <= blob_end for a, b in chunk_reads)


@pytest.mark.model
def test_model_continues_identically_after_roundtrip(lm, real_cache):
    cache = real_cache(64)
    data = encode_kvc_bytes(cache, lossless_pipeline("float32"))
    back = read_kvc(data, model=lm)
    nxt = torch.tensor([[int(cache.token_ids[-1])]])
    pos = torch.tensor([[cache.num_context_tokens]])
    with torch.inference_mode():
        a = lm.model(input_ids=nxt, past_key_values=cache.to_dynamic_cache(), position_ids=pos, use_cache=True).logits
        b = lm.model(input_ids=nxt, past_key_values=back.to_dynamic_cache(), position_ids=pos, use_cache=True).logits
    assert torch.equal(a, b)


@pytest.mark.model
def test_model_mismatch_is_refused(real_cache):
    cache = real_cache(64)
    data = encode_kvc_bytes(cache, raw_pipeline("float32"))
    other = synthetic_cache().fingerprint
    with KvcReader(data) as r:
        with pytest.raises(KvcModelMismatchError):
            r.read_cache(model=other)
        with pytest.raises(KvcModelMismatchError):
            r.check_model(other)


def test_synthetic_roundtrip_positions_attachments_hash_only():
    pos3 = np.tile(np.array([0, 3, 5, 6, 9])[None, None], (2, 2, 1))
    for positions in (None, np.array([1, 2, 4, 8, 9]), pos3):
        c = synthetic_cache(torch.float32, T=5, n_ctx=5 if positions is None else 10, positions=positions)
        att = {"pca/k": np.arange(16, dtype=np.float64).reshape(4, 4), "z": np.ones(3, np.int8)}
        data = encode_kvc_bytes(c, lossless_pipeline("float32"), attachments=att, chunk_tokens=2, meta={"x": [1, 2]})
        with KvcReader(data) as r:
            assert_same_cache(r.read_cache(), c)
            assert r.header.meta["x"] == [1, 2]
            assert set(r.attachments) == {"pca/k", "z"}
            assert np.array_equal(r.attachments["pca/k"], att["pca/k"])
            if positions is not None:
                assert np.array_equal(r.positions, positions) and r.header.pruned
    data = encode_kvc_bytes(c, raw_pipeline("float32"), store_token_ids=False)
    with KvcReader(data) as r:
        assert r.token_ids is None
        with pytest.raises(KvcInputError):
            r.read_cache()
        with pytest.raises(KvcInputError):
            r.read_cache(token_ids=c.token_ids + 1)
        assert_same_cache(r.read_cache(token_ids=c.token_ids), c)


def test_external_attachment_resolution():
    c = synthetic_cache()
    arr = np.linspace(0, 1, 12, dtype=np.float32).reshape(3, 4)
    data = encode_kvc_bytes(c, raw_pipeline("float16"), attachments={"calib": ExternalAttachment.of(arr)})
    assert arr.tobytes() not in data
    with KvcReader(data) as r:
        with pytest.raises(KvcFormatError, match="calib"):
            r.read_chunk(0)
        assert any("calib" in p for p in r.verify())
    for resolver in ({"calib": arr}, {ExternalAttachment.of(arr).sha256: arr}, lambda name, info: arr):
        with KvcReader(data, attachment_resolver=resolver) as r:
            assert_same_cache(r.read_cache(), c)
            assert np.array_equal(r.attachments["calib"], arr)
    for bad in (arr + 1, arr.astype(np.float64), arr[:2]):
        with KvcReader(data, attachment_resolver={"calib": bad}) as r:
            with pytest.raises(KvcFormatError, match="calib"):
                r.read_cache()


def test_writer_is_deterministic_and_streams_to_file_objects(tmp_path):
    c = synthetic_cache()
    a = encode_kvc_bytes(c, lossless_pipeline("float16"), chunk_tokens=3)
    b = encode_kvc_bytes(c, lossless_pipeline("float16"), chunk_tokens=3)
    assert a == b

    class Pipe:  # write-only, non-seekable sink
        def __init__(self):
            self.parts = []

        def write(self, x):
            self.parts.append(bytes(x))
            return len(x)

    sink = Pipe()
    n = write_kvc(c, sink, lossless_pipeline("float16"), chunk_tokens=3)
    assert b"".join(sink.parts) == a and n == len(a)


def test_per_layer_pipelines_and_presets():
    c = synthetic_cache(torch.float32)
    pick = lambda layer, kind: raw_pipeline("float32") if kind == "k" else lossless_pipeline("float32")  # noqa: E731
    data = encode_kvc_bytes(c, pick)
    with KvcReader(data) as r:
        assert len(r.header.pipelines) == 2
        assert [e.pipeline for e in r.entries] == [0, 1, 0, 1]
        assert_same_cache(r.read_cache(), c)
    for name in ("lossless", "zstd", "raw"):
        plan = get_plan(name, c)
        assert_same_cache(read_kvc(encode_kvc_bytes(c, plan.pipelines, preset=plan.preset)), c)
    with pytest.raises(KvcInputError, match="nope"):
        get_plan("nope-not-a-preset", c)


def test_atomic_write_leaves_no_partial_file(tmp_path):
    c = synthetic_cache()
    dest = tmp_path / "out.kvc"
    dest.write_bytes(b"old contents")

    class Boom(Exception):
        pass

    calls = {"n": 0}
    good = lossless_pipeline("float16")

    def pipelines(layer, kind):
        return good

    orig = good.encode

    def exploding(arr, ctx):
        calls["n"] += 1
        if calls["n"] == 3:
            raise Boom("disk on fire")
        return orig(arr, ctx)

    good.encode = exploding
    with pytest.raises(Boom):
        write_kvc(c, dest, pipelines)
    assert dest.read_bytes() == b"old contents"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.kvc"]
    good.encode = orig
    write_kvc(c, dest, pipelines)
    assert_same_cache(read_kvc(dest), c)
    with pytest.raises(KvcInputError):
        write_kvc(c, tmp_path / "missing-dir" / "x.kvc", pipelines)


def test_backend_selection(monkeypatch):
    assert resolve_device("cpu") == "cpu"
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU tests set it for the whole session
    if not torch.cuda.is_available():
        assert resolve_device(None) == "cpu"
        assert resolve_device("auto") == "cpu"
        with pytest.raises(KvcBackendError):
            resolve_device("gpu")
        data = encode_kvc_bytes(synthetic_cache(), raw_pipeline("float16"))
        with KvcReader(data) as r, pytest.raises(KvcBackendError):
            r.read_layer(0, backend="gpu")
    monkeypatch.setenv("KVCODEC_BACKEND", "cpu")
    assert resolve_device(None) == "cpu"
    with pytest.raises(KvcInputError):
        resolve_device("tpu")


@pytest.mark.parametrize("chunk_tokens, pipe", [(None, "raw"), (4, "lossless")])
def test_ragged_layers_roundtrip(chunk_tokens, pipe):
    """A sliding-window layer stores only its last tokens (spec section 4.2): exact round trip, its chunks sit at
    the layer's own token range, element counts and the declared size count only what is stored."""
    from formatutil import ragged_cache

    from kvcodec.format import lossless_pipeline, raw_pipeline

    c = ragged_cache()
    assert c.ragged and c.layer_tokens == (5, 12) and c.num_tokens == 12 and c.layer_offset(0) == 7
    assert c.num_elements == 2 * 2 * 8 * (5 + 12)
    p = raw_pipeline("float16") if pipe == "raw" else lossless_pipeline("float16")
    data = encode_kvc_bytes(c, p, chunk_tokens=chunk_tokens)
    with KvcReader(data) as r:
        assert r.header.required_features == 1 and r.header.layer_tokens == (5, 12)
        assert r.header.num_elements == c.num_elements
        assert {(e.token_start, e.token_end) for e in r.entries if e.layer == 0} == (
            {(7, 12)} if chunk_tokens is None else {(7, 11), (11, 12)})
        assert r.verify() == []
        back = r.read_cache()
    assert_same_cache(c, back)
    assert back.layer_tokens == (5, 12)
    # a file that is not ragged keeps bit 0 clear and no layer_tokens key (files stay as before)
    flat = encode_kvc_bytes(synthetic_cache(T=12), p, chunk_tokens=chunk_tokens)
    with KvcReader(flat) as r:
        assert r.header.required_features == 0 and "layer_tokens" not in r.header.raw["tensors"]


@pytest.mark.parametrize("suffix", [".h5", ".safetensors"])
def test_ragged_capture_files_roundtrip(tmp_path, suffix):
    """`kvc capture` files carry the ragged layout too (each layer's dataset its own token count), and a
    layer declaring more tokens than the context is refused before anything is read."""
    from formatutil import ragged_cache

    from kvcodec.core.kvcache import load_capture, save_capture

    c = ragged_cache()
    p = tmp_path / f"c{suffix}"
    save_capture(c, p)
    back = load_capture(p)
    assert_same_cache(c, back)
    assert back.layer_tokens == (5, 12)
    bad = KVCache([k[:, :3] for k in c.keys], [v[:, :3] for v in c.values], c.token_ids[:3], c.fingerprint)
    bad.token_ids = c.token_ids[:2]  # a layer of 3 tokens in a 2-token context: written unchecked, refused on load
    save_capture(bad, tmp_path / f"bad{suffix}")
    with pytest.raises(KvcFormatError):
        load_capture(tmp_path / f"bad{suffix}")


@pytest.mark.parametrize("preset", ["lossless", "zstd", "raw"])
def test_bf16_nan_payloads_subnormals_and_negative_zero_are_bit_exact(preset):
    """A lossless bfloat16 cache comes back bit for bit whatever its values: before, every NaN other than 0xFFFF
    (the canonical 0x7FC0 included) came back as 0xFFFF, torch's float32 -> bfloat16 conversion at the reader."""
    import kvcodec
    from kvcodec.testing.golden import _synthetic

    c = _synthetic(torch.bfloat16, 8)
    odd = torch.tensor([0x7FC0, 0xFFC0, 0x7FC1, 0x7F81, 0xFFFF, 0x0001, 0x807F, 0x8000, 0x7F80, 0xFF80],
                       dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    keys = [k.clone() for k in c.keys]
    keys[0].view(-1)[:len(odd)] = odd
    cache = KVCache(keys, c.values, c.token_ids, c.fingerprint, None)
    with kvcodec.open(kvcodec.encode(cache, None, preset=preset).data) as r:
        k0 = r.read_layer(0)[0]
    assert k0.dtype == torch.bfloat16 and torch.equal(k0.view(torch.int16), keys[0].view(torch.int16))


@pytest.mark.model
def test_lossy_code_that_decodes_finite_float16_to_inf_is_refused(lm):
    """A float16 cache near the float16 maximum (a constant 60000) under balanced decoded to inf in hundreds of
    values and was written all the same (the read-back took it as an out-of-distribution chunk equal to its
    reference decode): silently wrong KV. Now the write is one KvcCodecError line; 30000 still encodes."""
    import kvcodec
    from kvcodec.calibration.store import load_calibration
    from kvcodec.errors import KvcCodecError

    fp = lm.fingerprint
    cal = load_calibration(fp.id)

    def cache(val):
        ks = [torch.full((fp.num_kv_heads, 16, fp.head_dims[0]), val, dtype=torch.float16) for _ in range(fp.num_layers)]
        return KVCache(ks, [k.clone() for k in ks], np.zeros(16, dtype=np.int64), fp, None)

    with pytest.raises(KvcCodecError, match="decodes finite values to inf"):
        kvcodec.encode(cache(60000.0), None, preset="balanced", calibration=cal)
    with kvcodec.open(kvcodec.encode(cache(30000.0), None, preset="balanced", calibration=cal).data) as r:
        assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for _, k, v in r.iter_layers())
