"""Golden vectors of the codec stages (spec/vectors/codec/<case>/).

Each case directory holds ``case.json`` ({"stage": {name, version, config},
"ctx": {layer, kind, token_start}, "spec": {shape, dtype}}), ``input.npy``,
``encoded.npy`` (the stage's output), ``side.<name>.npy`` (side data),
``attach.<name>.npy`` (attachments) and ``decoded.npy`` (decode of
encoded + side, the normative result). Regenerate deliberately with
``python -m kvcodec.quant.vectors --write``; tests only read them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from ..stages import ArraySpec, ChunkContext, stage_from_json
from .stages import hadamard  # noqa: F401  (registers the stages)

VECTOR_DIR = Path(__file__).resolve().parents[2] / "spec" / "vectors" / "codec"


def _cases() -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(20260401)
    x16 = (rng.standard_normal((2, 16, 8)) * 3).astype(np.float16)
    x32 = (rng.standard_normal((2, 20, 8)) * np.array([4, 2, 1, .5, .25, .1, .05, .01])).astype(np.float32)
    q, _ = np.linalg.qr(rng.standard_normal((8, 8)))
    basis = np.stack([np.stack([q * (1 + 0.1 * i) for _ in range(2)]) for i in range(4)]).astype(np.float16)  # [4, 2, 8, 8]
    mean = rng.standard_normal((4, 2, 8)).astype(np.float32)
    return {
        "rope": {"stage": {"name": "rope", "version": 1, "config": {"theta": 10000.0, "dim": 8}}, "ctx": {"layer": 0, "kind": "k", "token_start": 5}, "input": x16},
        "keep": {"stage": {"name": "keep", "version": 1, "config": {"sink": 2, "recent": 3, "dtype": "float16"}}, "ctx": {}, "input": x32},
        "transform_hadamard": {"stage": {"name": "transform", "version": 1, "config": {"basis": "hadamard", "k": 4}}, "ctx": {}, "input": x32},
        "transform_pca": {"stage": {"name": "transform", "version": 1, "config": {"basis": "pca", "k": 6, "attachment": "pca"}},
                          "ctx": {"layer": 1, "kind": "v"}, "input": x32, "attach": {"pca.basis": basis, "pca.mean": mean}},
        "quantize_step": {"stage": {"name": "quantize", "version": 1, "config": {"mode": "step", "step": 0.1, "max_bits": 8}}, "ctx": {}, "input": x32},
        "quantize_step_clip": {"stage": {"name": "quantize", "version": 1, "config": {"mode": "step", "step": 0.01, "max_bits": 4}}, "ctx": {}, "input": x32},
        "quantize_minmax_channel": {"stage": {"name": "quantize", "version": 1, "config": {"mode": "minmax", "bits": 2, "axis": "channel", "group": 6, "symmetric": False}}, "ctx": {}, "input": x32},
        "quantize_minmax_token_sym": {"stage": {"name": "quantize", "version": 1, "config": {"mode": "minmax", "bits": [4, 3], "axis": "token", "group": 3, "symmetric": True}}, "ctx": {}, "input": x32},
    }


def ctx_of(case: dict[str, Any], attach: dict[str, np.ndarray]) -> ChunkContext:
    c = case.get("ctx", {})
    return ChunkContext(layer=c.get("layer", 0), kind=c.get("kind", "k"), token_start=c.get("token_start", 0), attachments=attach)


def run_case(case: dict[str, Any], x: np.ndarray, attach: dict[str, np.ndarray]) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    st = stage_from_json(case["stage"])
    ctx = ctx_of(case, attach)
    enc, side = st.encode(x, ctx)
    dec = st.decode(enc, side, ArraySpec(tuple(x.shape), str(x.dtype)), ctx)
    return enc, side, dec


def write_vectors(root: Path = VECTOR_DIR) -> None:
    for name, case in _cases().items():
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        for f in d.glob("*.npy"):
            f.unlink()
        x = case["input"]
        attach = {k: v for k, v in case.get("attach", {}).items()}
        enc, side, dec = run_case(case, x, attach)
        meta = {"stage": case["stage"], "ctx": case.get("ctx", {}), "spec": {"shape": list(x.shape), "dtype": str(x.dtype)},
                "side": sorted(side), "attach": sorted(attach)}
        (d / "case.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
        np.save(d / "input.npy", x)
        np.save(d / "encoded.npy", enc)
        np.save(d / "decoded.npy", dec)
        for k, v in side.items():
            np.save(d / f"side.{k}.npy", v)
        for k, v in attach.items():
            np.save(d / f"attach.{k}.npy", v)
        print(f"wrote {d}")


def load_case(d: Path) -> tuple[dict[str, Any], np.ndarray, np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray], np.ndarray]:
    meta = json.loads((d / "case.json").read_text())
    side = {k: np.load(d / f"side.{k}.npy") for k in meta["side"]}
    attach = {k: np.load(d / f"attach.{k}.npy") for k in meta["attach"]}
    return meta, np.load(d / "input.npy"), np.load(d / "encoded.npy"), side, attach, np.load(d / "decoded.npy")


if __name__ == "__main__":
    if "--write" not in sys.argv:
        print("usage: python -m kvcodec.quant.vectors --write")
        sys.exit(2)
    write_vectors()
