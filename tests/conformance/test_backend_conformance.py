"""The decoder registry's conformance harness: every backend against the reference, bit for bit.

Inputs: the golden vectors (every `.kvc` vector chunk, every rANS stream) and a real SmolLM2 cache
encoded with every preset (tokenscale classes from the model's attention importance included) and
a baseline. A backend is run on every chunk it declares it supports; the harness also requires
that each registered backend was exercised at least once, so a backend whose ``supports`` stops
matching anything fails here instead of silently never running. GPU backends run their real
Triton kernels under TRITON_INTERPRET=1 (tests/conftest.py) on layer 0 of three of the real-cache
files (lossless, the tokenscale chain, a baseline: the interpreter is slow; tests/decode/test_cuda_stages.py
covers the GPU kernels in depth); CPU backends run on every chunk of every file.
"""

from __future__ import annotations

import io
import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from kvcodec.decode.registry import STRICT_ENV, Backend, backend, backends, decode_with, select
from kvcodec.errors import KvcBackendError
from kvcodec.format import KvcReader, write_kvc
from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline, stage_from_json

ROOT = Path(__file__).resolve().parents[2]
GPU_LAYERS = 1  # Triton interpreter (slow): layer 0 of the real-cache files marked for the GPU backends


def _bits(x) -> np.ndarray:
    if hasattr(x, "detach"):
        import torch

        x = x.detach().cpu()
        if x.dtype == torch.bfloat16:
            x = x.view(torch.int16)
        x = x.numpy()
    x = np.ascontiguousarray(x)
    return x.view(np.uint8).reshape(-1)


def _gpu_usable() -> bool:
    try:
        from kvcodec.decode.device import gpu_device

        gpu_device()
    except Exception:
        return False
    return True


def _backends(device: str) -> list[Backend]:
    return [b for b in backends() if b.device == device and (device == "cpu" or _gpu_usable())]


def _check_chunk(pipe: Pipeline, payload, sides, sizes, spec: ArraySpec, ctx: ChunkContext, used: set[str],
                 gpu: bool = True) -> None:
    ref = _bits(backend("reference").decode(pipe, payload, sides, sizes, spec, ctx))
    for b in _backends("cpu") + (_backends("gpu") if gpu else []):
        if b.name == "reference" or not b.supports(pipe, spec):
            continue
        got = _bits(b.decode(pipe, payload, sides, sizes, spec, ctx))
        assert np.array_equal(got, ref), f"backend {b.name} differs from the reference on {pipe.to_json()}"
        used.add(b.name)


def _check_file(data: bytes, used: set[str], gpu_layers: int | None = None) -> int:
    n = 0
    with KvcReader(data) as r:
        for j in range(r.num_chunks):
            layer = r.chunk_info(j).layer
            _check_chunk(*r.chunk_inputs(j), used, gpu=gpu_layers is None or layer < gpu_layers)
            n += 1
    return n


@pytest.fixture(scope="module")
def used() -> set[str]:
    return set()


@pytest.mark.parametrize("subdir", ["kvc", "kvc-lossy"])
def test_golden_kvc_vectors_every_backend(used, subdir):
    d = ROOT / "spec" / "vectors" / subdir
    manifest = json.loads((d / "manifest.json").read_text())
    # the lossy vector's 60 chunks run one chain; the Triton interpreter takes ~4 s a chunk on CI's CPU,
    # so the GPU backends check the first two layers' chunks (K and V) and the CPU backends all of them
    gpu_layers = 2 if subdir == "kvc-lossy" else None
    n = sum(_check_file((d / v["file"]).read_bytes(), used, gpu_layers) for v in manifest["vectors"].values())
    assert n > 0


def test_golden_rans_vectors_every_backend(used):
    d = ROOT / "spec" / "vectors" / "rans"
    manifest = json.loads((d / "manifest.json").read_text())
    for v in manifest["vectors"]:
        if "freqs" in v:  # coded with an explicit table, not by the stage: no stage pipeline decodes it
            continue
        pipe = Pipeline([stage_from_json({"name": "rans", "version": 1, "config": v["config"]})])
        data = (d / v["encoded"]).read_bytes()
        spec = ArraySpec(tuple(v["shape"]), "uint8")
        want = np.load(d / v["input"], allow_pickle=False)
        assert np.array_equal(backend("reference").decode(pipe, data, [{}], [], spec, ChunkContext()), want)
        _check_chunk(pipe, data, [{}], [], spec, ChunkContext(), used)


@pytest.mark.model
def test_real_cache_every_preset_every_backend(used, lm, small_cache):
    from kvcodec.plan.baselines import BASELINES  # noqa: F401  (baseline names)
    from kvcodec.plan.presets import get_plan
    from kvcodec.models.importance import cache_importance

    imp = cache_importance(lm, small_cache)
    plans = [(get_plan(p, small_cache), p in ("lossless", "near-lossless")) for p in ("lossless", "fp16", "zstd", "raw", "near-lossless", "small")]
    plans.append((get_plan("balanced", small_cache, importance=imp), True))  # tokenscale classes from the model
    plans.append((get_plan("balanced", small_cache, basis="hadamard", importance=imp), False))
    plans.append((get_plan("baseline:kivi2", small_cache), True))
    for plan, on_gpu in plans:
        buf = io.BytesIO()
        write_kvc(small_cache, buf, plan,
                  chunk_tokens=plan.chunk_tokens or 40)
        assert _check_file(buf.getvalue(), used, gpu_layers=GPU_LAYERS if on_gpu else 0) > 0


@pytest.mark.model  # needs the real-cache run above (the golden vectors hold no lossy chain for the fused GPU kernel)
def test_every_registered_backend_was_exercised(used):
    """Runs after the three above (file order): each backend that can run here decoded something."""
    runnable = {b.name for b in _backends("cpu") + _backends("gpu") if b.name != "reference"}
    assert runnable and runnable <= used, f"never exercised: {sorted(runnable - used)}"


def test_the_registry_picks_the_fastest_eligible_backend(small_cache):
    from kvcodec.plan.presets import get_plan

    spec = ArraySpec((small_cache.fingerprint.num_kv_heads, small_cache.num_tokens, 64), "float32")
    lossy = get_plan("balanced", small_cache).pipelines(0, "k")
    assert [b.name for b in select(lossy, spec, "cpu")] == ["numba-fused", "reference"]
    assert [b.name for b in select(lossy, spec, "gpu")] == ["triton-fused", "triton-stages"]
    odd = ArraySpec((3, small_cache.num_tokens, 48), "float32")  # head_dim the fused CPU kernel does not take
    assert [b.name for b in select(lossy, odd, "cpu")] == ["reference"]
    assert [b.name for b in select(lossy, ArraySpec(spec.shape, "bfloat16"), "cpu")] == ["reference"]


def _lossless_chunk():
    from kvcodec.codecs.lossless import lossless_pipeline

    pipe = lossless_pipeline("float16")
    x = (np.arange(2 * 7 * 64, dtype=np.float32).reshape(2, 7, 64) / 100).astype(np.float16)
    payload, sides, sizes = pipe.encode(x, ChunkContext())
    return pipe, payload, sides, sizes, ArraySpec(x.shape, "float16"), x


def test_a_failing_backend_raises_in_tests_and_warns_once_in_production(monkeypatch):
    """No silent fallback: a backend that applies but fails on a chunk the reference decodes is a bug."""
    import kvcodec.decode.cpu.fused as fd

    pipe, payload, sides, sizes, spec, x = _lossless_chunk()
    assert select(pipe, spec)[0].name == "numba-fused"

    def broken(*a, **k):
        raise ValueError("simulated kernel bug")

    monkeypatch.setattr(fd, "decode", broken)
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(KvcBackendError, match="numba-fused"):
        decode_with(pipe, payload, sides, sizes, spec, ChunkContext())
    monkeypatch.setenv(STRICT_ENV, "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        trace: list[str] = []
        for _ in range(3):
            out = decode_with(pipe, payload, sides, sizes, spec, ChunkContext(), trace=trace)
            assert np.array_equal(out.view(np.uint16), x.view(np.uint16))
    assert trace == ["reference"] * 3
    assert len([w for w in caught if "numba-fused" in str(w.message)]) == 1


def test_a_bad_chunk_gets_the_reference_error_not_a_backend_error(monkeypatch):
    """Malformed data that both the backend and the reference refuse is the file's fault: the spec's error."""
    from kvcodec.errors import KvcFormatError
    from kvcodec.decode.registry import decode_chunk

    pipe, payload, sides, sizes, spec, _ = _lossless_chunk()
    bad = bytes(payload[:-7])
    monkeypatch.setenv(STRICT_ENV, "1")
    with pytest.raises(KvcFormatError) as exc:
        decode_chunk(pipe, bad, sides, sizes, spec, ChunkContext(), "cpu")
    assert not isinstance(exc.value, KvcBackendError)
