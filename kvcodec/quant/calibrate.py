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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import KvcFormatError, KvcInputError, KvcModelMismatchError
from ..stages import ChunkContext
from .rope import rope_config_from_fingerprint
from .stages import RopeStage

CALIB_FORMAT = "kvcodec-calibration"
CALIB_VERSION = 2
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

    def check_for(self, fingerprint: Any) -> None:
        """Refuse (one-line KvcError) a calibration that is not this model's or does not fit its shapes."""
        fid = self.meta.get("fingerprint_id")
        if fid != fingerprint.id:
            where = f" ({self.path})" if self.path else ""
            raise KvcModelMismatchError(f"calibration{where} belongs to model {str(fid)[:40]}, not to this model "
                                        f"{fingerprint.id}; rebuild it: python -m kvcodec.quant.calibrate")
        L, _, H, D, _ = self.basis.shape
        want = (fingerprint.num_layers, fingerprint.num_kv_heads, fingerprint.head_dims[0])
        if (L, H, D) != want or self.sensitivity.shape != (L, 2):
            raise KvcFormatError(f"calibration has {L} layers x {H} KV heads x head_dim {D}, the model "
                                 f"{want[0]} x {want[1]} x {want[2]}; rebuild it: python -m kvcodec.quant.calibrate")

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
            lm.model(input_ids=torch.as_tensor(np.asarray(token_ids, np.int64))[None], use_cache=False)
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


def save_calibration(cal: Calibration, fingerprint_id: str) -> Path:
    """Write the calibration (bound to ``fingerprint_id``, with its content sha256) and index its attachments."""
    from safetensors.numpy import save_file

    d = calibration_dir(fingerprint_id)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"calib-v{CALIB_VERSION}.safetensors"
    tensors = {k: np.ascontiguousarray(v, dtype=_DTYPES[k]) for k, v in _tensors(cal).items()}
    meta = dict(cal.meta, format=CALIB_FORMAT, version=CALIB_VERSION, fingerprint_id=fingerprint_id)
    meta.pop("content_sha256", None)
    meta.update({"sha256." + k: array_sha256(v) for k, v in cal.attachments.items()})
    meta["content_sha256"] = content_sha256(tensors, meta)
    _atomic_write(path, lambda tmp: save_file(tensors, str(tmp), metadata={"kvcodec": json.dumps(meta, sort_keys=True)}))
    idx = calibration_root() / _INDEX
    idx.mkdir(parents=True, exist_ok=True)
    for name in cal.attachments:
        ptr = json.dumps({"fingerprint_id": fingerprint_id, "name": name}, sort_keys=True)
        _atomic_write(idx / f"{meta['sha256.' + name]}.json", lambda tmp, ptr=ptr: tmp.write_text(ptr))
    cal.meta, cal.path = meta, path
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
        return KvcFormatError(f"{path}: {why}; rebuild it: python -m kvcodec.quant.calibrate")

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
    for a in _tensors(cal).values():
        a.setflags(write=False)  # shared through the memo
    return cal


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
                                    f"{fingerprint_id} (swapped file); rebuild it: python -m kvcodec.quant.calibrate")
    return cal


def load_calibration(fingerprint_id: str) -> Calibration | None:
    """The stored calibration of a model (verified and bound to it), None if it has none."""
    path = calibration_dir(fingerprint_id) / f"calib-v{CALIB_VERSION}.safetensors"
    return load_calibration_file(path, fingerprint_id) if os.path.lexists(path) else None


def get_calibration(lm: Any = None, fingerprint_id: str | None = None, build: bool = True) -> Calibration:
    """The model's calibration, building and caching it on first use (needs ``lm``); checked against ``lm``."""
    fid = fingerprint_id or lm.fingerprint.id
    cal = load_calibration(fid)
    if cal is None:
        if lm is None or not build:
            raise KvcInputError(f"no calibration for model {fid}; run: python -m kvcodec.quant.calibrate")
        cal = build_calibration(lm)
        save_calibration(cal, fid)
    if lm is not None:
        cal.check_for(lm.fingerprint)
    return cal


def resolve_attachment(name: str, sha256: str) -> np.ndarray | None:
    """Find an external attachment by name + sha256: one index lookup, one (verified) calibration read.

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
        return None
    if not isinstance(entry, dict) or entry.get("name") != name or not isinstance(entry.get("fingerprint_id"), str) \
            or not _FID.match(entry["fingerprint_id"]):
        return None
    cal = load_calibration(entry["fingerprint_id"])
    arr = cal.attachments.get(name) if cal is not None else None
    return arr if arr is not None and array_sha256(arr) == sha256 else None


if __name__ == "__main__":  # python -m kvcodec.quant.calibrate [model]
    import sys

    from ..model import load_model

    lm = load_model(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
    cal = build_calibration(lm)
    print(save_calibration(cal, lm.fingerprint.id))
