"""The rANS golden vectors (spec/vectors/rans/, rans-v2/) as the tests read them: one loader for both versions."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.core.stage import Stage, stage_from_json


def manifest(vec_dir: Path) -> dict[str, Any]:
    return json.loads((vec_dir / "manifest.json").read_text())


def load_vector(vec_dir: Path, entry: dict[str, Any], version: int) -> tuple[np.ndarray, bytes, Stage]:
    """(stage input, encoded stream, the stage of the manifest's config), both files checked against the manifest."""
    arr = np.load(vec_dir / entry["input"], allow_pickle=False)
    data = (vec_dir / entry["encoded"]).read_bytes()
    assert list(arr.shape) == entry["shape"] and arr.dtype == np.uint8
    assert hashlib.sha256(arr.tobytes()).hexdigest() == entry["input_sha256"]
    assert hashlib.sha256(data).hexdigest() == entry["encoded_sha256"] and len(data) == entry["encoded_bytes"]
    return arr, data, stage_from_json({"name": "rans", "version": version, "config": entry["config"]})
