"""The fused CPU decoder (kvcodec/decode/cpu/fused.py) is bit-identical to ``Pipeline.decode``.

``decode_chunk`` tries the fused path first; these tests decode the same chunks
with the fused path and with the generic (normative) stage decodes and compare
every bit, on real SmolLM2 caches for every preset, on the `.kvc` golden
vectors and on synthetic pipelines covering positions / keep / tokenscale /
hadamard / float32 corners; malformed chunks must fall back (and raise the
generic error).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

import kvcodec.decode.cpu.fused as F
from kvcodec.codecs.rans import RansStage
from kvcodec.errors import KvcError, KvcFormatError
from kvcodec.format import KvcReader
from kvcodec.decode.registry import decode_chunk
from kvcodec.codecs.keep import KeepStage
from kvcodec.codecs.quantize import QuantizeStage
from kvcodec.codecs.rope import RopeStage
from kvcodec.codecs.transform import TransformStage
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline

ROOT = Path(__file__).resolve().parents[2]


def _bits(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a)
    return a.view(np.uint8)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(_bits(a), _bits(b))


# --------------------------------------------------------------------------- float16 rounding
def test_simd_pin_matches_simd_module():
    """numba caches the kernel keyed on fastdecode.py's contents only: its pin of simd.py must
    change with simd.py, or an edited intrinsic would keep running from a stale cache."""
    import hashlib

    from kvcodec.codecs import blocks

    from kvcodec.decode.cpu import simd
    got = hashlib.sha256(Path(simd.__file__).read_bytes() + Path(blocks.__file__).read_bytes()).hexdigest()
    assert got == F.SIMD_SHA256, "simd.py or blocks.py changed: update SIMD_SHA256 in kvcodec/decode/cpu/fused.py"


def test_f16_conversion_matches_numpy():
    rng = np.random.default_rng(0)
    parts = [
        rng.integers(0, 1 << 32, 2_000_000, dtype=np.uint64).astype(np.uint32),
        np.arange(0x33000000, 0x33000000 + (1 << 20), dtype=np.uint32),  # around the smallest subnormal
        np.arange(0x387F0000, 0x38810000, dtype=np.uint32),  # subnormal -> normal boundary
        np.arange(0x477F0000, 0x47810000, dtype=np.uint32),  # 65504 / overflow to inf
        np.arange(0x7F800000, 0x7F800000 + (1 << 16), dtype=np.uint32),  # inf, NaNs (signalling too)
        np.arange(0x7FFF0000, 0x80000000, dtype=np.uint64).astype(np.uint32),
    ]
    u = np.concatenate(parts)
    u = np.concatenate([u, u | np.uint32(0x80000000)])
    x = u.view(np.float32)
    out = np.empty(x.size, np.uint16)
    F.f32_to_f16_bits(x, out)
    with np.errstate(all="ignore"):
        ref = x.astype(np.float16).view(np.uint16)
    bad = np.flatnonzero(out != ref)
    assert bad.size == 0, f"{bad.size} mismatches, first {hex(int(u[bad[0]]))}: {hex(int(out[bad[0]]))} != {hex(int(ref[bad[0]]))}"


# --------------------------------------------------------------------------- helpers
def _both(pipe: Pipeline, arr: np.ndarray, ctx: ChunkContext, dec_ctx: ChunkContext | None = None):
    payload, sides, sizes = pipe.encode(arr, ctx)
    spec = ArraySpec(arr.shape, arr.dtype.name)
    dctx = dec_ctx or ctx
    fast = F.decode(pipe, payload, sides, sizes, spec, dctx) if F.supports(pipe, spec) else None
    ref = pipe.decode(payload, sides, sizes, spec, dctx)
    return fast, ref, (payload, sides, sizes, spec, dctx)


def _pca(L: int = 2, H: int = 3, D: int = 64, dtype=np.float16, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    q = np.linalg.qr(rng.standard_normal((2 * L, H, D, D)))[0]
    return {"pca.basis": (q * 1.01).astype(dtype), "pca.mean": (rng.standard_normal((2 * L, H, D)) * 0.3).astype(dtype)}


def _data(H=3, T=37, D=64, seed=2, dtype=np.float16) -> np.ndarray:
    rng = np.random.default_rng(seed)
    scale = np.exp(rng.standard_normal(D)).astype(np.float32)
    x = rng.standard_normal((H, T, D)).astype(np.float32) * scale
    x[:, :2] *= 30  # sink-like outliers
    return x.astype(dtype)


def _ts_stage(T_coded: int, sink: int):
    ts_mod = pytest.importorskip("kvcodec.codecs.tokenscale")
    return ts_mod.TokenScaleStage(bits=4)


def _ts_inputs(sink: int) -> dict:
    """ChunkContext.encoder of the tokenscale stage of :func:`_ts_stage` (classes after ``sink`` kept tokens)."""
    ts_mod = pytest.importorskip("kvcodec.codecs.tokenscale")
    classes = np.random.default_rng(5).integers(0, 5, 4096).astype(np.uint8)
    return {"tokenscale": ts_mod.TokenClasses(classes, np.array([0.25, 1.0, 2.0, 11.3137085, 45.254834], np.float32), sink)}  # a non-power of two rounds


# --------------------------------------------------------------------------- synthetic pipelines
@pytest.mark.parametrize("variant", ["keys", "values", "recent", "no_keep", "hadamard", "f32", "pos1d", "pos2d", "pos3d",
                                     "tokenscale", "k_full", "all_kept", "group4", "pca_f32"])
def test_synthetic_pipelines_bit_identical(variant):
    H, T, D = 3, 37, 64
    dtype = np.float32 if variant == "f32" else np.float16
    arr = _data(H, T, D, dtype=dtype)
    att = _pca(dtype=np.float32 if variant == "pca_f32" else np.float16)
    rope = RopeStage(theta=100000.0, dim=64 if variant != "pos2d" else 48)
    keep = KeepStage(sink=4, recent=5 if variant == "recent" else 0, dtype="float16")
    if variant == "all_kept":
        keep = KeepStage(sink=40, recent=0, dtype="float32")
    tr = TransformStage(basis="hadamard" if variant == "hadamard" else "pca", k=None if variant == "k_full" else 24)
    qz = QuantizeStage(mode="step", step=0.05, max_bits=8)
    rs = RansStage(channel_group=4 if variant == "group4" else 8)
    stages = [tr, qz, rs]
    if variant == "tokenscale":
        stages = [tr, _ts_stage(T - 4, 4), qz, rs]
    if variant != "no_keep":
        stages = [keep] + stages
    if variant != "values":
        stages = [rope] + stages
    pipe = Pipeline(stages)
    positions = None
    if variant == "pos1d":
        positions = np.sort(np.random.default_rng(3).choice(5000, T, replace=False)).astype(np.int64)
    elif variant == "pos2d":
        positions = np.stack([np.sort(np.random.default_rng(h).choice(5000, T, replace=False)) for h in range(H)]).astype(np.int64)
    elif variant == "pos3d":
        positions = np.random.default_rng(4).integers(0, 9000, (2, H, T)).astype(np.int64)
    ctx = ChunkContext(layer=1, kind="k" if variant != "values" else "v", token_start=123, positions=positions,
                       attachments=att, extra={"head_start": 0}, encoder=_ts_inputs(4) if variant == "tokenscale" else {})
    fast, ref, _ = _both(pipe, arr, ctx)
    assert fast is not None, "fused path declined a supported pipeline"
    assert _same(fast, ref)


@pytest.mark.parametrize("D", [32, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("variant", ["keys", "partial_rope", "values_f32", "recent"])
def test_every_head_dim_bit_identical(D, variant):
    """Every head_dim real models use (issue 19: Gemma 3 has 256, Phi-style models 80 and 96) takes the
    fused path, bit-identical to the generic decode; 80 rotates in the scalar loop (D/2 mid-vector)."""
    assert D in F.HEAD_DIMS
    H, T = 2, 29
    dtype = np.float32 if variant == "values_f32" else np.float16
    arr = _data(H, T, D, dtype=dtype, seed=D)
    att = _pca(H=H, D=D, seed=D + 1)
    stages = [KeepStage(sink=3, recent=4 if variant == "recent" else 0, dtype="float16"), TransformStage(k=D // 2 + 8),
              QuantizeStage(mode="step", step=0.05, max_bits=8), RansStage(channel_group=8)]
    if variant != "values_f32":
        stages = [RopeStage(theta=1000000.0, dim=D if variant != "partial_rope" else D // 2)] + stages
    pipe = Pipeline(stages)
    ctx = ChunkContext(layer=1, kind="v" if variant == "values_f32" else "k", token_start=77, attachments=att)
    fast, ref, _ = _both(pipe, arr, ctx)
    assert fast is not None, f"fused path declined head_dim {D}"
    assert _same(fast, ref)


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("basis_dtype", [np.float16, np.float32])
def test_dense_and_sparse_rows_bit_identical(D, basis_dtype):
    """A chunk whose token rows alternate between almost all-nonzero coefficients (the dense loop)
    and almost all-zero ones (compaction, then the sparse loop), with a float16-exact basis (read
    as float16) and a float32 one (read as float32): every combination equals the generic decode."""
    H, T = 2, 40
    rng = np.random.default_rng(D)
    x = rng.standard_normal((H, T, D)).astype(np.float32) * 2.0
    x[:, 1::2] *= 0.002  # odd tokens quantize to (nearly) all-zero coefficients
    att = _pca(H=H, D=D, dtype=basis_dtype, seed=D + 7)
    att["pca.mean"][:] = 0
    step = 0.05
    pipe = Pipeline([TransformStage(k=None), QuantizeStage(mode="step", step=step, max_bits=8), RansStage(channel_group=8)])
    ctx = ChunkContext(layer=1, kind="v", token_start=0, attachments=att)
    b = att["pca.basis"][3].astype(np.float64)  # layer 1, kind v
    y = np.einsum("htd,hdk->htk", x.astype(np.float64), np.linalg.pinv(b).transpose(0, 2, 1))
    density = (np.abs(y) >= step / 2).mean(-1)
    assert density[:, 0::2].min() > F.DENSE_OF_8 / 8 and density[:, 1::2].max() < F.DENSE_OF_8 / 8, "rows of both kinds"
    fast, ref, _ = _both(pipe, x.astype(np.float16), ctx)
    assert fast is not None
    assert _same(fast, ref)


def _structured_pca(H: int, D: int, kind: str, dtype, seed: int) -> dict[str, np.ndarray]:
    """Bases of layer 1 (both kinds) with zero patterns: "blockdiag" (each column one channel block,
    as calibration builds them, columns of the blocks interleaved), "partial" (each column nonzero
    on a random set of 16-channel groups, so it falls in one or several blocks, some -0.0 entries),
    "dense" (no zeros)."""
    from kvcodec.codecs.blocks import channel_blocks

    rng = np.random.default_rng(seed)
    att = _pca(H=H, D=D, dtype=np.float32, seed=seed)
    b = att["pca.basis"].astype(np.float64)
    if kind == "blockdiag":
        b = np.zeros_like(b)
        col = 0
        for c0, c1 in channel_blocks(D):
            q = np.linalg.qr(rng.standard_normal((b.shape[0], H, c1 - c0, c1 - c0)))[0]
            b[..., c0:c1, col:col + c1 - c0] = q
            col += c1 - c0
        b = b[..., rng.permutation(D)]
    elif kind == "partial":
        keep = rng.random((b.shape[0], H, D // 16, D)) < 0.4
        b = b * np.repeat(keep, 16, axis=2) + 2 * np.eye(D)  # + I: invertible (the encoder solves least squares)
        b[b == 0] = -0.0 * rng.integers(0, 2, (b == 0).sum())  # +0 and -0: both add an exact zero
    att["pca.basis"] = (b * 1.3).astype(dtype)
    return att


@pytest.mark.parametrize("D", [80, 96, 128, 256])
@pytest.mark.parametrize("kind", ["blockdiag", "partial", "dense"])
@pytest.mark.parametrize("variant", ["keys", "values_f32_basis", "tokenscale"])
def test_block_structured_bases_bit_identical(D, kind, variant):
    """A basis with zero blocks (head_dim > 64 calibrations are block-diagonal) decodes block by block,
    each block's accumulators over only the columns nonzero on it: exact, because every skipped term
    adds +-0 to a sum that is never -0. Bit-identical to the generic decode whatever the zero pattern,
    and the blocked loop must actually run for block-diagonal bases (and not for dense ones)."""
    H, T = 2, 45
    arr = _data(H, T, D, seed=D + 3)
    att = _structured_pca(H, D, kind, np.float32 if variant == "values_f32_basis" else np.float16, seed=D)
    kk = D - 16 if variant == "tokenscale" else None
    stages = [KeepStage(sink=4, dtype="float16"), TransformStage(k=kk), QuantizeStage(mode="step", step=0.03, max_bits=8),
              RansStage(channel_group=8)]
    if variant == "tokenscale":
        stages.insert(2, _ts_stage(T - 4, 4))
    if variant != "values_f32_basis":
        stages.insert(0, RopeStage(theta=10000.0, dim=D))
    pipe = Pipeline(stages)
    ctx = ChunkContext(layer=1, kind="v" if variant == "values_f32_basis" else "k", token_start=9, attachments=att,
                       encoder=_ts_inputs(4) if variant == "tokenscale" else {})
    fast, ref, _ = _both(pipe, arr, ctx)
    assert fast is not None
    assert _same(fast, ref)
    tr = pipe.stages[2 if variant != "values_f32_basis" else 1]
    mats = F._matrices(tr, H, D, ctx)
    blocked = bool((mats.pcnt[:, 0] >= 0).all())
    if kind == "blockdiag":
        assert blocked, "a block-diagonal basis must take the block-by-block loop"
    if kind == "dense":
        assert not (mats.pcnt[:, 0] >= 0).any(), "a dense basis decodes whole rows"


def test_unsupported_head_dim_takes_the_generic_path():
    H, T, D = 2, 17, 48
    arr = _data(H, T, D)
    pipe = Pipeline([RopeStage(theta=10000.0, dim=D), TransformStage(k=16), QuantizeStage(mode="step", step=0.05, max_bits=8),
                     RansStage(channel_group=8)])
    ctx = ChunkContext(layer=0, kind="k", attachments=_pca(H=H, D=D))
    fast, ref, (payload, sides, sizes, spec, dctx) = _both(pipe, arr, ctx)
    assert fast is None and D not in F.HEAD_DIMS
    assert _same(decode_chunk(pipe, payload, sides, sizes, spec, dctx, "cpu"), ref)


def test_fast_path_declines_unsupported():
    minmax = Pipeline([QuantizeStage(mode="minmax", bits=4, axis="channel", group=8), RansStage()])
    arr = np.random.default_rng(0).integers(0, 16, (2, 16, 8)).astype(np.float16)
    assert not F.supports(minmax, ArraySpec(arr.shape, "float16"))
    from kvcodec.decode.registry import select

    assert [b.name for b in select(minmax, ArraySpec(arr.shape, "float16"))] == ["reference"]


@pytest.mark.parametrize("mutate", ["bits_too_small", "step_nan", "kept_inf", "payload_flip", "extra_side", "basis_nan"])
def test_malformed_chunks_fall_back_to_the_generic_error(mutate):
    arr = _data()
    att = _pca()
    pipe = Pipeline([RopeStage(theta=100000.0, dim=64), KeepStage(sink=4), TransformStage(k=24),
                     QuantizeStage(mode="step", step=0.05, max_bits=8), RansStage(channel_group=8)])
    ctx = ChunkContext(layer=0, kind="k", attachments=att)
    payload, sides, sizes = pipe.encode(arr, ctx)
    sides = [dict(s) for s in sides]
    payload = bytearray(payload)
    if mutate == "bits_too_small":
        sides[3]["bits"] = np.maximum(sides[3]["bits"].astype(np.int64) - 1, 0).astype(np.uint8)
    elif mutate == "step_nan":
        sides[3]["step"] = sides[3]["step"].copy()
        sides[3]["step"][0, 0] = np.nan
    elif mutate == "kept_inf":
        sides[1]["kept"] = sides[1]["kept"].copy()
        sides[1]["kept"][0, 0, 0] = np.inf
    elif mutate == "payload_flip":
        payload[len(payload) // 2] ^= 0x10
    elif mutate == "extra_side":
        sides[2]["junk"] = np.zeros(1, np.uint8)
    elif mutate == "basis_nan":
        b = att["pca.basis"].copy()
        b[0, 0, 0, 0] = np.nan
        ctx = ChunkContext(layer=0, kind="k", attachments={"pca.basis": b, "pca.mean": att["pca.mean"]})
    spec = ArraySpec(arr.shape, "float16")
    assert F.supports(pipe, spec)
    with pytest.raises((KvcError, ValueError)):  # the fused decoder refuses it too (the registry then asks the reference)
        F.decode(pipe, bytes(payload), sides, sizes, spec, ctx)
    with pytest.raises(KvcFormatError) as generic:
        pipe.decode(bytes(payload), sides, sizes, spec, ctx)
    with pytest.raises(KvcFormatError) as hooked:
        decode_chunk(pipe, bytes(payload), sides, sizes, spec, ctx, "cpu")
    assert str(generic.value) in str(hooked.value)


# --------------------------------------------------------------------------- files
def _decode_all(r: KvcReader, fast: bool, monkeypatch) -> list[np.ndarray]:
    if not fast:  # the registry picks the reference only (its choice is memoised per pipeline, so patch the pick)
        import kvcodec.decode.registry as B

        monkeypatch.setattr(B, "select", lambda *a, **k: [B.backend("reference")])
    out = [r.read_chunk(j, "cpu") for j in range(r.num_chunks)]
    monkeypatch.undo()
    return out


def _compare_file(data: bytes, monkeypatch, resolver=None, expect_fast: bool = True) -> None:
    r = KvcReader(data, attachment_resolver=resolver)
    hits = []
    orig = F.decode

    def spy(*a):
        out = orig(*a)  # a failure raises (KVCODEC_STRICT_BACKENDS=1 in conftest): never a silent fallback
        hits.append(True)
        return out

    monkeypatch.setattr(F, "decode", spy)
    fast = [r.read_chunk(j, "cpu") for j in range(r.num_chunks)]
    monkeypatch.undo()
    ref = _decode_all(r, False, monkeypatch)
    for j, (a, b) in enumerate(zip(fast, ref)):
        assert _same(a, b), f"chunk {j} differs"
    if expect_fast:
        assert len(hits) == r.num_chunks, f"fused path took {len(hits)} of {r.num_chunks} chunks"


def test_kvc_golden_vectors(monkeypatch):
    d = ROOT / "spec" / "vectors" / "kvc"
    manifest = json.loads((d / "manifest.json").read_text())
    for _name, v in manifest["vectors"].items():
        data = (d / v["file"]).read_bytes()
        _compare_file(data, monkeypatch, expect_fast=False)


@pytest.mark.model
def test_real_cache_every_preset_bit_identical(real_cache, monkeypatch):
    import torch

    from kvcodec.format.writer import write_kvc
    from kvcodec.calibration.store import default_resolver
    from kvcodec.plan.presets import get_plan

    c = real_cache(128)
    c16 = c.to(torch.float16)
    import io

    for name in ("balanced", "near-lossless", "small", "lossless"):
        plan = get_plan(name, c16)
        for chunking in ({"chunk_tokens": 50, "chunk_heads": 2},) if name != "balanced" else ({}, {"chunk_tokens": 50, "chunk_heads": 2}):
            buf = io.BytesIO()
            write_kvc(c16, buf, plan, **chunking)
            _compare_file(buf.getvalue(), monkeypatch, default_resolver)
    # token-importance classes (tokenscale stage)
    imp = np.random.default_rng(0).random((c16.fingerprint.num_layers, c16.num_tokens))
    plan = get_plan("balanced", c16, tokenscale={}, importance=imp)
    buf = io.BytesIO()
    write_kvc(c16, buf, plan, chunk_tokens=50)
    _compare_file(buf.getvalue(), monkeypatch, default_resolver)
    # float32 cache (the capture's own dtype) through the balanced plan
    plan = get_plan("balanced", c)
    buf = io.BytesIO()
    write_kvc(c, buf, plan, chunk_tokens=64)
    _compare_file(buf.getvalue(), monkeypatch, default_resolver)


# --------------------------------------------------------------------------- other CPUs
@pytest.mark.slow
def test_fused_decoder_on_other_cpu_targets(tmp_path):
    """The vector steps compile and stay bit-identical for a baseline x86-64 (SSE2 only) and an
    AVX2 target, not just this machine's AVX-512: numba compiles for NUMBA_CPU_NAME in a fresh
    process (own cache dir), and the float16 conversion and synthetic-pipeline tests run there.
    The two targets' processes run side by side: each spends most of its time compiling on one core."""
    import os
    import subprocess
    import sys

    runs = {}
    for cpu in ("generic", "haswell"):
        env = dict(os.environ, NUMBA_CPU_NAME=cpu, NUMBA_CACHE_DIR=str(tmp_path / cpu / "numba"))
        runs[cpu] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(Path(__file__)),
                                      "-k", "f16_conversion or synthetic_pipelines or every_head_dim"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for cpu, p in runs.items():
            out, err = p.communicate(timeout=900)
            assert p.returncode == 0, f"{cpu}: " + out[-3000:] + err[-3000:]
            assert " passed" in out, cpu
    finally:
        for p in runs.values():
            p.kill()


_WARM_PROBE = r"""
import glob, json, sys
from numba.core.registry import CPUDispatcher
from kvcodec.decode.registry import warm_cpu
from kvcodec.format import KvcReader

def signatures():
    return {f"{n}.{a}": len(v.signatures) for n, m in list(sys.modules.items()) if n.startswith("kvcodec")
            for a, v in list(vars(m).items()) if isinstance(v, CPUDispatcher)}

warm_cpu()
warm = signatures()
problems = []
for path in sorted(glob.glob(sys.argv[1] + "/kvc*/*.kvc")):
    with open(path, "rb") as f:
        problems += KvcReader(f.read()).verify(backend="cpu")
print(json.dumps({"warm": warm, "after": signatures(), "problems": problems}))
"""


def test_warm_cpu_loads_every_kernel_signature_the_golden_files_decode_with(tmp_path):
    """``warm_cpu`` (a KDN worker calls it before its first job, issue 35) must leave nothing for a real file's
    first decode to load: numba keys its machine code on argument types, and a signature first met on a put costs
    that put ~0.3 s. A fresh process warms up, then decodes every `.kvc` golden vector (lossless float16 / float32 /
    bfloat16, lossy keys and values, biased and edited files): no kernel may gain a signature."""
    import subprocess
    import sys

    from store_fixtures import subprocess_env

    script = tmp_path / "probe.py"
    script.write_text(_WARM_PROBE)
    out = subprocess.run([sys.executable, str(script), str(ROOT / "spec" / "vectors")], capture_output=True, text=True,
                         env=subprocess_env(), timeout=600, check=True)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["problems"] == []
    assert res["warm"]["kvcodec.decode.cpu.fused._decode_kernel"] >= 1
    assert res["warm"]["kvcodec.decode.cpu.fused._unshuffle"] >= 1
    assert res["after"] == res["warm"], "a golden file's decode met a kernel signature warm_cpu did not load"
