"""CONTRIBUTING.md's "adding a stage" checklist, enforced for every registered stage.

name + version, the name -> module table, a config that round-trips, golden vectors, a spec
section. (Conformance of the fast decoders: tests/conformance/test_backend_conformance.py.)
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from kvcodec.core.stage import BUILTIN_STAGES, REGISTRY, load_builtin_stages, stage_from_json

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "spec" / "vectors"

load_builtin_stages()
STAGES = sorted(REGISTRY)


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


def test_the_name_table_lists_exactly_the_registered_stages():
    assert {n for n, _ in REGISTRY} == set(BUILTIN_STAGES)
    for name, module in BUILTIN_STAGES.items():
        assert REGISTRY_MODULES[name] == module, f"{name} is registered by {REGISTRY_MODULES[name]}, table says {module}"


REGISTRY_MODULES = {name: cls.__module__ for (name, _), cls in REGISTRY.items()}


@pytest.mark.parametrize("key", STAGES, ids=lambda k: f"{k[0]}-v{k[1]}")
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
