"""Issue 20: one `.kvc` feeds llama.cpp (kvcodec.integrations.llamacpp), checked against llama.cpp's own prefill.

The `.kvc` is captured by HF on the embedded model's fp32 conversion; llama.cpp
runs the GGUF itself. Loading it must give llama.cpp the KV it would have
computed (same layout, RoPE pairing, transposed or not), so greedy tokens
after the load equal greedy tokens after llama.cpp's own prefill. CI installs
llama-cpp-python with .ci/llama.sh; there a missing install fails the tests
instead of skipping them.
"""

from __future__ import annotations

import ctypes
import os
import struct

import numpy as np
import pytest

if os.environ.get("CI"):
    import llama_cpp  # noqa: F401  (CI must have it: .ci/llama.sh)
else:
    pytest.importorskip("llama_cpp")

from kvcodec.models.capture import capture, tokenize  # noqa: E402
from kvcodec.errors import KvcInputError, KvcModelMismatchError  # noqa: E402
from kvcodec.format import encode_kvc_bytes  # noqa: E402
from kvcodec.api import make_plan
from kvcodec.plan.presets import get_plan
from kvcodec.integrations.llamacpp import LlamaShape, capture_llamacpp, check_target, gguf_fingerprint, load_kvc  # noqa: E402
from kvcodec.models.load import _gguf_path  # noqa: E402

pytestmark = pytest.mark.model

N_DOC, N_GREEDY = 200, 12
QUESTION = "\n\nQuestion: What does this license say about warranties?\nAnswer:"


def _llm(flash_attn: bool = True, kv: int = 1, n_ctx: int = 512):
    """llama.cpp on the GGUF, one thread, its plain CPU kernels.

    Plain kernels: llama.cpp's extra CPU buffer types (AMX int8 tiles on Xeons that have them, weight repacking)
    run the Q4_1 matmuls with their own activation quantisation. On an AMX Xeon its own prefill then parts from
    HF's KV by 0.12-0.22 (relative, per layer) where the plain kernels stay under 0.1, and teacher-forced greedy
    agreement after loading HF's KV falls to 8 of 12. These tests check the loader's layout against llama.cpp's
    own KV, so they pin the kernels that do not depend on the CPU (``use_extra_bufts`` off; llama-cpp-python
    exposes it only through the default model parameters).
    """
    import llama_cpp
    import llama_cpp.llama_cpp as capi

    default = capi.llama_model_default_params

    def plain_kernels():
        params = default()
        params.use_extra_bufts = False
        return params

    capi.llama_model_default_params = plain_kernels
    try:
        # One thread: llama.cpp's spinning thread barriers crawl on a shared, oversubscribed CPU.
        return llama_cpp.Llama(model_path=str(_gguf_path()), n_ctx=n_ctx, n_threads=1, n_threads_batch=1,
                               flash_attn=flash_attn, type_k=kv, type_v=kv, verbose=False)
    finally:
        capi.llama_model_default_params = default


def _greedy(llm, first: list[int], n: int) -> list[int]:
    import llama_cpp

    out = []
    llm.eval(first)
    for _ in range(n):
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        tok = int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).argmax())
        out.append(tok)
        llm.eval([tok])
    return out


def _own_prefill(llm, doc: np.ndarray, q: np.ndarray) -> list[int]:
    llm.reset()
    llm._ctx.kv_cache_clear()
    llm.eval(doc.tolist())
    return _greedy(llm, q.tolist(), N_GREEDY)


@pytest.fixture(scope="module")
def doc(gpl3_ids):
    return gpl3_ids[:N_DOC]


@pytest.fixture(scope="module")
def question(lm):
    return tokenize(lm.tokenizer, QUESTION)


@pytest.fixture(scope="module")
def kvc_files(lm, doc):
    cache = capture(lm, token_ids=doc)
    out = {}
    for preset in ("fp16", "near-lossless"):
        plan = make_plan(cache, preset, model=lm)
        out[preset] = encode_kvc_bytes(cache, plan)
    return out


@pytest.mark.parametrize("flash_attn", [True, False], ids=["flash-attn (V rows)", "no flash-attn (V transposed)"])
def test_llamacpp_kv_round_trips_through_a_kvc(doc, question, flash_attn):
    """llama.cpp's own KV -> fp16 `.kvc` -> llama.cpp: greedy tokens identical to llama.cpp's prefill."""
    llm = _llm(flash_attn=flash_attn)
    want = _own_prefill(llm, doc, question)
    cache = capture_llamacpp(llm, doc)
    plan = get_plan("fp16", cache)
    data = encode_kvc_bytes(cache, plan)
    llm.reset()
    llm._ctx.kv_cache_clear()
    n = load_kvc(llm, data)
    assert n == len(doc) and llm.n_tokens == len(doc)
    assert _greedy(llm, question.tolist(), N_GREEDY) == want


def _teacher_forced_agreement(llm, first: list[int], want: list[int]) -> list[bool]:
    """Whether llama.cpp's argmax equals ``want[i]`` at each step when fed ``first`` then ``want[:i]`` (no drift)."""
    import llama_cpp

    agree = []
    llm.eval(first)
    for tok in want:
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        agree.append(int(np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).argmax()) == tok)
        llm.eval([tok])
    return agree


@pytest.mark.parametrize("preset", ["fp16", "near-lossless"])
def test_hf_captured_kvc_feeds_llamacpp(kvc_files, doc, question, preset):
    """The same `.kvc` HF loads: llama.cpp continues it as it continues its own prefill.

    HF runs the GGUF's dequantised fp32 weights, llama.cpp the Q4_1 weights with
    quantised activations, so the two engines' KV differ slightly (see the next
    test): a free greedy run may part at a near-tie (here at step 7 of 12:
    4214 vs 1904) and then drift. So the first token must be llama.cpp's, and
    with llama.cpp's own greedy tokens fed back (teacher forcing) its argmax
    must agree at all but at most one of the 12 steps.
    """
    llm = _llm(flash_attn=True)
    want = _own_prefill(llm, doc, question)
    n = load_kvc(llm, kvc_files[preset])
    assert n == len(doc) and llm.n_tokens == len(doc)
    agree = _teacher_forced_agreement(llm, question.tolist(), want)
    assert agree[0] and sum(agree) >= N_GREEDY - 1, agree


def _parse_seq_state(buf: bytes, n_layer: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V [layers, T, row] from an fp16, non-transposed llama.cpp sequence state."""
    n_stream, t = struct.unpack_from("<II", buf, 0)
    off = 8 + 12 * t
    v_trans, nl = struct.unpack_from("<II", buf, off)
    assert (n_stream, v_trans, nl) == (1, 0, n_layer)
    off += 8
    out = []
    for _ in range(2 * n_layer):
        typ, row = struct.unpack_from("<iQ", buf, off)
        off += 12
        out.append(np.frombuffer(buf, dtype=np.float16, count=t * row // 2, offset=off).reshape(t, row // 2))
        off += t * row
    assert off == len(buf)
    return np.stack(out[:n_layer]).astype(np.float32), np.stack(out[n_layer:]).astype(np.float32)


def test_loaded_kv_is_llamacpps_own_kv(kvc_files, doc, lm):
    """Layout and RoPE pairing, directly: the state llama.cpp saves after the load vs after its own prefill."""
    import llama_cpp

    def state(llm) -> bytes:
        n = llama_cpp.llama_state_seq_get_size(llm.ctx, 0)
        buf = (ctypes.c_uint8 * n)()
        return bytes(buf[: llama_cpp.llama_state_seq_get_data(llm.ctx, buf, n, 0)])

    llm = _llm()
    llm.eval(doc.tolist())
    k_own, v_own = _parse_seq_state(state(llm), lm.fingerprint.num_layers)
    load_kvc(llm, kvc_files["fp16"])
    k_kvc, v_kvc = _parse_seq_state(state(llm), lm.fingerprint.num_layers)
    # Q4_1 weights and quantised activations in llama.cpp vs dequantised fp32 weights in HF: close, not equal.
    # A wrong head order or RoPE pairing gives a relative error near 1.4.
    for own, kvc in ((k_own, k_kvc), (v_own, v_kvc)):
        rel = np.linalg.norm(own - kvc, axis=(1, 2)) / np.linalg.norm(own, axis=(1, 2))
        assert rel.max() < 0.1, rel


def test_shape_vocab_and_missing_gguf_are_refused(lm, doc, tmp_path):
    from dataclasses import replace

    llm = _llm()
    shape = LlamaShape.of(llm)
    assert (shape.n_layer, shape.n_head_kv, shape.head_dim) == (lm.fingerprint.num_layers, lm.fingerprint.num_kv_heads, lm.fingerprint.head_dims[0])
    fp = lm.fingerprint
    check_target(fp, shape, len(doc), doc)
    with pytest.raises(KvcModelMismatchError, match="layers"):
        check_target(fp, replace(shape, n_layer=shape.n_layer - 1), len(doc), doc)
    with pytest.raises(KvcModelMismatchError, match="vocabulary"):
        check_target(fp, shape, len(doc), np.asarray([shape.n_vocab]))
    with pytest.raises(KvcInputError, match="cannot read GGUF"):
        gguf_fingerprint(tmp_path / "absent.gguf")


def test_kvc_of_another_model_is_refused(other_lm, doc):
    cache = capture(other_lm, token_ids=doc)
    plan = get_plan("fp16", cache)
    data = encode_kvc_bytes(cache, plan)
    llm = _llm()
    with pytest.raises(KvcModelMismatchError, match="different model"):
        load_kvc(llm, data)


def test_contexts_that_cannot_hold_it_are_refused(kvc_files):
    with pytest.raises(KvcInputError, match="fp16 KV"):
        load_kvc(_llm(kv=8), kvc_files["fp16"])  # q8_0 KV cache
    with pytest.raises(KvcInputError, match="raise n_ctx"):
        load_kvc(_llm(n_ctx=128), kvc_files["fp16"])


def test_bfloat16_and_float32_files_become_fp16_state_or_one_line():
    """The state of a bfloat16 `.kvc` (what LMCache, vLLM and SGLang store) is the float16 file's: before, a
    TypeError traceback (``Tensor.numpy()`` of bfloat16). A finite value past float16's 65504 (bfloat16, float32)
    is refused in one line: before, it became inf in llama.cpp's cache."""
    import torch

    import kvcodec
    from kvcodec.core.kvcache import KVCache
    from kvcodec.integrations.llamacpp import GGML_TYPE_F16, ROPE_NEOX, state_bytes
    from kvcodec.testing.golden import _synthetic

    def state(dt, big=False):
        c = _synthetic(dt, 8)
        keys = [k.clone() for k in c.keys]
        if big:
            keys[1][0, 2, 3] = 1e6
        fp = c.fingerprint
        shape = LlamaShape(n_layer=fp.num_layers, n_head_kv=fp.num_kv_heads, head_dim=fp.head_dims[0], n_vocab=50000,
                           n_ctx=64, rope_type=ROPE_NEOX, v_trans=False, type_k=GGML_TYPE_F16, type_v=GGML_TYPE_F16)
        with kvcodec.open(kvcodec.encode(KVCache(keys, c.values, c.token_ids, fp, None), None, preset="lossless").data) as r:
            return state_bytes(r, shape)

    half = state(torch.float16)
    assert state(torch.bfloat16) == state(torch.bfloat16) and len(state(torch.bfloat16)) == len(half)
    assert state(torch.float32) == half  # the synthetic values are exact in float16
    for dt in (torch.bfloat16, torch.float32):
        with pytest.raises(KvcInputError, match="beyond float16's 65504"):
            state(dt, big=True)
