"""Load a `.kvc` into llama.cpp's KV cache (llama-cpp-python), so one file serves HF, vLLM and llama.cpp.

The `.kvc` is decoded layer by layer and written straight into the byte
layout llama.cpp's public sequence-state API reads
(``llama_state_seq_set_data``; ``llama_kv_cache_unified::state_read`` in
llama.cpp), for an fp16 KV cache, one stream, sequence 0::

    u32 n_stream (=1), u32 cell_count (=T)
    T x { i32 pos, u32 n_seq_id (=1), i32 seq_id (=0) }
    u32 v_trans, u32 n_layer
    n_layer x { i32 type (=F16), u64 row_bytes, T rows of K }           K: [T, kv_heads * head_dim]
    V, not transposed (flash attention on): same as K
    V, transposed (flash attention off): n_layer x { i32 type, u32 elem_bytes (=2), u32 n_embd_v, V^T [n_embd_v, T] }

Keys in a `.kvc` are post-RoPE in HF's convention (rotate-half: dimension
``i`` pairs with ``i + d/2``). llama.cpp models whose RoPE type is NORM (the
LLaMA family: ``convert_hf_to_gguf`` permutes the Q/K projection rows so
that llama.cpp can rotate adjacent pairs) keep each head's key dimensions
interleaved instead: llama.cpp's ``2i + j`` is HF's ``j * d/2 + i``. NEOX
models (Qwen2, ...) use HF's order unchanged; other RoPE types are refused.

**Identity.** A `.kvc` carries the fingerprint of the HF model it was
captured on. A GGUF file's identity is the fingerprint of the HF directory
transformers converts it to (:func:`kvcodec.models.load.gguf_model_dir`, done once
and cached), so the check is the same full check as for HF
(:meth:`ModelFingerprint.check_compatible`: architecture, shapes, RoPE,
tokenizer hash, weight hash) and follows any change of the fingerprint. On
top, the llama.cpp model itself must agree with the file on layer count, KV
heads, head size and vocabulary, and the context must be fp16 KV with room
for the tokens; anything else is a :class:`KvcModelMismatchError` or
:class:`KvcInputError` before llama.cpp is touched.

Usage::

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=4096, flash_attn=True)
    n = load_kvc(llm, "doc.kvc")          # llm now continues after the document
    llm.eval(question_ids); ...

**Engines differ.** A `.kvc` captured by HF holds HF's KV for the GGUF's dequantised
weights; llama.cpp computes its own from the quantised weights, so the two are close,
not equal (under 0.1 relative per layer on the embedded model with llama.cpp's plain
CPU kernels). Its extra CPU buffer types (AMX int8 tiles on Xeons that have them)
quantise activations their own way and part further (0.12-0.22, measured 2026-11-28);
where a file must continue exactly as llama.cpp's own prefill would, capture it with
llama.cpp (:func:`capture_llamacpp`).
"""

from __future__ import annotations

import ctypes
import struct
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelMismatchError
from kvcodec.core.fingerprint import ModelFingerprint

GGML_TYPE_F16 = 1
ROPE_NORM, ROPE_NEOX = 0, 2


def _llama_cpp() -> Any:
    try:
        import llama_cpp
    except ImportError:
        raise KvcInputError("llama-cpp-python is not installed (bash .ci/llama.sh, or pip install 'kvcodec[llamacpp]')") from None
    return llama_cpp


@lru_cache(maxsize=8)
def _gguf_fingerprint_cached(path: str, size: int, mtime_ns: int) -> ModelFingerprint:
    from kvcodec.models.load import gguf_model_dir, load_model

    return load_model(str(gguf_model_dir(Path(path)))).fingerprint


def gguf_fingerprint(gguf: str | Path) -> ModelFingerprint:
    """The model fingerprint of a GGUF file: that of the HF model converted from it (converted once, memoized per file)."""
    p = Path(gguf).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise KvcInputError(f"cannot read GGUF {gguf}: {exc.strerror}") from None
    return _gguf_fingerprint_cached(str(p), st.st_size, st.st_mtime_ns)


def live_model(llm: Any) -> Any:
    """``llm``'s llama.cpp model handle, or one KvcInputError line where ``llm`` is no open ``llama_cpp.Llama``.

    Why: after ``Llama.close()`` its model and context handles are None, which ctypes passes to llama.cpp as NULL
    pointers, unchecked by its C API (a crash of the process, not an exception); anything else but a Llama escaped
    as AttributeError."""
    try:
        model, ctx = llm.model, llm.ctx
        llm.input_ids, llm.n_ctx  # noqa: B018 - the attributes load_kvc and capture use
    except (AttributeError, TypeError):
        raise KvcInputError(f"need an open llama_cpp.Llama, got {type(llm).__name__}") from None
    if model is None or ctx is None:
        raise KvcInputError("the llama_cpp.Llama is closed (its model or context was freed)")
    return model


@dataclass(frozen=True)
class LlamaShape:
    """What llama.cpp's loaded model and context say about the KV cache it expects."""

    n_layer: int
    n_head_kv: int
    head_dim: int
    n_vocab: int
    n_ctx: int
    rope_type: int
    v_trans: bool
    type_k: int
    type_v: int

    @classmethod
    def of(cls, llm: Any) -> "LlamaShape":
        lc = _llama_cpp()
        model = live_model(llm)
        n_head = lc.llama_model_n_head(model)
        return cls(
            n_layer=lc.llama_model_n_layer(model), n_head_kv=lc.llama_model_n_head_kv(model),
            head_dim=lc.llama_model_n_embd(model) // n_head, n_vocab=lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model)),
            # llama.cpp may pad n_ctx; llama-cpp-python's token buffer keeps the size asked for
            n_ctx=min(llm.n_ctx(), len(llm.input_ids)), rope_type=lc.llama_model_rope_type(model), v_trans=not bool(llm.context_params.flash_attn),
            type_k=int(llm.context_params.type_k), type_v=int(llm.context_params.type_v),
        )


def check_target(fp: ModelFingerprint, shape: LlamaShape, num_tokens: int, token_ids: np.ndarray | None) -> None:
    """Refuse a `.kvc` the llama.cpp context cannot hold exactly (one line, before anything is written)."""
    if fp.num_layers != shape.n_layer or fp.num_kv_heads != shape.n_head_kv or set(fp.head_dims) != {shape.head_dim}:
        raise KvcModelMismatchError(
            f"the .kvc has {fp.num_layers} layers x {fp.num_kv_heads} KV heads x head_dim {fp.head_dims[0]}, "
            f"the llama.cpp model {shape.n_layer} x {shape.n_head_kv} x {shape.head_dim}"
        )
    if token_ids is not None and token_ids.size and int(token_ids.max()) >= shape.n_vocab:
        raise KvcModelMismatchError(f"the .kvc's token ids reach {int(token_ids.max())}, beyond the model's {shape.n_vocab}-token vocabulary")
    if shape.type_k != GGML_TYPE_F16 or shape.type_v != GGML_TYPE_F16:
        raise KvcInputError(f"the llama.cpp context must have an fp16 KV cache (type_k/type_v {shape.type_k}/{shape.type_v}; F16 is {GGML_TYPE_F16})")
    if shape.rope_type not in (ROPE_NORM, ROPE_NEOX):
        raise KvcInputError(f"llama.cpp RoPE type {shape.rope_type} is not supported (NORM and NEOX are)")
    if num_tokens >= shape.n_ctx:
        raise KvcInputError(f"the .kvc has {num_tokens} tokens; the llama.cpp context holds {shape.n_ctx} (raise n_ctx)")


def to_llama_keys(k: np.ndarray, rope_type: int) -> np.ndarray:
    """HF keys [H, T, D] -> llama.cpp K rows [T, H*D] (adjacent RoPE pairs for NORM models)."""
    h, t, d = k.shape
    if rope_type == ROPE_NORM:
        k = k.reshape(h, t, 2, d // 2).swapaxes(2, 3)  # [.., j, i] -> [.., i, j]: llama dim 2i+j = HF dim j*d/2+i
    return np.ascontiguousarray(k.reshape(h, t, d).transpose(1, 0, 2)).reshape(t, h * d)


def from_llama_keys(rows: np.ndarray, n_head_kv: int, rope_type: int) -> np.ndarray:
    """Inverse of :func:`to_llama_keys`: llama.cpp K rows [T, H*D] -> HF keys [H, T, D]."""
    t = rows.shape[0]
    k = rows.reshape(t, n_head_kv, -1).transpose(1, 0, 2)
    if rope_type == ROPE_NORM:
        h, _, d = k.shape
        k = k.reshape(h, t, d // 2, 2).swapaxes(2, 3).reshape(h, t, d)
    return np.ascontiguousarray(k)


def read_state(buf: bytes | bytearray | memoryview, shape: LlamaShape) -> tuple[list[np.ndarray], list[np.ndarray], np.ndarray]:
    """Parse an fp16 sequence state (``llama_state_seq_get_data``) into HF-layout K/V [H, T, D] per layer and positions.

    The inverse of :func:`state_bytes`; every size is checked against the buffer.
    """
    mv = memoryview(buf).cast("B")

    def take(fmt: str, off: int) -> tuple[tuple, int]:
        n = struct.calcsize(fmt)
        if off + n > len(mv):
            raise KvcInputError("llama.cpp state is truncated")
        return struct.unpack_from(fmt, mv, off), off + n

    (n_stream, t), off = take("<II", 0)
    if n_stream != 1 or t == 0:
        raise KvcInputError(f"expected one stream with cells, got {n_stream} stream(s), {t} cells")
    if off + 12 * t > len(mv):
        raise KvcInputError("llama.cpp state is truncated")
    meta = np.frombuffer(mv, dtype=[("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")], count=t, offset=off)
    if np.any(meta["n"] != 1):
        raise KvcInputError("llama.cpp state cells belong to several sequences")
    off += 12 * t
    (v_trans, n_layer), off = take("<II", off)
    hd = shape.n_head_kv * shape.head_dim
    if n_layer != shape.n_layer or bool(v_trans) != shape.v_trans:
        raise KvcInputError(f"llama.cpp state has {n_layer} layers, v_trans {v_trans}; the model {shape.n_layer}, {int(shape.v_trans)}")

    def block(off: int, header: str, expect: tuple) -> tuple[np.ndarray, int]:
        got, off = take(header, off)
        if got != expect:
            raise KvcInputError(f"llama.cpp state layer header {got} is not the fp16 {expect}")
        if off + t * hd * 2 > len(mv):
            raise KvcInputError("llama.cpp state is truncated")
        return np.frombuffer(mv, dtype=np.float16, count=t * hd, offset=off), off + t * hd * 2

    keys, values = [], []
    for _ in range(n_layer):
        a, off = block(off, "<iQ", (GGML_TYPE_F16, hd * 2))
        keys.append(from_llama_keys(a.reshape(t, hd), shape.n_head_kv, shape.rope_type))
    for _ in range(n_layer):
        if shape.v_trans:
            a, off = block(off, "<iII", (GGML_TYPE_F16, 2, hd))
            rows = a.reshape(hd, t).T
        else:
            a, off = block(off, "<iQ", (GGML_TYPE_F16, hd * 2))
            rows = a.reshape(t, hd)
        values.append(np.ascontiguousarray(rows.reshape(t, shape.n_head_kv, shape.head_dim).transpose(1, 0, 2)))
    if off != len(mv):
        raise KvcInputError(f"llama.cpp state has {len(mv) - off} trailing bytes")
    return keys, values, meta["pos"].astype(np.int64)


def capture_llamacpp(llm: Any, token_ids: np.ndarray, identity: ModelFingerprint | None = None) -> Any:
    """Prefill ``token_ids`` in llama.cpp (fp16 KV) and return its KV cache as a :class:`KVCache` (HF layout, fp16).

    The cache carries the GGUF's fingerprint, so its `.kvc` loads back into
    llama.cpp (and into the HF conversion of the same GGUF).
    """
    import torch

    from kvcodec.core.kvcache import KVCache

    from kvcodec.core.kvcache import as_token_ids

    lc = _llama_cpp()
    shape = LlamaShape.of(llm)
    ids = as_token_ids(token_ids)  # floats were truncated to ids (100.7 -> 100), "abc" escaped as ValueError
    if ids.size == 0 or ids.size >= shape.n_ctx:
        raise KvcInputError(f"need 1..{shape.n_ctx - 1} tokens for this llama.cpp context, got {ids.size}")
    if int(ids.min()) < 0 or int(ids.max()) >= shape.n_vocab:  # before llama.cpp, which failed mid-prefill
        raise KvcInputError(f"token ids must be in [0, {shape.n_vocab}) for this model, got {int(ids.min())}.."
                            f"{int(ids.max())}")
    if shape.type_k != GGML_TYPE_F16 or shape.type_v != GGML_TYPE_F16:
        raise KvcInputError("capture needs an fp16 KV cache")
    lc.llama_memory_clear(lc.llama_get_memory(llm.ctx), True)
    llm.n_tokens = 0
    llm.eval(ids.tolist())
    n = lc.llama_state_seq_get_size(llm.ctx, 0)
    buf = (ctypes.c_uint8 * n)()
    got = lc.llama_state_seq_get_data(llm.ctx, buf, n, 0)
    keys, values, pos = read_state(memoryview(buf)[:got], shape)
    if not np.array_equal(pos, np.arange(ids.size)):
        raise KvcInputError("llama.cpp's sequence does not hold exactly these tokens at positions 0..n-1")
    fp = identity or gguf_fingerprint(llm.model_path)
    return KVCache([torch.from_numpy(k) for k in keys], [torch.from_numpy(v) for v in values], ids, fp, meta={"engine": "llama.cpp"})


def state_bytes(reader: Any, shape: LlamaShape, backend: str | None = None) -> bytearray:
    """The sequence-state bytes of the whole `.kvc` for ``llama_state_seq_set_data`` (see the module doc)."""
    t = int(reader.header.num_tokens)
    hd = shape.n_head_kv * shape.head_dim
    row = hd * 2
    meta = np.zeros(t, dtype=[("pos", "<i4"), ("n", "<u4"), ("seq", "<i4")])
    meta["pos"] = np.arange(t)
    meta["n"] = 1
    layer_bytes = t * row
    k_head = struct.pack("<iQ", GGML_TYPE_F16, row)
    v_head = struct.pack("<iII", GGML_TYPE_F16, 2, hd) if shape.v_trans else k_head
    pre = struct.pack("<II", 1, t) + meta.tobytes() + struct.pack("<II", int(shape.v_trans), shape.n_layer)
    k_off = len(pre)
    v_off = k_off + shape.n_layer * (len(k_head) + layer_bytes)
    buf = bytearray(v_off + shape.n_layer * (len(v_head) + layer_bytes))
    buf[:k_off] = pre
    out = np.frombuffer(buf, dtype=np.uint8)
    for i in range(shape.n_layer):
        k, v = (_fp16(x, i) for x in reader.read_layer(i, backend=backend))
        if k.shape != (shape.n_head_kv, t, shape.head_dim) or v.shape != k.shape:
            raise KvcInputError(f"layer {i} decodes to K {tuple(k.shape)} / V {tuple(v.shape)}, not ({shape.n_head_kv}, {t}, {shape.head_dim})")
        ko = k_off + i * (len(k_head) + layer_bytes)
        buf[ko:ko + len(k_head)] = k_head
        out[ko + len(k_head):ko + len(k_head) + layer_bytes] = to_llama_keys(k, shape.rope_type).view(np.uint8).reshape(-1)
        vo = v_off + i * (len(v_head) + layer_bytes)
        buf[vo:vo + len(v_head)] = v_head
        rows = v.transpose(1, 0, 2).reshape(t, hd)
        out[vo + len(v_head):vo + len(v_head) + layer_bytes] = np.ascontiguousarray(rows.T if shape.v_trans else rows).view(np.uint8).reshape(-1)
    return buf


def _fp16(x: Any, layer: int) -> np.ndarray:
    """A decoded layer tensor as float16 numpy on the host, or one KvcInputError line.

    Why: llama.cpp's KV cache here is fp16. ``Tensor.numpy()`` raised a TypeError for a bfloat16 `.kvc` (what
    LMCache, vLLM and SGLang engines store) and for a layer decoded on the GPU, and numpy's cast silently turned
    a finite value past float16's 65504 (a bfloat16 or float32 file) into inf in llama.cpp's cache."""
    import torch

    t = x.detach().to("cpu")
    if t.dtype != torch.float16:
        t = t.to(torch.float32)
        big = torch.isfinite(t) & (t.abs() > 65504)
        if bool(big.any()):
            raise KvcInputError(f"layer {layer} holds finite values up to {float(t[big].abs().max()):.4g}, beyond float16's "
                                "65504: llama.cpp's fp16 KV cache cannot hold them")
        t = t.to(torch.float16)
    return t.numpy()


def load_kvc(llm: Any, source: Any, backend: str | None = None, identity: ModelFingerprint | None = None) -> int:
    """Put a `.kvc`'s context into ``llm``'s KV cache (sequence 0); returns the number of context tokens.

    ``llm`` is a ``llama_cpp.Llama`` created with an fp16 KV cache (the default
    ``type_k``/``type_v``). ``identity`` is the GGUF's fingerprint if the caller
    already has it (else :func:`gguf_fingerprint` of ``llm.model_path``).
    Afterwards ``llm.eval(ids)`` continues after the document, as after
    ``llm.eval(document_ids)``.
    """
    from kvcodec.format import KvcReader

    lc = _llama_cpp()
    live_model(llm)  # before the file is read: a closed Llama's NULL handles reached llama.cpp
    reader = source if isinstance(source, KvcReader) else KvcReader(source)
    fp = reader.fingerprint
    (identity or gguf_fingerprint(llm.model_path)).check_compatible(fp, what=".kvc file")
    if reader.header.pruned:
        raise KvcInputError("a pruned .kvc (tokens at original positions) cannot be loaded into llama.cpp's one-counter sequence")
    shape = LlamaShape.of(llm)
    ids = reader.token_ids
    if ids is None:
        raise KvcInputError("the .kvc stores no token ids; llama.cpp needs them to continue the sequence")
    if reader.header.ragged:
        raise KvcInputError("the .kvc's sliding-window layers store only their window (ragged layers); "
                            "loading them into llama.cpp is not supported")
    n = int(reader.header.num_tokens)
    ids = np.asarray(ids).reshape(-1)
    if ids.shape != (n,):  # one id was broadcast over every position; another count escaped as numpy's ValueError
        raise KvcFormatError(f"the .kvc stores {ids.size} token ids for {n} tokens of K/V")
    if n and int(ids.min()) < 0:
        raise KvcFormatError(f"the .kvc's token ids include {int(ids.min())}, not a token")
    check_target(fp, shape, n, ids)
    buf = state_bytes(reader, shape, backend)
    ctx = llm.ctx
    lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
    # Why now: the memory is empty from here on; should llama.cpp refuse the state, a reused context's old count
    # made the next eval continue at its old position over an empty cache, silently
    llm.n_tokens = 0
    arr = (ctypes.c_uint8 * len(buf)).from_buffer(buf)
    if lc.llama_state_seq_set_data(ctx, arr, len(buf), 0) != len(buf):
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)  # nothing half-loaded stays behind the zero count
        raise KvcInputError("llama.cpp refused the KV state built from the .kvc (see its log)")
    llm.input_ids[:n] = ids
    llm.n_tokens = n
    return n

