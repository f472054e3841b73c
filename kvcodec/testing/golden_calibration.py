"""The calibration-file vectors (spec/vectors/calibration/, spec/codec-v1.md "Calibration file").

Written and checked through ``python kvcodec/testing/golden.py calibration --write`` / ``--check`` (the one
generator's CLI); never overwritten.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.testing.vectors import ROOT, refuse_existing, sha256_hex

CALIB_DIR = ROOT / "spec" / "vectors" / "calibration"
CALIB_FID = "c" * 32  # the fingerprint id the vectors are bound to


def _calibration_case() -> Any:
    """A small calibration with a block-diagonal basis (2 layers, 2 heads, head_dim 32 as two 16-channel blocks),
    snapped to the v3 grid: what a reader of spec/codec-v1.md "Calibration file" must reproduce."""
    from kvcodec.calibration.record import BASIS_GRID, Calibration, snap_basis

    rng = np.random.default_rng(38)
    L, H, D, b = 2, 2, 32, 16
    basis = np.zeros((L, 2, H, D, D))
    for blk in range(D // b):
        q = np.linalg.qr(rng.standard_normal((L, 2, H, b, b)))[0] * rng.uniform(0.05, 3.0, (L, 2, H, 1, b))
        basis[..., blk * b:(blk + 1) * b, blk * b:(blk + 1) * b] = q
    eig = np.sort(rng.random((L, 2, H, D)), axis=-1)[..., ::-1].astype(np.float32)
    mean = rng.standard_normal((L, 2, H, D)).astype(np.float32)
    sens = (1 + rng.random((L, 2))).astype(np.float32)
    return Calibration(snap_basis(basis), mean, np.ascontiguousarray(eig), sens,
                       {"texts": ["synthetic"], "channel_blocks": [[0, 16], [16, 32]], "basis_grid": BASIS_GRID})


def _array_digests(cal: Any) -> dict[str, str]:
    return {"pca.basis": sha256_hex(np.ascontiguousarray(cal.basis).astype("<f2").tobytes()),
            "pca.mean": sha256_hex(np.ascontiguousarray(cal.mean).astype("<f4").tobytes()),
            "pca.eigval": sha256_hex(np.ascontiguousarray(cal.eigval).astype("<f4").tobytes()),
            "sens.kl_per_mse": sha256_hex(np.ascontiguousarray(cal.sensitivity).astype("<f4").tobytes())}


def write_calibration_vectors(out: Path = CALIB_DIR) -> dict[str, Any]:
    """Write the calibration-file vectors (once: refuses if the manifest exists). The file's bytes depend on the
    zstd library's compressor, so the check compares what a reader gets, not the bytes a writer makes."""
    from kvcodec.calibration.store import write_calibration_file

    refuse_existing(out / "manifest.json")
    out.mkdir(parents=True, exist_ok=True)
    cal = _calibration_case()
    path = out / "v3_blocks.safetensors"
    refuse_existing(path)
    write_calibration_file(cal, CALIB_FID, path)
    manifest = {"format": "kvcodec-calibration version 3 (spec/codec-v1.md, Calibration file)",
                "vectors": {"v3_blocks": {"file": path.name, "sha256": sha256_hex(path.read_bytes()), "fingerprint_id": CALIB_FID,
                                          "shape": list(cal.basis.shape), "content_sha256": cal.meta["content_sha256"],
                                          "arrays_sha256": _array_digests(cal),
                                          "attachments_sha256": {k: cal.meta["sha256." + k] for k in cal.attachments}}}}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def check_calibration_vectors(vdir: Path = CALIB_DIR) -> list[str]:
    """Each vector loads (bound to its fingerprint), gives the manifest's arrays bit for bit, and a calibration
    re-written from them loads back to the same arrays."""
    import tempfile

    from kvcodec.calibration.store import load_calibration_file, write_calibration_file

    manifest = json.loads((vdir / "manifest.json").read_text())
    problems = []
    for name, v in manifest["vectors"].items():
        path = vdir / v["file"]
        if sha256_hex(path.read_bytes()) != v["sha256"]:
            problems.append(f"{name}: file sha256 differs from the manifest")
        cal = load_calibration_file(path, v["fingerprint_id"])
        if _array_digests(cal) != v["arrays_sha256"] or cal.meta["content_sha256"] != v["content_sha256"]:
            problems.append(f"{name}: the arrays read differ from the manifest's")
        if {k: cal.meta["sha256." + k] for k in cal.attachments} != v["attachments_sha256"]:
            problems.append(f"{name}: attachment sha256 entries differ")
        with tempfile.TemporaryDirectory() as d:
            again = load_calibration_file(write_calibration_file(cal, v["fingerprint_id"], Path(d) / "again.safetensors"))
            if _array_digests(again) != v["arrays_sha256"]:
                problems.append(f"{name}: re-writing does not give the same arrays back")
    return problems
