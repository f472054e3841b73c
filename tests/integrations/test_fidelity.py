"""Lossy encodes of chunks an engine hands over (kvcodec.integrations.fidelity), through the vLLM connector's
entries (the LMCache serde's are in tests/integrations/lmcache): a chunk unlike the model's KV is stored lossless,
the decision recorded, and the model's own KV keeps its lossy bytes, unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.format import KvcReader
from kvcodec.integrations.vllm.config import LAYOUT
from kvcodec.integrations.vllm.entries import check_entry, encode_chunk, fetch_chunk, usable_run

pytestmark = pytest.mark.model
T = 64


@pytest.fixture(scope="module")
def fp():
    from kvcodec.models.fingerprint import fingerprint_dir
    from kvcodec.models.load import resolve_model_dir

    return fingerprint_dir(resolve_model_dir("smollm2"))


def _planes(fp, fill):
    h, d = fp.num_kv_heads, fp.head_dims[0]
    ks = [fill((h, T, d)).to(torch.bfloat16) for _ in range(fp.num_layers)]
    vs = [fill((h, T, d)).to(torch.bfloat16) for _ in range(fp.num_layers)]
    return ks, vs


def _outlier(shape):
    t = torch.zeros(shape)
    t[1, 5, 7] = 5000.0
    return t


def _nan(shape):
    t = torch.randn(shape)
    t[0, 3, 5] = float("nan")
    return t


@pytest.mark.parametrize("fill", [torch.zeros, lambda s: torch.full(s, 3.0), lambda s: torch.randn(s) * 1e4, _outlier,
                                  _nan, lambda s: torch.randn(s) * 1e37],
                         ids=["zeros", "constant", "huge", "one-outlier", "nan", "past-fp16"])
def test_a_chunk_unlike_the_models_kv_is_stored_lossless(fp, fill):
    """Before: ``balanced`` decoded an all-zero chunk with errors up to 2.4 (the calibration's mean outside the kept
    coefficients came back), a constant 3.0 up to 7.8, values of scale 1e4 with errors of 3.8e4 and one outlier of
    5,000 with errors of 32 over its whole head, silently; a NaN or values past float16's steps were not stored at
    all (the lossy codec's refusal). Now each is stored bit-exact, the decision in the meta."""
    torch.manual_seed(0)
    ks, vs = _planes(fp, fill)
    ids = list(range(T))
    data = encode_chunk(fp, "balanced", ids, 0, T, ks, vs)
    r = KvcReader(data, max_decoded_ratio=0)
    assert check_entry(r, fp, ids, 0, T) is None
    assert r.header.meta["fallback_from"] == "balanced" and r.header.meta["fallback_why"]
    for i, k, v in r.iter_layers():
        assert torch.equal(k.view(torch.int16), ks[i].view(torch.int16)) and torch.equal(v.view(torch.int16),
                                                                                         vs[i].view(torch.int16))


def test_the_models_own_kv_keeps_its_lossy_bytes(lm, fp):
    """Real SmolLM2 KV is not second-guessed: the same bytes as the plain lossy encode, no fallback."""
    from kvcodec.api import encode_cache
    from kvcodec.core.kvcache import KVCache
    from kvcodec.models.capture import capture
    from kvcodec.texts import load_text

    cache = capture(lm, text=load_text("gpl3"), max_tokens=2 * T)
    ids = [int(x) for x in cache.token_ids]
    ks = [k[:, T:].to(torch.bfloat16).contiguous() for k in cache.keys]
    vs = [v[:, T:].to(torch.bfloat16).contiguous() for v in cache.values]
    data = encode_chunk(fp, "balanced", ids, T, 2 * T, ks, vs)
    plain = KVCache(ks, vs, np.asarray(ids, dtype=np.int64), fp, np.arange(T, 2 * T),
                    {"source": "vllm", "layout": LAYOUT, "start": T, "end": 2 * T})
    assert data == encode_cache(plain, "balanced", meta=plain.meta).data
    assert "fallback_from" not in KvcReader(data).header.meta


def test_a_lossless_chunk_of_zeros_loads(tmp_path, fp):
    """A chunk of zeros is a few KB lossless for megabytes of K/V: the reader's default ratio limit (256x its size)
    refused it at every lookup (usable_run's header check) and load, so the connector evicted it and vLLM recomputed
    it, for ever. The request bounds what the entry may declare instead."""
    from kvcodec.store import Store, StoreKey
    from kvcodec.store.keys import codec_key

    n = 256
    h, d = fp.num_kv_heads, fp.head_dims[0]
    ks = [torch.zeros(h, n, d, dtype=torch.bfloat16) for _ in range(fp.num_layers)]
    ids = list(range(n))
    data = encode_chunk(fp, "lossless", ids, 0, n, ks, ks)
    assert len(data) * 256 < 2 * fp.num_layers * n * h * d * 4
    with Store.open(str(tmp_path / "s")) as st:
        key = StoreKey("smollm2", codec_key("lossless"), "default", n, "0" * 64)
        st.put(key, data)
        assert usable_run(st, [key], fp, ids, n) == 1  # the lookup's header check: before, evicted here
        r = fetch_chunk(st, key, fp, ids, 0, n)
        assert torch.equal(r.read_layer(3)[0], ks[3])
        r.close()


@pytest.mark.parametrize("fill", [None, torch.zeros, lambda s: torch.full(s, 3.0), _outlier],
                         ids=["real", "zeros", "constant", "one-outlier"])
def test_the_check_reads_the_read_backs_errors_and_decodes_nothing_more(lm, fp, fill, monkeypatch):
    """The writer's read-back already decodes every chunk: the check takes its errors (Encoded.readback_errors, per
    layer and K/V) instead of decoding the file a second time, which cost 1.26-1.30x the LMCache serde's encode
    CPU-s. Same figures (to float rounding) and same verdict as decoding again; with verify="off" it still decodes."""
    from kvcodec.api import encode_cache
    from kvcodec.calibration.store import load_calibration
    from kvcodec.core.kvcache import KVCache
    from kvcodec.integrations import fidelity
    from kvcodec.models.capture import capture
    from kvcodec.texts import load_text

    torch.manual_seed(0)
    if fill is None:
        cache = capture(lm, text=load_text("gpl3"), max_tokens=T)
        ks = [k.to(torch.bfloat16).contiguous() for k in cache.keys]
        vs = [v.to(torch.bfloat16).contiguous() for v in cache.values]
    else:
        ks, vs = _planes(fp, fill)
    plain = KVCache(ks, vs, np.arange(T, dtype=np.int64), fp, None, {})
    steps = fidelity.layer_steps_of("balanced", None, load_calibration(fp.id))
    read = encode_cache(plain, "balanced")
    again = encode_cache(plain, "balanced", verify="off")
    assert read.data == again.data and again.readback_errors is None
    assert sorted(read.readback_errors) == [(i, kv) for i in range(fp.num_layers) for kv in "kv"]
    decoded = fidelity._decoded_errors(plain, again.data)
    for lk, s in read.readback_errors.items():  # the read-back measures the float32 decode, the reader hands
        # over bfloat16 (the cache's dtype): an error differs by a decoded value's rounding (2**-8 of it) at most
        np.testing.assert_allclose((s.rms_err, s.max_err, s.rms_x, s.max_x), decoded[lk], rtol=0,
                                   atol=2 ** -8 * (s.max_x + s.max_err) + 1e-9)
    verdict = fidelity.misfit(plain, again, steps)  # decoded again
    monkeypatch.setattr(fidelity, "_decoded_errors", lambda *a: pytest.fail("decoded the file a second time"))
    got = fidelity.misfit(plain, read, steps)
    assert (got is None) == (verdict is None)  # same verdict, on the same layer (its figures to rounding)
    assert got is None or got.split(":")[0] == verdict.split(":")[0]
    assert (verdict is None) == (fill is None)
