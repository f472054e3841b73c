"""GPU decode of whole chunks (rANS + inverse lossy stages + layouts) under TRITON_INTERPRET=1.

Every comparison is bitwise (rtol=0, atol=0, compared as raw bits) against the
CPU pipeline (``Pipeline.decode``), the definition of the format. Real KV of
the embedded model, 16 tokens, 2 layers: small because the interpreter is slow.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton (see test_cuda_rans.py)

import numpy as np
import pytest

pytest.importorskip("triton")

import torch  # noqa: E402

from kvcodec.codecs.rans import RansBankStage, RansStage  # noqa: E402
from kvcodec.errors import KvcFormatError, KvcInputError  # noqa: E402
from kvcodec.decode.device import gpu_device  # noqa: E402
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline  # noqa: E402

pytestmark = pytest.mark.triton

T = 16  # tokens per test chunk
DEV = gpu_device()  # the kernels' device: the CPU under the interpreter, the GPU when compiled (TRITON_INTERPRET=0)


def _bits(a) -> np.ndarray:
    a = a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    return np.ascontiguousarray(a).view(f"u{a.dtype.itemsize}")


def _same(gpu, cpu) -> None:
    g = gpu.detach().cpu().numpy() if isinstance(gpu, torch.Tensor) else gpu
    assert g.dtype == cpu.dtype and g.shape == cpu.shape
    np.testing.assert_array_equal(_bits(g), _bits(cpu))


def _check_pipeline(pipe: Pipeline, x: np.ndarray, ctx: ChunkContext, expect_fallbacks=(), expect_path=None):
    """GPU decode == CPU decode; ``expect_path``: "fused" or "stages" (the registry's pick, from the decode's trace)."""
    from kvcodec.decode import registry
    payload, sides, sizes = pipe.encode(x, ctx)
    spec = ArraySpec(tuple(x.shape), str(x.dtype))
    cpu = pipe.decode(payload, sides, sizes, spec, ctx)
    trace: list[str] = []
    gpu = registry.decode_chunk_gpu(pipe, payload, sides, sizes, spec, ctx, trace=trace)
    _same(gpu, cpu)
    assert sorted(t.removeprefix("cpu:") for t in trace if t.startswith("cpu:")) == sorted(expect_fallbacks)
    if expect_path is not None:
        assert expect_path in trace and f"triton-{expect_path}" in trace, trace
    return payload, sides, sizes, spec, cpu


@pytest.fixture(scope="module")
def chunks(small_cache):
    """(layer, kind, float16 (H, T, D)) of layers 0 and 5 of a real cache."""
    out = []
    for layer in (0, 5):
        out.append((layer, "k", small_cache.keys[layer][:, :T].to(torch.float16).numpy()))
        out.append((layer, "v", small_cache.values[layer][:, :T].to(torch.float16).numpy()))
    return out


@pytest.fixture(scope="module")
def pca_attachments(small_cache):
    """A synthetic PCA calibration attachment (orthonormal bases from QR, float16) for every layer."""
    fp = small_cache.fingerprint
    L, H, D = fp.num_layers, fp.num_kv_heads, fp.head_dims[0]
    rng = np.random.default_rng(0)
    q, _ = np.linalg.qr(rng.standard_normal((L * 2 * H, D, D)))
    mean = 0.1 * rng.standard_normal((L * 2 * H, D))
    from kvcodec.errors import KvcFormatError as FE
    from kvcodec.codecs.transform import TransformStage

    for lead in ((2 * L,), (L, 2)):  # the attachment layout the stage reads: [2L, H, D, K] or [L, 2, H, D, K]
        att = {"pca.basis": q.reshape(*lead, H, D, D).astype(np.float16), "pca.mean": mean.reshape(*lead, H, D).astype(np.float16)}
        try:
            TransformStage(basis="pca", k=8).matrices(H, D, ChunkContext(layer=L - 1, kind="v", attachments=att))
            return att
        except FE:
            continue
    pytest.skip("unknown PCA attachment layout")


def _rope_cfg(cache):
    from kvcodec.codecs.rope_tables import rope_config_from_fingerprint

    return rope_config_from_fingerprint(cache.fingerprint.rope, cache.fingerprint.head_dims[0])


@pytest.mark.model
def test_transform_codec_pipelines(chunks, pca_attachments, small_cache):
    """rope -> keep -> transform (pca, hadamard) -> quantize(step) -> rans, as the presets build them."""
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage
    from kvcodec.codecs.transform import TransformStage

    rope = _rope_cfg(small_cache)
    for layer, kind, x in chunks:
        ctx = ChunkContext(layer=layer, kind=kind, attachments=pca_attachments)
        for basis, k in (("pca", 24), ("hadamard", None)):
            st = [RopeStage(**rope)] if kind == "k" else []
            st += [KeepStage(sink=4), TransformStage(basis=basis, k=k), QuantizeStage(mode="step", step=0.1, max_bits=8), RansStage(8)]
            _check_pipeline(Pipeline(st), x, ctx)


@pytest.mark.model
def test_minmax_pipelines(chunks):
    """KIVI-like minmax quantization, every axis / symmetry, per-head bits."""
    from kvcodec.codecs.quantize import QuantizeStage

    layer, kind, x = chunks[0]
    ctx = ChunkContext(layer=layer, kind=kind)
    H = x.shape[0]
    for q in (QuantizeStage(mode="minmax", bits=4, axis="channel", group=8),
              QuantizeStage(mode="minmax", bits=2, axis="token", group=32, symmetric=True),
              QuantizeStage(mode="minmax", bits=[3, 4, 8][:H] + [4] * (H - 3), axis="token", group=24),
              QuantizeStage(mode="minmax", bits=5, axis="channel", group=5, symmetric=True)):
        _check_pipeline(Pipeline([q, RansStage()]), x, ctx)
    # float32 cache
    _check_pipeline(Pipeline([QuantizeStage(mode="minmax", bits=4, axis="channel", group=8), RansStage(16)]), x.astype(np.float32), ctx)


@pytest.mark.model
def test_every_preset(chunks, small_cache, lm):
    """Each named preset's pipelines (PCA calibration if one is cached, else Hadamard at the preset's settings)."""
    from kvcodec.errors import KvcError
    from kvcodec.plan.presets import get_plan
    from kvcodec.plan import presets
    from kvcodec.plan.pipelines import transform_plan

    try:
        from kvcodec.calibration.store import require_calibration

        cal = require_calibration(lm.fingerprint)
    except (KvcError, ImportError):
        cal = None
    for name in ["lossless", *(n for n, p in presets.PRESETS.items() if p.lossy)]:
        if name == "lossless":
            plan, att = get_plan(name, small_cache), {}
        elif cal is not None:
            plan = transform_plan(small_cache, cal=cal, preset=name, **presets.PRESETS[name].settings)
            att = cal.attachments
        else:
            plan = transform_plan(small_cache, basis="hadamard", preset=name, **presets.PRESETS[name].settings)
            att = {}
        for layer, kind, x in chunks[:2]:
            pipe = plan.pipeline(layer, kind)
            # quantize v2 (near-lossless's 16-bit codes): no Triton kernel, so the stage-by-stage path with that
            # stage's CPU definition (kvcodec/cuda/backend.py), still bit-identical
            wide = any(s.name == "quantize" and s.version == 2 for s in pipe.stages)
            fb = [s.name for s in pipe.stages if (s.name not in ("rans", "quantize", "transform", "keep", "rope") or
                                                  (wide and s.name == "quantize")) and s.kind != "bytes->bytes"]
            _check_pipeline(pipe, x, ChunkContext(layer=layer, kind=kind, attachments=att), expect_fallbacks=fb,
                            expect_path="stages" if name == "lossless" or wide else "fused")


def test_rope_keeps_the_sign_of_zero():
    """RoPE of zeros: y*cos + rotate_half(y)*sin is -0.0 where cos < 0 and sin > 0 (numpy's rotate_half negates
    +0.0 to -0.0). The kernels must give the same bits: Triton 3.6 lowers ``-x`` to ``0 - x``, which gave +0.0
    on an H100 (benchmarks/gpu_check)."""
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage

    x = np.zeros((2, T, 16), np.float16)
    pipe = Pipeline([RopeStage(theta=10000.0, dim=16), QuantizeStage(mode="step", step=0.05), RansStage()])
    *_, cpu = _check_pipeline(pipe, x, ChunkContext(layer=0, kind="k", token_start=1000))
    assert np.signbit(cpu).any() and not np.signbit(cpu).all()  # the case is there: both signs of zero


@pytest.mark.model
def test_positions_per_head_and_offsets(chunks, small_cache):
    """RoPE with a token offset and with per-(layer, head) positions (pruned caches)."""
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage

    layer, kind, x = chunks[0]
    H = x.shape[0]
    pipe = Pipeline([RopeStage(**_rope_cfg(small_cache)), QuantizeStage(mode="step", step=0.05), RansStage()])
    _check_pipeline(pipe, x, ChunkContext(layer=layer, kind=kind, token_start=1000))
    rng = np.random.default_rng(2)
    pos = np.sort(rng.choice(4096, size=(small_cache.fingerprint.num_layers, H, T), replace=True), axis=-1)
    _check_pipeline(pipe, x, ChunkContext(layer=layer, kind=kind, positions=pos))


def test_unknown_stage_falls_back_to_cpu():
    """A stage without a GPU implementation runs on the CPU for that stage only."""
    from kvcodec.codecs.quantize import QuantizeStage

    class Negate(QuantizeStage.__mro__[1]):  # an ArrayToArray stage the GPU backend does not know
        name = "test-negate"
        version = 1

        def encode(self, arr, ctx):
            return (-arr.astype(np.float32)), {}

        def decode(self, arr, side, spec, ctx):
            return (-arr).astype(spec.dtype)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 8, 16)).astype(np.float16)
    pipe = Pipeline([Negate(), QuantizeStage(mode="step", step=0.05), RansStage()])
    _check_pipeline(pipe, x, ChunkContext(), expect_fallbacks=["test-negate"])


def test_malformed_side_data_and_payload_like_cpu():
    from kvcodec.decode import registry
    from kvcodec.codecs.quantize import QuantizeStage

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 8, 16)).astype(np.float16)
    pipe = Pipeline([QuantizeStage(mode="step", step=0.05, max_bits=6), RansStage()])
    ctx = ChunkContext()
    payload, sides, sizes = pipe.encode(x, ctx)
    spec = ArraySpec(x.shape, "float16")

    def both(payload, sides):
        msgs = []
        for fn in (pipe.decode, lambda *a: registry.decode_chunk_gpu(pipe, *a)):
            try:
                fn(payload, sides, sizes, spec, ctx)
                msgs.append(None)
            except KvcFormatError as exc:
                msgs.append(str(exc))
        assert msgs[0] is not None and msgs[0] == msgs[1], msgs

    q = dict(sides[0])
    both(payload, [dict(q, bits=np.zeros_like(q["bits"])), {}])  # symbols outside their bit width
    both(payload, [dict(q, step=np.full_like(q["step"], np.nan)), {}])
    both(payload, [{"step": q["step"]}, {}])  # missing side data
    both(payload, [q, {"junk": np.zeros(1)}])  # rans has no side data
    both(payload[:-4], sides)  # truncated rANS stream
    b = bytearray(payload)
    b[-8] ^= 0x40
    both(bytes(b), sides)


def test_layout_writers_hf_and_paged():
    from kvcodec.decode.triton.dequant_kernels import store_hf, store_paged

    rng = np.random.default_rng(3)
    H, Tn, D = 3, 21, 8
    xn = rng.standard_normal((H, Tn, D)).astype(np.float32)
    xn[0, 0, :6] = [np.inf, -np.inf, 1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -0.0, 3.0e38]  # bf16 ties round to even
    x = torch.from_numpy(xn).to(DEV)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        hf = torch.zeros((1, H, 40, D), dtype=dt, device=DEV)
        store_hf(x, hf, token_start=5)
        assert torch.equal(hf[0, :, 5 : 5 + Tn].contiguous().view(torch.uint8), x.to(dt).view(torch.uint8)) and not hf[0, :, :5].any() and not hf[0, :, 5 + Tn :].any()
        bs, nb = 4, 16
        cache = torch.zeros((nb, bs, H, D), dtype=dt, device=DEV)
        table = torch.tensor(rng.permutation(nb)[:8], dtype=torch.int32, device=DEV)
        store_paged(x, cache, table, token_start=3)
        for t in range(Tn):
            p = 3 + t
            assert torch.equal(cache[table[p // bs], p % bs], x[:, t].to(dt))
        assert int((cache != 0).sum()) == int((x.to(dt) != 0).sum())
    nan = torch.tensor([[[float("nan"), -float("nan")]]], device=DEV)
    hf = torch.zeros((1, 1, 1, 2), dtype=torch.bfloat16, device=DEV)
    store_hf(nan, hf)
    assert torch.isnan(hf).all()  # a NaN that is not an exact bfloat16: some NaN (torch CPU gives 0xFFFF, CUDA 0x7FC0)
    # an exact-bfloat16 NaN (a lossless bfloat16 file's) keeps its sign and payload, as the CPU reader
    # (core.dtypes.f32_to_bf16): before, every NaN became 0x7FC0 here
    bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7FC10000, 0x7F810000], dtype=torch.int64).to(torch.int32)
    exact = bits.view(torch.float32).reshape(1, 1, 4).to(DEV)
    for shape, store in (((1, 1, 4, 1), store_hf),
                         ((1, 4, 1, 1), lambda y, t: store_paged(y, t, torch.tensor([0], dtype=torch.int32, device=DEV), 0))):
        out = torch.zeros(shape, dtype=torch.bfloat16, device=DEV)
        store(exact.reshape(1, 4, 1), out)
        assert (out.view(torch.int16).reshape(-1).cpu().to(torch.int32) & 0xFFFF).tolist() == [0x7FC0, 0xFFC0, 0x7FC1, 0x7F81]
    with pytest.raises(KvcInputError):
        store_paged(x, torch.zeros((2, 4, H, D), device=DEV), torch.tensor([0, 1], device=DEV), 0)


@pytest.mark.model
def test_decode_into_layouts(chunks, small_cache):
    """Decode a real chunk on the 'GPU' and write it into HF and paged tensors: equals the CPU decode."""
    from kvcodec.decode import registry
    from kvcodec.decode.triton.dequant_kernels import store_hf, store_paged
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.transform import TransformStage

    layer, kind, x = chunks[1]
    pipe = Pipeline([KeepStage(sink=4), TransformStage(basis="hadamard"), QuantizeStage(mode="step", step=0.1), RansStage(8)])
    ctx = ChunkContext(layer=layer, kind=kind)
    payload, sides, sizes = pipe.encode(x, ctx)
    spec = ArraySpec(x.shape, "float16")
    cpu = pipe.decode(payload, sides, sizes, spec, ctx)
    y = registry.decode_chunk_gpu(pipe, payload, sides, sizes, spec, ctx)
    H, Tn, D = x.shape
    hf = torch.zeros((1, H, Tn + 3, D), dtype=torch.float16, device=DEV)
    store_hf(y, hf, token_start=3)
    _same(hf[0, :, 3:], cpu)
    cache = torch.zeros((8, 4, H, D), dtype=torch.float16, device=DEV)
    table = torch.tensor([7, 2, 5, 0, 1], dtype=torch.int32, device=DEV)
    store_paged(y, cache, table, token_start=2)
    got = torch.stack([cache[table[(2 + t) // 4], (2 + t) % 4] for t in range(Tn)], dim=1)
    _same(got, cpu)


# --------------------------------------------------------------------------- the fused transform chain
def _chain(rope_dim=None, sink=4, recent=0, k=24, basis="pca", ts=None, keep_dtype="float16", g=8, step=0.05, bank=0):
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage
    from kvcodec.codecs.transform import TransformStage

    st = [RopeStage(theta=100000.0, dim=rope_dim)] if rope_dim else []
    if sink or recent:
        st.append(KeepStage(sink=sink, recent=recent, dtype=keep_dtype))
    st.append(TransformStage(basis=basis, k=k))
    if ts is not None:
        st.append(ts)
    st += [QuantizeStage(mode="step", step=step, max_bits=8), RansBankStage(g, block_tokens=bank) if bank else RansStage(g)]
    return Pipeline(st)


def _tokenscale(n_tokens: int, skip: int):
    from kvcodec.codecs.tokenscale import TokenScaleStage

    return TokenScaleStage(bits=4)


def _ts_inputs(skip: int) -> dict:
    """ChunkContext.encoder for a tokenscale stage after ``skip`` kept tokens."""
    from kvcodec.codecs.tokenscale import TokenClasses

    classes = np.random.default_rng(5).integers(0, 5, 4096).astype(np.uint8)
    return {"tokenscale": TokenClasses(classes, np.array([0.25, 1.0, 2.0, 11.3137085, 45.254834], np.float32), skip)}  # a non-power of two rounds


@pytest.mark.model
@pytest.mark.parametrize("case", ["keys", "values", "tokenscale", "recent", "partial_rope", "hadamard_full", "f32", "keep_f32",
                                  "one_token", "all_kept", "short", "per_head_pos", "group16", "rans_v2"])
def test_fused_chain_bit_exact(case, chunks, pca_attachments):
    """Every shape of the fused chain on real KV: one kernel, bit-identical to Pipeline.decode."""

    layer, kind, x = chunks[0] if case != "values" else chunks[1]
    H = x.shape[0]
    kw: dict = {"rope_dim": 64 if case != "values" else None}
    positions = None
    if case == "tokenscale":
        kw["ts"] = _tokenscale(T, 4)
    elif case == "recent":
        kw["recent"] = 3
    elif case == "partial_rope":
        kw["rope_dim"] = 48
    elif case == "hadamard_full":
        kw.update(basis="hadamard", k=None)
    elif case == "f32":
        x = x.astype(np.float32)
    elif case == "keep_f32":
        kw["keep_dtype"] = "float32"
    elif case == "one_token":
        x, kw["sink"] = x[:, :1], 0
    elif case == "all_kept":
        kw["sink"] = T
    elif case == "short":  # fewer coded tokens than a program's token tile, and fewer symbols than a lane group
        x = x[:, :7]
    elif case == "per_head_pos":
        positions = np.sort(np.random.default_rng(2).choice(9000, size=(8, H, T), replace=False), axis=-1)
    elif case == "group16":
        kw.update(g=16, k=32)
    elif case == "rans_v2":  # 5 x 16 tokens, blocks of 32 tokens coded with a bank of tables (spec/rans-v2.md)
        x = np.concatenate([x, x[:, ::-1], 0.5 * x, x, 2 * x], axis=1)
        kw.update(bank=32, ts=_tokenscale(T, 4))
    pipe = _chain(**kw)
    ctx = ChunkContext(layer=layer, kind=kind, attachments=pca_attachments, token_start=11, positions=positions,
                       encoder=_ts_inputs(4))
    _check_pipeline(pipe, x, ctx, expect_path="fused")


def _heads_with_pca(chunks, D: int, blocks: list[tuple[int, int]]) -> tuple[np.ndarray, dict]:
    """The real K/V channels of the test chunks regrouped into (up to 2) heads of D, float16 [H, T, D],
    and a PCA attachment per head from the data (layer 0, keys), over ``blocks`` of channels."""
    from kvcodec.calibration.fit import block_pca

    allc = np.concatenate([x.transpose(1, 0, 2).reshape(T, -1) for _, _, x in chunks], axis=1).astype(np.float32)
    H = min(2, allc.shape[1] // D)
    x = allc[:, : H * D].reshape(T, H, D).transpose(1, 0, 2)
    basis = np.zeros((2, H, D, D), np.float16)
    mean = np.zeros((2, H, D), np.float16)
    for h in range(H):
        m = x[h].mean(0)
        basis[0, h], mean[0, h] = block_pca(np.cov((x[h] - m).T) + 1e-6 * np.eye(D), None, blocks)[0], m
    return np.ascontiguousarray(x).astype(np.float16), {"pca.basis": basis, "pca.mean": mean}


@pytest.mark.model
@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
def test_fused_chain_every_head_dim(D, chunks):
    """Every head_dim the CPU fast path covers (issue 19) decodes bit-exactly in the fused Triton chain:
    the real K/V channels of two layers regrouped into heads of D, a PCA basis per head from the data,
    full RoPE (80: its half is not a power of two) and partial RoPE."""
    from kvcodec.decode.cpu.fused import HEAD_DIMS

    assert D in HEAD_DIMS
    xs, att = _heads_with_pca(chunks, D, [(0, D)])
    for rope_dim in (D, D // 2) if D in (80, 256) else (D,):  # partial RoPE where the half splits oddly
        pipe = _chain(rope_dim=rope_dim, k=D // 2 + 8, step=0.02)
        _check_pipeline(pipe, xs, ChunkContext(layer=0, kind="k", attachments=att, token_start=5), expect_path="fused")


@pytest.mark.parametrize("D", [96, 256])
def test_fused_chain_block_diagonal_basis(D, chunks):
    """The block-diagonal bases calibration builds for head_dim > 64 (kvcodec/codecs/blocks.py) decode
    bit-exactly in the fused Triton chain too: it sums every term, the CPU's fast path skips the zero
    ones, and a zero term adds an exact zero (spec/codec-v1.md, transform)."""
    from kvcodec.codecs.blocks import channel_blocks

    xs, att = _heads_with_pca(chunks, D, channel_blocks(D))
    assert len(channel_blocks(D)) > 1 and (att["pca.basis"] == 0).mean() > 0.4
    pipe = _chain(rope_dim=D, k=D // 2 + 8, step=0.02)
    _check_pipeline(pipe, xs, ChunkContext(layer=0, kind="k", attachments=att, token_start=5), expect_path="fused")


@pytest.mark.model
def test_fused_chain_into_layouts(chunks, pca_attachments):
    """decode_chunk_into writes the fused chain straight into HF and paged tensors (fp16, bf16, fp32):
    each value is the CPU decode cast to the destination dtype, nothing else is touched."""
    from kvcodec.decode.triton import backend
    layer, kind, x = chunks[0]
    H, Tn, D = x.shape
    pipe = _chain(rope_dim=64, ts=_tokenscale(T, 4))
    ctx = ChunkContext(layer=layer, kind=kind, attachments=pca_attachments, encoder=_ts_inputs(4))
    payload, sides, sizes = pipe.encode(x, ctx)
    spec = ArraySpec(x.shape, "float16")
    cpu = torch.from_numpy(pipe.decode(payload, sides, sizes, spec, ctx)).to(DEV)
    for dt in (torch.float16, torch.bfloat16, torch.float32):
        hf = torch.zeros((1, H, Tn + 5, D), dtype=dt, device=DEV)
        trace: list[str] = []
        backend.decode_chunk_into(pipe, payload, sides, sizes, spec, ctx, hf, token_start=3, trace=trace)
        assert trace == ["fused"]
        assert torch.equal(hf[0, :, 3 : 3 + Tn].contiguous().view(torch.uint8), cpu.to(dt).contiguous().view(torch.uint8))
        assert not hf[0, :, :3].any() and not hf[0, :, 3 + Tn :].any()
        cache = torch.zeros((8, 4, H, D), dtype=dt, device=DEV)
        table = torch.tensor([7, 2, 5, 0, 1], dtype=torch.int32, device=DEV)
        backend.decode_chunk_into(pipe, payload, sides, sizes, spec, ctx, cache, token_start=2, block_table=table)
        got = torch.stack([cache[table[(2 + t) // 4], (2 + t) % 4] for t in range(Tn)], dim=1)
        assert torch.equal(got.contiguous().view(torch.uint8), cpu.to(dt).contiguous().view(torch.uint8))
        assert int((cache != 0).sum()) == int((cpu.to(dt) != 0).sum())
    with pytest.raises(KvcInputError):
        backend.decode_chunk_into(pipe, payload, sides, sizes, spec, ctx, torch.zeros((1, H, Tn - 1, D), dtype=torch.float16, device=DEV))


@pytest.mark.model
def test_fused_chain_malformed_like_cpu(chunks, pca_attachments):
    """Malformed side data reaching the fused kernel's host checks: the CPU decode's KvcFormatError, word for word."""
    from kvcodec.decode import registry
    layer, kind, x = chunks[0]
    pipe = _chain(rope_dim=64, ts=_tokenscale(T, 4))
    ctx = ChunkContext(layer=layer, kind=kind, attachments=pca_attachments, encoder=_ts_inputs(4))
    payload, sides, sizes = pipe.encode(x, ctx)
    spec = ArraySpec(x.shape, "float16")
    i_keep, i_tr, i_ts, i_q = 1, 2, 3, 4

    def mutated(i, **kw):
        out = [dict(sd) for sd in sides]
        out[i].update(kw)
        return out

    kept = sides[i_keep]["kept"].copy()
    kept[0, 0, 0] = np.inf
    q = sides[i_q]
    for bad in (mutated(i_q, bits=np.zeros_like(q["bits"])), mutated(i_q, step=np.full_like(q["step"], np.nan)),
                mutated(i_ts, mult=np.array([1.0], np.float32)), mutated(i_ts, junk=np.zeros(1)), mutated(i_keep, kept=kept),
                mutated(i_tr, extra=np.zeros(1))):
        msgs = []
        for fn in (pipe.decode, lambda *a: registry.decode_chunk_gpu(pipe, *a)):
            with pytest.raises(KvcFormatError) as e:
                fn(payload, bad, sizes, spec, ctx)
            msgs.append(str(e.value))
        assert msgs[0] == msgs[1]


def test_tokenscale_stage_outside_a_chain():
    """tokenscale has its own GPU stage when the pipeline is not a transform chain."""
    from kvcodec.codecs.quantize import QuantizeStage

    x = (np.random.default_rng(4).standard_normal((2, 13, 16)) * 3).astype(np.float16)
    pipe = Pipeline([_tokenscale(13, 0), QuantizeStage(mode="step", step=0.05), RansStage()])
    _check_pipeline(pipe, x, ChunkContext(encoder=_ts_inputs(0)), expect_path="stages")
