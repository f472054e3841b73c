"""Workload pieces several benchmark cases share (they used to import each other's scripts).

* :func:`get_cache`: a real cache of the first N tokens of a text, cached on disk
  (``$KVC_BENCH_CACHE``, default /tmp/kvc-cache) -- bench_speed, bench_head_dims,
  bench_dense_threshold (and check_same_bytes.py reads ``speed-gpl3-256.h5`` from it);
* :data:`QUESTION`, :func:`long_ids`: the TTFT document and question -- bench_ttft,
  bench_coldstart, bench_llamacpp;
* :func:`real_channels`, :func:`pca`, :func:`chunks_for`, :func:`synthetic_chunks`: real K/V
  regrouped into heads of any size, coded at a chosen rate -- bench_head_dims,
  bench_dense_threshold.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

CACHE_DIR = Path(os.environ.get("KVC_BENCH_CACHE", "/tmp/kvc-cache"))

QUESTION = "\n\nQuestion: What does this document say about warranties?\nAnswer:"


def get_cache(text: str, tokens: int, model: str = "smollm2"):
    """The real KV cache of the first ``tokens`` tokens of ``text`` (a kvcodec.texts name), captured once.

    ``model``: a shipped model's name or a local HF model directory. A directory's captures are keyed by the
    model's fingerprint, not its path: a path is no file name (it held slashes), and another model at the same
    path must not get this one's cache back."""
    from kvcodec.core.kvcache import load_h5, save_h5
    from kvcodec.models.load import SHIPPED, load_model

    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    lm = None
    if model == "smollm2":
        key = ""
    elif model in SHIPPED:
        key = f"{model}-"
    else:
        lm = load_model(model)
        key = f"{lm.fingerprint.id}-"
    h5 = CACHE_DIR / f"speed-{key}{text}-{tokens}.h5"
    if h5.exists():
        return load_h5(h5)
    from kvcodec.models.capture import capture, tokenize
    from kvcodec.texts import load_text

    lm = lm or load_model(model)
    ids = tokenize(lm.tokenizer, load_text(text))[:tokens]
    c = capture(lm, token_ids=ids)
    save_h5(c, h5)
    return c


def long_ids(tok: Any, n: int) -> np.ndarray:
    """At least n real tokens: license texts and the Python reference, concatenated."""
    from kvcodec.models.capture import tokenize
    from kvcodec.texts import load_text

    parts = []
    for name in ("gpl3", "lgpl21", "pydoc", "gfdl13", "mpl2", "gpl2", "apache2"):
        parts.append(tokenize(tok, load_text(name)))
        ids = np.concatenate(parts)
        if len(ids) >= n:
            return ids[:n]
    raise SystemExit(f"not enough text for {n} tokens")


def real_channels(text: str, tokens: int) -> np.ndarray:
    """[T, C] float32: every layer's K and V channels of the embedded model's real cache, per token."""
    import torch

    c = get_cache(text, tokens).to(torch.float16)
    parts = [t.float().numpy() for t in (*c.keys, *c.values)]  # each [H, T, d]
    return np.concatenate([p.transpose(1, 0, 2).reshape(p.shape[1], -1) for p in parts], axis=1)


def pca(x: np.ndarray, blocks: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """basis [D, D] (columns by descending variance) and mean [D] of rows x [T, D]; with ``blocks``
    block-diagonal over :func:`kvcodec.codecs.blocks.channel_blocks`, as calibration builds it."""
    from kvcodec.calibration.fit import block_pca

    m = x.mean(0)
    return block_pca(np.cov((x - m).T), None, None if blocks else [(0, x.shape[1])])[0], m


def chunks_for(x: np.ndarray, D: int, heads: int) -> list[np.ndarray]:
    """[heads, T, D] float16 chunks of x's channels regrouped into heads of D."""
    T, C = x.shape
    n = C // D
    h = x[:, : n * D].reshape(T, n, D).transpose(1, 0, 2)
    return [np.ascontiguousarray(h[i:i + heads]).astype(np.float16) for i in range(0, n - heads + 1, heads)]


def synthetic_chunks(x: np.ndarray, D: int, heads: int, bits: float, blocks: bool = False, max_chunks: int | None = None):
    """x's channels as heads of D, each head with its own PCA basis (from the data, as calibration would),
    coded through the lossy presets' transform pipeline (rope -> keep(4 sink) -> PCA transform ->
    quantize(step) -> rANS) with the step set so the chunks code at about ``bits`` bits per element.

    Returns (pipeline, encoded [(payload, sides, sizes)], contexts, ArraySpec, chunks, bits per element got).
    """
    from kvcodec.codecs.rans import RansStage
    from kvcodec.codecs.keep import KeepStage
    from kvcodec.codecs.quantize import QuantizeStage
    from kvcodec.codecs.rope import RopeStage
    from kvcodec.codecs.transform import TransformStage
    from kvcodec.core.stage import ArraySpec, ChunkContext, Pipeline

    chunks = chunks_for(x, D, heads)[:max_chunks]
    rows = []
    for ch in chunks:  # one attachment row per chunk: "layer" j, kind k
        bs, ms = zip(*(pca(ch[h].astype(np.float64), blocks) for h in range(heads)))
        rows.append((np.stack(bs).astype(np.float16), np.stack(ms).astype(np.float16)))
    att = {"pca.basis": np.stack([r[0] for r in rows] + [rows[0][0]]), "pca.mean": np.stack([r[1] for r in rows] + [rows[0][1]])}
    ctxs = [ChunkContext(layer=j // 2, kind="k" if j % 2 == 0 else "v", attachments=att) for j in range(len(chunks))]
    step = 0.05
    for _ in range(3):  # set the step so this D codes at about `bits` bits per element
        pipe = Pipeline([RopeStage(theta=10000.0, dim=D), KeepStage(sink=4), TransformStage(k=None),
                         QuantizeStage(mode="step", step=step, max_bits=8), RansStage(channel_group=8)])
        enc = [pipe.encode(c, ctx) for c, ctx in zip(chunks, ctxs)]
        got = sum(len(p) for p, _, _ in enc) * 8 / sum(c.size for c in chunks)
        step *= 2.0 ** (got - bits)
    return pipe, enc, ctxs, ArraySpec(chunks[0].shape, "float16"), chunks, got
