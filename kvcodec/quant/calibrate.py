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
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

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
CALIB_CONTEXT = 1024
SENS_CONTINUATION = 128
SENS_SAMPLES = 4  # Hutchinson samples of the Fisher trace (one backward pass each)
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


class _QueryMoments:
    """Collects E[q^2] of the pre-RoPE queries per (layer, kv head, channel) during any forward pass.

    Hooked into the q projections while the first calibration text is
    captured, so the attention metric costs no forward pass of its own.
    """

    def __init__(self, lm: Any, sink: int) -> None:
        cfg = lm.model.config.get_text_config()
        self.nq, self.nkv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        self.D = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.nq)
        self.layers = lm.model.model.layers
        self.sink = sink
        self.moments: np.ndarray | None = None
        self._hooks: list[Any] = []

    def __enter__(self) -> "_QueryMoments":
        self.moments = np.zeros((len(self.layers), self.nkv, self.D))
        for i, layer in enumerate(self.layers):
            self._hooks.append(layer.self_attn.q_proj.register_forward_hook(self._hook(i)))
        return self

    def _hook(self, i: int) -> Any:
        def hook(mod: Any, inp: Any, o: Any) -> None:
            q = o[0].detach().double().reshape(o.shape[1], self.nq, self.D)[self.sink:]
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
        wo = lm.model.model.layers[l].self_attn.o_proj.weight.detach().double().numpy()
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


def compute_pca(mom: _Moments, metrics: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(basis fp16 [L,2,H,D,D], mean fp32 [L,2,H,D], eigval fp32 [L,2,H,D]) from accumulated moments.

    With ``metrics`` M [L,2,H,D,D] the PCA is done in the weighted space z = M^(1/2) x:
    basis = M^(-1/2) V (not orthonormal), so a uniform error on the coefficients
    is a uniform error in the metric (e.g. attention-output) space. All
    (layer, kind, head) blocks go through one batched eigh: thousands of tiny
    LAPACK calls cost more in dispatch and BLAS thread hand-offs than in maths.
    """
    L, _, H, D = mom.s1.shape
    mean = mom.s1 / mom.n[:, :, None, None]
    cov = mom.s2 / mom.n[:, :, None, None, None] - mean[..., :, None] * mean[..., None, :]
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
    return v.astype(np.float16), mean.astype(np.float32), np.maximum(w, 0).astype(np.float32)


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
    from transformers import DynamicCache

    lm.fingerprint.check_compatible(cache.fingerprint)
    continuation = np.asarray(continuation, np.int64).reshape(-1)
    dtype = next(lm.model.parameters()).dtype
    L = cache.num_layers
    acc = np.zeros((L, 2))
    gen = torch.Generator().manual_seed(seed)
    # inference_mode(False): callers (e.g. ask -> deposit -> plan) may run under inference_mode.
    with torch.inference_mode(False), torch.enable_grad():
        leaves = [t.to(dtype).unsqueeze(0).clone().requires_grad_(True) for pair in zip(cache.keys, cache.values) for t in pair]
        past = DynamicCache([(leaves[2 * l], leaves[2 * l + 1]) for l in range(L)])
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
    layers = lm.model.model.layers
    hooks = [layer.register_forward_hook(lambda *a: step(1.0 / len(layers))) for layer in layers]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def build_calibration(lm: Any, texts: tuple[str, ...] = CALIB_TEXTS, context: int = CALIB_CONTEXT,
                      sink: int = DEFAULT_SINK, progress: bool = True, timings: dict[str, float] | None = None) -> Calibration:
    """Capture the calibration corpus, compute PCA and sensitivities, with a progress bar (ETA) on stderr.

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
    from ..texts import load_text, pydoc_text

    t0 = time.time()
    ids_all = []
    for name in texts:
        txt = pydoc_text(tuple(name[6:].split(","))) if name.startswith("pydoc:") else load_text(name)
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
            with _layer_progress(lm, lambda frac, n=len(ctx): bar.update(n * frac)):
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
        basis, mean, eig = compute_pca(mom, attention_metrics(lm, qm))
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
    return Calibration(basis, mean, eig, sens, meta)


def save_calibration_file(cal: Calibration, path: Path) -> Path:
    """Write ``cal`` to ``path`` atomically (temp file + rename)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}.tmp"
    meta = dict(cal.meta, **{"sha256." + k: array_sha256(v) for k, v in cal.attachments.items()})
    try:
        save_file({"pca.basis": cal.basis, "pca.mean": cal.mean, "pca.eigval": cal.eigval, "sens.kl_per_mse": cal.sensitivity},
                  str(tmp), metadata={"kvcodec": json.dumps(meta, sort_keys=True)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    cal.path = path
    return path


def save_calibration(cal: Calibration, fingerprint_id: str) -> Path:
    return save_calibration_file(cal, calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors")


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


# Calibrations shipped inside the package (built by scripts/build_calibration.py), by file name:
# sha256 of the file's bytes. A shipped file is found by the model's fingerprint id, so the embedded
# model never calibrates on a user's machine; the pin catches a file edited or truncated in place.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "calibration"
SHIPPED_SHA256: dict[str, str] = {}


def shipped_calibration_path(fingerprint_id: str) -> Path | None:
    """The package's calibration file for this model, or None if it ships none."""
    path = SHIPPED_DIR / f"{fingerprint_id}.safetensors"
    return path if path.name in SHIPPED_SHA256 and path.is_file() else None


def _load_shipped(path: Path) -> Calibration:
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != SHIPPED_SHA256[path.name]:
        raise KvcFormatError(f"{path}: shipped calibration does not match its pinned sha256 (reinstall kvcodec)")
    return load_calibration_file(path)


def load_calibration(fingerprint_id: str) -> Calibration | None:
    """The shipped calibration of this model, else the user's, else None.

    Shipped first: it is pinned and the same on every machine, so a model that
    ships one encodes identically everywhere.
    """
    shipped = shipped_calibration_path(fingerprint_id)
    if shipped is not None:
        return _load_shipped(shipped)
    path = calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors"
    return load_calibration_file(path) if path.is_file() else None


def calibration_files() -> list[Path]:
    """Every calibration file an external attachment may come from: the user's, then the shipped ones."""
    from ..model import cache_root

    root = cache_root() / "calibration"
    user = sorted(root.glob(f"*/calib-v{CALIB_VERSION}.safetensors")) if root.is_dir() else []
    return user + [SHIPPED_DIR / n for n in sorted(SHIPPED_SHA256) if (SHIPPED_DIR / n).is_file()]


def get_calibration(lm: Any = None, fingerprint_id: str | None = None, build: bool = True) -> Calibration:
    """The model's calibration, building and caching it on first use (needs ``lm``)."""
    fid = fingerprint_id or lm.fingerprint.id
    cal = load_calibration(fid)
    if cal is not None:
        return cal
    if lm is None or not build:
        raise KvcInputError(f"no calibration for model {fid}; encode once with the model (it calibrates on first use)")
    cal = build_calibration(lm)
    save_calibration(cal, fid)
    return cal


def resolve_attachment(name: str, sha256: str) -> np.ndarray | None:
    """Find an external attachment by name + sha256 among the stored calibrations.

    Also accepts truncated bases: a ``pca.basis`` whose first K columns hash to
    ``sha256`` for some K is returned truncated. None if nothing matches.
    """
    for path in calibration_files():
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


