"""The llama.cpp loader's bookkeeping (kvcodec.integrations.llamacpp.load_kvc) around llama.cpp's calls, against a
stand-in for llama-cpp-python's ``Llama`` and C API: runs without llama.cpp (tests/integrations/test_llamacpp.py
checks the state itself against the real library)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import kvcodec.integrations.llamacpp as lcp
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.core.kvcache import KVCache
from kvcodec.errors import KvcError, KvcInputError
from kvcodec.format import KvcReader

FP = ModelFingerprint("llama", 2, 3, (64, 64), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, config_sha256="d" * 64)
SHAPE = lcp.LlamaShape(n_layer=2, n_head_kv=3, head_dim=64, n_vocab=1000, n_ctx=64, rope_type=lcp.ROPE_NEOX,
                       v_trans=False, type_k=lcp.GGML_TYPE_F16, type_v=lcp.GGML_TYPE_F16)
T = 10


class _Llm:
    """A llama-cpp-python ``Llama`` that has already evaluated 30 tokens of another document (a reused context)."""

    def __init__(self):
        self.ctx, self.model, self.model_path = object(), object(), "x.gguf"
        self.n_tokens = 30
        self.input_ids = np.full(64, 999, dtype=np.intc)
        self.cells = 30  # what llama.cpp's memory holds

    def n_ctx(self):
        return 64


def _api(llm, accept: bool):
    def clear(mem, data):
        llm.cells = 0

    def set_data(ctx, arr, n, seq):
        if not accept:
            return 0
        llm.cells = T
        return n

    return types.SimpleNamespace(llama_get_memory=lambda ctx: None, llama_memory_clear=clear,
                                 llama_state_seq_set_data=set_data)


@pytest.fixture
def kvc():
    from kvcodec.api import encode_cache

    g = torch.Generator().manual_seed(0)
    ks = [torch.randn(3, T, 64, generator=g).to(torch.float16) for _ in range(2)]
    return encode_cache(KVCache(ks, ks, np.arange(5, 5 + T), FP), "lossless").data


def _load(monkeypatch, llm, source, accept=True):
    monkeypatch.setattr(lcp, "_llama_cpp", lambda: _api(llm, accept))
    monkeypatch.setattr(lcp.LlamaShape, "of", classmethod(lambda cls, _llm: SHAPE))
    return lcp.load_kvc(llm, source, identity=FP)


def test_a_refused_state_leaves_no_stale_token_count(monkeypatch, kvc):
    """Before: llama.cpp's memory was cleared, llama.cpp refused the state, and the reused context kept its old
    n_tokens (30): the next eval continued at position 30 over an empty cache, silently. Now the count is 0, as the
    memory; a load that llama.cpp takes sets both to the file's tokens."""
    llm = _Llm()
    with pytest.raises(KvcInputError, match="refused"):
        _load(monkeypatch, llm, kvc, accept=False)
    assert llm.n_tokens == 0 == llm.cells
    assert _load(monkeypatch, llm, kvc) == T
    assert llm.n_tokens == T == llm.cells and list(llm.input_ids[:T]) == list(range(5, 5 + T))


class _Lying(KvcReader):
    ids: np.ndarray

    @property
    def token_ids(self):
        return self.ids


@pytest.mark.parametrize("ids", [np.array([7]), np.arange(T + 3), np.arange(-1, T - 1)], ids=["one", "more", "negative"])
def test_token_ids_that_disagree_with_the_kv_are_refused(monkeypatch, kvc, ids):
    """A file whose token ids disagree with its K/V (count or value): one id was broadcast over every position of
    the context's token record, another count escaped as numpy's ValueError, after the cache was cleared. Now one
    KvcError line, and the context is untouched."""
    llm = _Llm()
    r = _Lying(kvc)
    r.ids = ids
    with pytest.raises(KvcError) as e:
        _load(monkeypatch, llm, r)
    assert "\n" not in str(e.value)
    assert llm.n_tokens == 30 == llm.cells and (llm.input_ids == 999).all()


@pytest.mark.parametrize("ids", [[1.7, 2.2], "abc", [5, 1000], [-1, 3], []], ids=["floats", "str", "past-vocab",
                                                                                   "negative", "empty"])
def test_capture_checks_its_ids_before_llama_cpp(monkeypatch, ids):
    """Before: float ids were truncated (1.7 -> 1) and captured under the key of other tokens, "abc" escaped as
    ValueError, ids past the vocabulary or negative reached llama.cpp's prefill after its memory was cleared. Now
    one KvcInputError line, and the context is untouched."""
    llm = _Llm()
    monkeypatch.setattr(lcp, "_llama_cpp", lambda: _api(llm, True))
    monkeypatch.setattr(lcp.LlamaShape, "of", classmethod(lambda cls, _llm: SHAPE))
    with pytest.raises(KvcInputError) as e:
        lcp.capture_llamacpp(llm, ids, identity=FP)
    assert "\n" not in str(e.value)
    assert llm.n_tokens == 30 == llm.cells


def test_a_closed_or_foreign_llm_is_one_line(monkeypatch, kvc):
    """After ``Llama.close()`` its model and context handles are None, which ctypes passed to llama.cpp as NULL
    pointers, unchecked by its C API. Now one KvcInputError line before llama.cpp is called
    (the real shape probe runs here: any llama.cpp call would fail the test), and anything else is one line too."""
    closed = _Llm()
    closed.model = closed.ctx = None
    calls = []
    monkeypatch.setattr(lcp, "_llama_cpp", lambda: types.SimpleNamespace(**{
        n: (lambda *a, n=n: calls.append(n)) for n in ("llama_model_n_head", "llama_model_n_layer",
                                                        "llama_get_memory", "llama_memory_clear")}))
    for llm in (closed, None, "model.gguf"):
        for call in (lambda: lcp.load_kvc(llm, kvc, identity=FP), lambda: lcp.capture_llamacpp(llm, [1, 2], FP)):
            with pytest.raises(KvcInputError) as e:
                call()
            assert "\n" not in str(e.value)
    assert calls == []
