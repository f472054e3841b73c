"""The Triton rANS decoder under TRITON_INTERPRET=1: bit-exact with the CPU reference.

No GPU needed: the interpreter runs the real kernels on CPU tensors.
TRITON_INTERPRET=1 must be set before triton is first imported (triton.language's
own jit helpers such as tl.cumsum are built at import time), so this module sets
it at the top, at collection time; it stays set for the pytest process (no
other kvcodec code behaves differently under it). Sizes are
kept small (hundreds to a few thousand symbols per case) because the
interpreter is slow and CI has 2 cores.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports triton; "0" on a GPU (benchmarks/gpu_check)

import numpy as np
import pytest

triton = pytest.importorskip("triton")

from kvcodec.entropy import rans  # noqa: E402
from kvcodec.codecs.rans import RansStage  # noqa: E402
from kvcodec.errors import KvcFormatError  # noqa: E402
from kvcodec.decode.device import gpu_device  # noqa: E402
from kvcodec.core.stage import ArraySpec, ChunkContext  # noqa: E402

pytestmark = pytest.mark.triton
DEV = gpu_device()  # the kernels' device: the CPU under the interpreter, the GPU when compiled (TRITON_INTERPRET=0)

VEC = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "rans"


def _gpu(data, shape, g=None, table=None):
    from kvcodec.decode.triton.rans_kernel import decode_stage

    return decode_stage(data, shape, g, DEV, table=table).cpu().numpy()


def _cpu(data, shape, g=None):
    return RansStage(g).decode(data, {}, ArraySpec(tuple(shape), "uint8"), ChunkContext())


def _roundtrip(arr, g=None, tables=(False, True)):
    data, _ = RansStage(g).encode(arr, ChunkContext())
    ref = _cpu(data, arr.shape, g)
    assert np.array_equal(ref, arr)
    for table in tables:
        out = _gpu(data, arr.shape, g, table=table)
        assert out.dtype == np.uint8 and out.shape == arr.shape
        np.testing.assert_array_equal(out, ref)
    return data


# ---------------------------------------------------------------------- golden vectors


def test_spec_vectors():
    man = json.loads((VEC / "manifest.json").read_text())
    assert man["vectors"]
    for v in man["vectors"]:
        arr = np.load(VEC / v["input"])
        data = (VEC / v["encoded"]).read_bytes()
        g = v["config"].get("channel_group")
        for table in (False, True):
            np.testing.assert_array_equal(_gpu(data, arr.shape, g, table=table), arr, err_msg=v["name"])


# ---------------------------------------------------------------------- odd sizes


@pytest.mark.parametrize(
    "shape,g,alphabet",
    [
        ((1, 1, 1), None, 1),  # one symbol, f = 4096
        ((1, 1, 1), None, 8),
        ((1, 31, 1), None, 16),  # a single partial step
        ((1, 33, 1), None, 16),  # a full step + one lane
        ((1, 1, 64), None, 16),  # one token, 64 symbols
        ((3, 1, 8), 4, 16),  # one token per context: a context shorter than a lane group
        ((2, 7, 12), 3, 200),  # odd group, large alphabet
        ((1, 40, 16), 1, 256),  # g = 1: one context per channel
        ((2, 0, 8), None, 4),  # no tokens at all
    ],
)
def test_odd_sizes(shape, g, alphabet):
    rng = np.random.default_rng(hash((shape, g, alphabet)) % 2**32)
    arr = np.clip(np.round(rng.laplace(0, max(1.0, alphabet / 8), size=shape)) + alphabet // 2, 0, alphabet - 1).astype(np.uint8)
    _roundtrip(arr, g)


def test_explicit_tables_with_zero_frequencies():
    rng = np.random.default_rng(5)
    sym = rng.choice([0, 3, 7], size=(4, 100), p=[0.7, 0.2, 0.1]).astype(np.uint8)
    freqs = np.zeros((4, 10), np.uint32)
    freqs[:, 0], freqs[:, 3], freqs[:, 7], freqs[:, 9] = 2000, 1000, 1000, 96  # 9 never occurs
    data = rans.encode_contexts(sym, freqs)
    for table in (False, True):
        np.testing.assert_array_equal(_gpu(data, (4, 100, 1), 1, table=table).reshape(4, 100), sym)


def test_batched_launch_matches_single():
    from kvcodec.decode.triton.rans_kernel import RansItem, decode_streams

    rng = np.random.default_rng(1)
    arrs = [rng.integers(0, 16, size=(2, 9, 8), dtype=np.uint8), rng.integers(0, 4, size=(1, 33, 2), dtype=np.uint8),
            rng.integers(0, 16, size=(2, 5, 8), dtype=np.uint8), np.zeros((1, 0, 4), np.uint8)]
    items = [RansItem(RansStage(None).encode(a, ChunkContext())[0], a.shape, None) for a in arrs]
    outs = decode_streams(items, DEV)
    for a, o in zip(arrs, outs):
        np.testing.assert_array_equal(o.cpu().numpy(), a)
    import torch

    given = [torch.full(a.shape, 255, dtype=torch.uint8, device=DEV) for a in arrs]
    decode_streams(items, DEV, outs=given)
    for a, o in zip(arrs, given):
        np.testing.assert_array_equal(o.cpu().numpy(), a)


# ---------------------------------------------------------------------- real KV symbols


@pytest.fixture(scope="module")
def real_symbols(small_cache):
    """Quantized symbols of a real 16-token SmolLM2 cache (layers 0 and 7, K and V), as the codec makes them."""
    from kvcodec.codecs.quantize import QuantizeStage

    out = []
    for layer in (0, 7):
        for kind, t in (("k", small_cache.keys[layer]), ("v", small_cache.values[layer])):
            x = t[:, :16].float().numpy()
            for q in (QuantizeStage(mode="step", step=0.05, max_bits=8), QuantizeStage(mode="minmax", bits=4, axis="channel", group=8)):
                sym, _ = q.encode(x, ChunkContext(layer=layer, kind=kind))
                out.append(sym)
    return out


@pytest.mark.model
def test_real_kv_symbols(real_symbols):
    for i, sym in enumerate(real_symbols):
        _roundtrip(sym, None if i % 2 else 16, tables=(i % 3 == 0,))


@pytest.mark.model
def test_real_kv_batched(real_symbols):
    from kvcodec.decode.triton.rans_kernel import RansItem, decode_streams

    items = [RansItem(RansStage(8).encode(s, ChunkContext())[0], s.shape, 8) for s in real_symbols]
    for s, o in zip(real_symbols, decode_streams(items, DEV)):
        np.testing.assert_array_equal(o.cpu().numpy(), s)


# ---------------------------------------------------------------------- malformed streams


def _err(fn):
    try:
        fn()
    except KvcFormatError as exc:
        return str(exc)
    return None


def _corruptions(data: bytes, shape) -> list[bytes]:
    st = rans.parse_header(data)
    body = int(st.data_offsets[0])
    w0 = int(st.word_start[0]) * 2
    out = [
        data[:-4],  # truncated
        data[:3],  # shorter than the header
        data + b"\0\0\0\0",  # trailing bytes
        bytes([data[0] ^ 1]) + data[1:],  # context count
        data[:6] + bytes([data[6] ^ 2]) + data[7:],  # symbol count
        data[:10] + bytes([data[10] + 1]) + data[11:],  # word count
        data[:14] + bytes([data[14] ^ 0x01]) + data[15:],  # a frequency -> sum != 4096
        data[:body + 3] + bytes([0]) + data[body + 4 :],  # lane 0 state below L
        data[:body] + bytes([data[body] ^ 0x55]) + data[body + 1 :],  # lane 0 state: wrong final state
    ]
    for k in (0, 7, 30):  # flipped payload words -> final-state / overrun / underrun in the kernel
        if w0 + 2 * k + 1 < len(data) and int(st.n_words[0]) > k:
            b = bytearray(data)
            b[w0 + 2 * k + 1] ^= 0x80
            out.append(bytes(b))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_malformed_streams_raise_like_cpu(seed):
    rng = np.random.default_rng(seed)
    arr = np.clip(np.round(rng.laplace(0, 2.0, size=(2, 20, 8))) + 8, 0, 15).astype(np.uint8)
    data, _ = RansStage(None).encode(arr, ChunkContext())
    n_checked = 0
    for bad in _corruptions(data, arr.shape):
        cpu = _err(lambda: _cpu(bad, arr.shape))
        for table in (False, True):
            gpu = _err(lambda: _gpu(bad, arr.shape, None, table=table))
            assert gpu == cpu, (cpu, gpu)
        n_checked += cpu is not None
    assert n_checked >= 9


def test_kernel_detected_errors_have_cpu_messages():
    """Overrun, unread words and a wrong final state are found by the kernel itself."""
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 16, size=(1, 64, 4), dtype=np.uint8)
    data, _ = RansStage(None).encode(arr, ChunkContext())
    st = rans.parse_header(data)
    msgs = set()
    for k in range(int(st.n_words[0])):
        for bit in (0x01, 0x80):
            b = bytearray(data)
            b[int(st.word_start[0]) * 2 + 2 * k + 1] ^= bit
            cpu = _err(lambda: _cpu(bytes(b), arr.shape))
            gpu = _err(lambda: _gpu(bytes(b), arr.shape))
            assert cpu == gpu
            if cpu:
                msgs.add(cpu.split("context 0 ")[-1])
        if len(msgs) >= 2:
            break
    assert msgs, "no corruption was detected"


def test_wrong_shape_is_rejected_like_cpu():
    arr = np.zeros((2, 4, 8), np.uint8)
    data, _ = RansStage(None).encode(arr, ChunkContext())
    for shape in ((2, 5, 8), (1, 4, 8), (2, 4, 16)):
        cpu, gpu = _err(lambda: _cpu(data, shape)), _err(lambda: _gpu(data, shape))
        assert cpu is not None and cpu == gpu


# ---------------------------------------------------------------------- rans v2 (a bank of tables per block)

VEC2 = VEC.parent / "rans-v2"


def _v2(arr, g, block):
    from kvcodec.codecs.rans import RansBankStage

    return RansBankStage(g, block_tokens=block, tables=4).encode(arr, ChunkContext())[0]


def test_v2_spec_vectors():
    from kvcodec.decode.triton.rans_kernel import decode_stage

    man = json.loads((VEC2 / "manifest.json").read_text())
    for v in man["vectors"]:
        arr = np.load(VEC2 / v["input"])
        data = (VEC2 / v["encoded"]).read_bytes()
        cfg = v["config"]
        for table in (False, True):
            out = decode_stage(data, arr.shape, cfg.get("channel_group"), DEV, table=table, block_tokens=cfg["block_tokens"])
            np.testing.assert_array_equal(out.cpu().numpy(), arr, err_msg=v["name"])


@pytest.mark.parametrize("shape,g,block", [((2, 100, 16), 8, 32), ((1, 70, 3), None, 32), ((1, 300, 2), 1, 64),
                                           ((3, 1, 8), 4, 64), ((2, 0, 8), None, 32)])
def test_v2_roundtrip_and_mixed_batch(shape, g, block):
    from kvcodec.decode.triton.rans_kernel import RansItem, decode_stage, decode_streams

    rng = np.random.default_rng(sum(shape))
    scale = np.repeat(rng.uniform(0.3, 6, (shape[0], shape[1] // 32 + 1)), 32, axis=1)[:, : shape[1], None]
    arr = np.clip(np.abs(np.round(rng.laplace(0, 1, shape) * scale)) * 2, 0, 60).astype(np.uint8)
    data = _v2(arr, g, block)
    for table in (False, True):
        np.testing.assert_array_equal(decode_stage(data, shape, g, DEV, table=table, block_tokens=block).cpu().numpy(), arr)
    other = rng.integers(0, 16, (2, 40, 8), dtype=np.uint8)  # a v1 item in the same call
    items = [RansItem(data, shape, g, block), RansItem(RansStage(8).encode(other, ChunkContext())[0], other.shape, 8),
             RansItem(data, shape, g, block)]
    for a, o in zip([arr, other, arr], decode_streams(items, DEV)):
        np.testing.assert_array_equal(o.cpu().numpy(), a)


def test_v2_malformed_like_cpu():
    from kvcodec.codecs.rans import RansBankStage
    from kvcodec.decode.triton.rans_kernel import decode_stage

    arr = np.random.default_rng(2).integers(0, 9, (2, 64, 8), dtype=np.uint8)
    data = bytearray(_v2(arr, 4, 32))
    st = RansBankStage(4, block_tokens=32, tables=4)
    rng = np.random.default_rng(3)
    for _ in range(40):
        b = bytearray(data)
        b[int(rng.integers(8, len(b)))] ^= int(rng.integers(1, 256))
        try:
            want = st.decode(bytes(b), {}, ArraySpec(arr.shape, "uint8"), ChunkContext())
        except KvcFormatError as e:
            with pytest.raises(KvcFormatError) as g:
                decode_stage(bytes(b), arr.shape, 4, DEV, block_tokens=32)
            assert str(g.value) == str(e)
            continue
        np.testing.assert_array_equal(decode_stage(bytes(b), arr.shape, 4, DEV, block_tokens=32).cpu().numpy(), want)
