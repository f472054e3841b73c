"""Where the golden vectors live (spec/vectors/), the rule that none is overwritten, and the codec stages' cases.

The codec stages' vectors (spec/vectors/codec/<case>/):

Each case directory holds ``case.json`` ({"stage": {name, version, config},
"ctx": {layer, kind, token_start}, "spec": {shape, dtype}}), ``input.npy``,
``encoded.npy`` (the stage's output), ``side.<name>.npy`` (side data),
``attach.<name>.npy`` (attachments) and ``decoded.npy`` (decode of
encoded + side, the normative result). Written by ``kvcodec/testing/golden.py codec``
(only the cases that do not exist yet); tests only read them.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from kvcodec.core.stage import ArraySpec, ChunkContext, stage_from_json

ROOT = Path(__file__).resolve().parents[2]  # the repository (the vectors live in spec/)
VECTOR_DIR = ROOT / "spec" / "vectors" / "codec"


def refuse_existing(path: Path) -> None:
    if path.exists():
        raise SystemExit(f"{path} exists: golden vectors are never overwritten (add a new vector under a new name)")


def sha256_hex(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def ctx_of(case: dict[str, Any], attach: dict[str, np.ndarray]) -> ChunkContext:
    c = case.get("ctx", {})
    return ChunkContext(layer=c.get("layer", 0), kind=c.get("kind", "k"), token_start=c.get("token_start", 0), attachments=attach)


def run_case(case: dict[str, Any], x: np.ndarray, attach: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    st: Any = stage_from_json(case["stage"])  # an array stage: every codec vector case is one
    ctx = ctx_of(case, attach)
    enc, side = st.encode(x, ctx)
    dec = st.decode(enc, side, ArraySpec(tuple(x.shape), str(x.dtype)), ctx)
    return enc, side, dec


def load_case(d: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    meta = json.loads((d / "case.json").read_text())
    side = {k: np.load(d / f"side.{k}.npy") for k in meta["side"]}
    attach = {k: np.load(d / f"attach.{k}.npy") for k in meta["attach"]}
    return meta, np.load(d / "input.npy"), np.load(d / "encoded.npy"), side, attach, np.load(d / "decoded.npy")
