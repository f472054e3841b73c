"""Per-model calibration: PCA bases of pre-RoPE K/V and per-layer sensitivities.

Computed once per model from a fixed calibration corpus that is disjoint from
the benchmark texts, stored under ``cache_root()/calibration/<fingerprint id>/``
as a safetensors file (format ``kvcodec-calibration`` version 1, see
spec/codec-v1.md section "Calibration file"). ``.kvc`` files reference the
bases by name + sha256 as external attachments; :func:`resolve_attachment`
finds them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KvcFormatError, KvcInputError
from ..stages import ChunkContext
from .rope import rope_config_from_fingerprint
from .stages import RopeStage

CALIB_FORMAT = "kvcodec-calibration"
CALIB_VERSION = 1
# Calibration corpus: Python reference chapters and licenses NOT used by the benchmarks.
CALIB_PYDOC_TOPICS = ("formatstrings", "string-methods", "typesseq", "debugger")
CALIB_TEXTS = ("pydoc:" + ",".join(CALIB_PYDOC_TOPICS), "gfdl13", "mpl2")
CALIB_CONTEXT = 2048
SENS_CONTINUATION = 128
DEFAULT_SINK = 4


def array_sha256(a: np.ndarray) -> str:
    """sha256 of an array's little-endian C-order bytes (attachment identity)."""
    a = np.ascontiguousarray(a)
    return hashlib.sha256(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes()).hexdigest()


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
        L, _, H, D, K = self.basis.shape
        return {"pca.basis": self.basis.reshape(2 * L, H, D, K), "pca.mean": self.mean.reshape(2 * L, H, D)}

    def truncated(self, k: np.ndarray | int) -> dict[str, np.ndarray]:
        """Attachments with only the first max(k) basis columns (option (c))."""
        kmax = int(np.max(k))
        a = self.attachments
        return {"pca.basis": np.ascontiguousarray(a["pca.basis"][..., :kmax]), "pca.mean": a["pca.mean"]}


def calibration_dir(fingerprint_id: str) -> Path:
    from ..model import cache_root

    return cache_root() / "calibration" / fingerprint_id


def _pre_rope(cache: Any, layer: int, kind: str) -> np.ndarray:
    x = (cache.keys if kind == "k" else cache.values)[layer].float().numpy()
    if kind == "k":
        rc = rope_config_from_fingerprint(cache.fingerprint.rope, x.shape[-1])
        x, _ = RopeStage(**rc).encode(x, ChunkContext(layer=layer, kind="k", positions=cache.positions))
    return x


def query_moments(lm: Any, token_ids: np.ndarray, sink: int = DEFAULT_SINK) -> np.ndarray:
    """E[q^2] of the pre-RoPE queries per (layer, kv head, channel) [L, Hkv, D] (float64), tokens >= sink."""
    import torch

    cfg = lm.model.config.get_text_config()
    nq, nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
    D = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // nq)
    layers = lm.model.model.layers
    out = np.zeros((len(layers), nkv, D))
    hooks = []
    for i, layer in enumerate(layers):
        def hook(mod, inp, o, i=i):
            q = o[0].detach().double().reshape(o.shape[1], nq, D)[sink:]
            m = (q**2).mean(0).reshape(nkv, nq // nkv, D).mean(1)  # HF repeat_kv: kv head h serves q heads h*r..h*r+r-1
            out[i] = m.numpy()
        hooks.append(layer.self_attn.q_proj.register_forward_hook(hook))
    try:
        with torch.inference_mode():
            lm.model(input_ids=torch.as_tensor(np.asarray(token_ids, np.int64))[None], use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    return out


def attention_metrics(lm: Any, token_ids: np.ndarray, sink: int = DEFAULT_SINK, reg: float = 0.01) -> np.ndarray:
    """Distortion metric per (layer, kind, kv head) [L, 2, H, D, D], each normalised to trace D, + reg*I.

    Keys (pre-RoPE): diagonal, channel pair (i, i+D/2) weighted by the mean of the
    queries' E[q_i^2] and E[q_{i+D/2}^2] (RoPE rotates within pairs). Values: W_o^T W_o
    over the output-projection columns of the query heads that share the KV head.
    """
    qm = query_moments(lm, token_ids, sink)
    L, H, D = qm.shape
    cfg = lm.model.config.get_text_config()
    r = int(cfg.num_attention_heads) // H
    out = np.zeros((L, 2, H, D, D))
    h2 = D // 2
    for l in range(L):
        wo = lm.model.model.layers[l].self_attn.o_proj.weight.detach().double().numpy()
        for h in range(H):
            d = qm[l, h]
            d = np.concatenate([(d[:h2] + d[h2:]) / 2] * 2)
            mk = np.diag(d)
            mv = sum(wo[:, (h * r + j) * D : (h * r + j + 1) * D].T @ wo[:, (h * r + j) * D : (h * r + j + 1) * D] for j in range(r))
            for ki, m in enumerate((mk, mv)):
                m = m * (D / np.trace(m))
                out[l, ki, h] = m + reg * np.eye(D)
    return out


def compute_pca(caches: list[Any], sink: int = DEFAULT_SINK, metrics: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(basis fp16 [L,2,H,D,D], mean fp32 [L,2,H,D], eigval fp32 [L,2,H,D]) over the caches' tokens >= sink.

    With ``metrics`` M [L,2,H,D,D] the PCA is done in the weighted space z = M^(1/2) x:
    basis = M^(-1/2) V (not orthonormal), so a uniform error on the coefficients
    is a uniform error in the metric (e.g. attention-output) space.
    """
    c0 = caches[0]
    L, H, D = c0.num_layers, c0.fingerprint.num_kv_heads, c0.fingerprint.head_dims[0]
    basis = np.zeros((L, 2, H, D, D), np.float16)
    mean = np.zeros((L, 2, H, D), np.float32)
    eig = np.zeros((L, 2, H, D), np.float32)
    for l in range(L):
        for ki, kind in enumerate("kv"):
            xs = np.concatenate([_pre_rope(c, l, kind)[:, sink:] for c in caches], axis=1).astype(np.float64)
            m = xs.mean(axis=1)
            for h in range(H):
                z = xs[h] - m[h]
                cov = z.T @ z / z.shape[0]
                if metrics is not None:
                    mw, mv = np.linalg.eigh(metrics[l, ki, h])
                    S = (mv * np.sqrt(mw)) @ mv.T
                    Si = (mv / np.sqrt(mw)) @ mv.T
                    cov = S @ cov @ S
                w, v = np.linalg.eigh(cov)
                order = np.argsort(-w, kind="stable")
                w, v = w[order], v[:, order]
                # deterministic sign: largest-magnitude entry of each column positive
                sgn = np.sign(v[np.argmax(np.abs(v), axis=0), np.arange(D)])
                v = v * np.where(sgn == 0, 1, sgn)
                if metrics is not None:
                    v = Si @ v
                basis[l, ki, h] = v.astype(np.float16)
                eig[l, ki, h] = np.maximum(w, 0)
            mean[l, ki] = m.astype(np.float32)
    return basis, mean, eig


def measure_sensitivity(lm: Any, cache: Any, continuation: np.ndarray, sink: int = DEFAULT_SINK, rel_noise: float = 0.05,
                        seed: int = 0) -> np.ndarray:
    """KL per unit per-element noise power for each (layer, kind) [L, 2] (float32).

    For each (layer, kind), adds Gaussian noise with std ``rel_noise`` x the
    tensor's RMS to tokens >= sink, measures mean KL(exact || noisy) on the
    continuation and divides by the noise power.
    """
    from ..evaluate import compare_logits, continue_logits
    from ..kvcache import KVCache

    exact = continue_logits(lm, cache, continuation)
    rng = np.random.default_rng(seed)
    L = cache.num_layers
    out = np.zeros((L, 2), np.float32)
    for l in range(L):
        for ki, kind in enumerate("kv"):
            src = cache.keys if kind == "k" else cache.values
            x = src[l].float().numpy()
            sigma = rel_noise * float(np.sqrt((x[:, sink:] ** 2).mean()))
            noisy = x.copy()
            noisy[:, sink:] += (rng.standard_normal(noisy[:, sink:].shape) * sigma).astype(np.float32)
            import torch

            keys, values = list(cache.keys), list(cache.values)
            (keys if kind == "k" else values)[l] = torch.from_numpy(noisy).to(cache.dtype)
            pert = KVCache(keys, values, cache.token_ids, cache.fingerprint, cache.positions)
            m = compare_logits(exact, continue_logits(lm, pert, continuation), continuation)
            out[l, ki] = max(m["kl_mean"], 1e-12) / sigma**2
    return out


def build_calibration(lm: Any, texts: tuple[str, ...] = CALIB_TEXTS, context: int = CALIB_CONTEXT,
                      sink: int = DEFAULT_SINK, verbose: bool = True) -> Calibration:
    """Capture the calibration corpus, compute PCA and sensitivities (minutes on a CPU)."""
    from ..capture import capture, tokenize
    from ..texts import load_text, pydoc_text

    t0 = time.time()
    caches, conts = [], []
    for name in texts:
        txt = pydoc_text(tuple(name[6:].split(","))) if name.startswith("pydoc:") else load_text(name)
        ids = tokenize(lm.tokenizer, txt)
        n = min(context, len(ids) - SENS_CONTINUATION)
        if n < 256:
            raise KvcInputError(f"calibration text {name} is too short")
        caches.append(capture(lm, token_ids=ids[:n]))
        conts.append(ids[n : n + SENS_CONTINUATION])
    metrics = attention_metrics(lm, caches[0].token_ids, sink)
    basis, mean, eig = compute_pca(caches, sink, metrics)
    if verbose:
        print(f"calibration: PCA done in {time.time() - t0:.0f}s", flush=True)
    sens = measure_sensitivity(lm, caches[0], conts[0], sink)
    if verbose:
        print(f"calibration: sensitivity done in {time.time() - t0:.0f}s", flush=True)
    meta = {
        "format": CALIB_FORMAT, "version": CALIB_VERSION, "fingerprint_id": lm.fingerprint.id,
        "texts": list(texts), "context": context, "sink": sink, "sens_continuation": SENS_CONTINUATION,
        "sens_rel_noise": 0.05, "tokens": int(sum(c.num_tokens for c in caches)), "weighting": "attention-v1",
    }
    return Calibration(basis, mean, eig, sens, meta)


def save_calibration(cal: Calibration, fingerprint_id: str) -> Path:
    from safetensors.numpy import save_file

    d = calibration_dir(fingerprint_id)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"calib-v{CALIB_VERSION}.safetensors"
    tmp = d / f".calib-v{CALIB_VERSION}.{os.getpid()}.tmp"
    meta = dict(cal.meta, **{"sha256." + k: array_sha256(v) for k, v in cal.attachments.items()})
    save_file({"pca.basis": cal.basis, "pca.mean": cal.mean, "pca.eigval": cal.eigval, "sens.kl_per_mse": cal.sensitivity},
              str(tmp), metadata={"kvcodec": json.dumps(meta, sort_keys=True)})
    os.replace(tmp, path)
    cal.path = path
    return path


def load_calibration_file(path: Path) -> Calibration:
    from safetensors.numpy import load_file
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="np") as f:
            meta = json.loads((f.metadata() or {}).get("kvcodec", "{}"))
        t = load_file(str(path))
    except Exception as exc:  # noqa: BLE001 - safetensors raises its own types
        raise KvcFormatError(f"{path}: unreadable calibration file ({exc})") from None
    if meta.get("format") != CALIB_FORMAT or meta.get("version") != CALIB_VERSION:
        raise KvcFormatError(f"{path}: not a kvcodec calibration v{CALIB_VERSION} file")
    try:
        cal = Calibration(t["pca.basis"], t["pca.mean"], t["pca.eigval"], t["sens.kl_per_mse"], meta, path)
    except KeyError as exc:
        raise KvcFormatError(f"{path}: calibration lacks {exc}") from None
    L, two, H, D, D2 = cal.basis.shape
    if two != 2 or D != D2 or cal.mean.shape != (L, 2, H, D) or cal.sensitivity.shape != (L, 2):
        raise KvcFormatError(f"{path}: calibration arrays have inconsistent shapes")
    return cal


def load_calibration(fingerprint_id: str) -> Calibration | None:
    path = calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors"
    return load_calibration_file(path) if path.is_file() else None


def get_calibration(lm: Any = None, fingerprint_id: str | None = None, build: bool = True) -> Calibration:
    """The model's calibration, building and caching it on first use (needs ``lm``)."""
    fid = fingerprint_id or lm.fingerprint.id
    cal = load_calibration(fid)
    if cal is not None:
        return cal
    if lm is None or not build:
        raise KvcInputError(f"no calibration for model {fid}; run: python -m kvcodec.quant.calibrate")
    cal = build_calibration(lm)
    save_calibration(cal, fid)
    return cal


def resolve_attachment(name: str, sha256: str) -> np.ndarray | None:
    """Find an external attachment by name + sha256 among the stored calibrations.

    Also accepts truncated bases: a ``pca.basis`` whose first K columns hash to
    ``sha256`` for some K is returned truncated. None if nothing matches.
    """
    from ..model import cache_root

    root = cache_root() / "calibration"
    if not root.is_dir():
        return None
    for path in sorted(root.glob(f"*/calib-v{CALIB_VERSION}.safetensors")):
        try:
            cal = load_calibration_file(path)
        except KvcFormatError:
            continue
        arr = cal.attachments.get(name)
        if arr is None:
            continue
        if array_sha256(arr) == sha256:
            return arr
        if name == "pca.basis":
            for k in range(1, arr.shape[-1]):
                t = np.ascontiguousarray(arr[..., :k])
                if array_sha256(t) == sha256:
                    return t
    return None


if __name__ == "__main__":  # python -m kvcodec.quant.calibrate [model]
    import sys

    from ..model import load_model

    lm = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
    cal = build_calibration(lm)
    print(save_calibration(cal, lm.fingerprint.id))
