"""CONTRIBUTING.md's "adding a stage" checklist, enforced for every registered stage.

name + version, its declaration in kvcodec/plugins.py (the one plugin registry's built-ins), a config
that round-trips, golden vectors, a spec section. (Conformance of the fast decoders: tests/conformance/test_backend_conformance.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcodec.core.stage import REGISTRY, STAGES, stage_from_json

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "spec" / "vectors"

STAGES.load_all(entry_points=False)  # kvcodec's own stages (an installed plugin's are not held to kvcodec's checklist)
BUILTIN = {name: STAGES.target(name) for name in STAGES.builtin_names()}  # name -> the module providing it
VERSIONS = sorted(k for k in REGISTRY if k[0] in BUILTIN)


def _vector_stages() -> dict[str, list[dict]]:
    """Stage name -> the stage JSON objects the golden vectors use."""
    found: dict[str, list[dict]] = {}
    for meta in list((VECTORS / "codec").glob("*/case.json")) + list((VECTORS / "codec").glob("*/vector.json")):
        st = json.loads(meta.read_text())["stage"]
        found.setdefault(st["name"], []).append(st)
    for folder in ("rans", "rans-v2"):
        man = json.loads((VECTORS / folder / "manifest.json").read_text())
        for v in man["vectors"]:
            found.setdefault("rans", []).append({"name": "rans", "version": man["version"], "config": v["config"]})
    from kvcodec.format import KvcReader

    for v in json.loads((VECTORS / "kvc" / "manifest.json").read_text())["vectors"].values():
        with KvcReader((VECTORS / "kvc" / v["file"]).read_bytes()) as r:
            for p in r.header.pipelines:
                for st in p.to_json():
                    found.setdefault(st["name"], []).append(st)
    return found


VECTOR_STAGES = _vector_stages()
SPEC = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "spec").glob("*.md"))


def test_the_declarations_list_exactly_the_registered_stages():
    """Every stage class kvcodec's codec modules register is declared in kvcodec/plugins.py, by the module defining it."""
    from_codecs = {k: cls for k, cls in REGISTRY.items() if cls.__module__.startswith("kvcodec.")}
    assert {n for n, _ in from_codecs} == set(BUILTIN)
    for (name, _), cls in from_codecs.items():
        assert cls.__module__ == BUILTIN[name], f"{name} is registered by {cls.__module__}, kvcodec/plugins.py says {BUILTIN[name]}"


@pytest.mark.parametrize("key", VERSIONS, ids=lambda k: f"{k[0]}-v{k[1]}")
def test_stage_checklist(key):
    name, version = key
    cls = REGISTRY[key]
    assert re.fullmatch(r"[a-z][a-z0-9_]*", name) and isinstance(version, int) and version >= 1
    # vectors: at least one golden vector uses this stage at this version, and its config round-trips
    uses = [st for st in VECTOR_STAGES.get(name, []) if st.get("version", 1) == version]
    assert uses, f"stage {name} v{version} has no golden vector (kvcodec/testing/golden.py)"
    for st in uses:
        s = stage_from_json(st)
        assert type(s) is cls
        again = cls.from_config(s.get_config())
        assert again.to_json() == s.to_json(), f"{name}: from_config(get_config()) does not round-trip"
    # spec: a section or definition names it
    assert f"`{name}`" in SPEC, f"stage {name} has no spec section (spec/*.md)"
