"""The import structure: layers that point one way, no cycles, the GPU package a plugin, opening a file stays light.

``lint-imports`` (import-linter, contracts in pyproject.toml) checks every module under kvcodec/,
the CLI and the Triton kernels included (TYPE_CHECKING imports count). The AST check below adds
what a contract cannot say: nothing outside ``kvcodec.decode.triton`` imports it statically (the
decoder registry names it by string, like a plugin, so a CPU-only install never imports Triton).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_import_contracts_hold():
    """No import cycles among kvcodec's packages/modules; format/ imports neither quant/ nor the model."""
    lint = Path(sys.executable).with_name("lint-imports")
    r = subprocess.run([str(lint), "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def _imports(path: Path, package: str) -> set[str]:
    """Absolute names of the modules ``path`` (module of ``package``) imports, at any depth of the file."""
    out: set[str] = set()
    parts = package.split(".")
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def test_nothing_outside_the_gpu_package_imports_it_statically():
    bad = []
    for f in sorted((ROOT / "kvcodec").rglob("*.py")):
        mod = "kvcodec." + ".".join(f.relative_to(ROOT / "kvcodec").with_suffix("").parts)
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        if mod.startswith("kvcodec.decode.triton"):
            continue
        for name in _imports(f, pkg.removesuffix(".__init__")):
            if name.startswith("kvcodec.decode.triton"):
                bad.append(f"{mod} imports {name}")
    assert not bad, bad


def _named_imports(path: Path) -> set[str]:
    """Modules ``path`` loads by name: ``importlib.import_module("kvcodec....")``, the decoder registry's
    ``Backend(..., "kvcodec....", ...)`` entries and the plugin declarations' ``"kvcodec....:attr"`` targets (any
    string literal naming a kvcodec module, or a module and an attribute, counts)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("kvcodec."):
            name = node.value.partition(":")[0]
            if (ROOT / Path(*name.split("."))).with_suffix(".py").is_file() or (ROOT / Path(*name.split(".")) / "__init__.py").is_file():
                out.add(name)
    return out


def test_no_import_cycle_counting_imports_by_name():
    """No cycle among kvcodec's modules when a module loaded by name (importlib, a decoder Backend's module, a plugin
    declaration's target) is an arrow too (issue 56: the decoder registry loaded the Triton backends by name and they
    imported it back for the device; core.stage named the codec modules, which import it). Every import at any depth
    counts, as for lint-imports; an import of a module's own enclosing package does not (Python imports the package
    first whatever the module names, and a package re-exporting its modules is the usual shape). kvcodec's own
    plugins are named only by kvcodec/plugins.py, which only the root package imports."""
    graph: dict[str, set[str]] = {}
    files = {}
    for f in sorted((ROOT / "kvcodec").rglob("*.py")):
        mod = "kvcodec." + ".".join(f.relative_to(ROOT / "kvcodec").with_suffix("").parts)
        mod = mod.removesuffix(".__init__")
        files[mod] = f
    for mod, f in files.items():
        pkg = mod if f.name == "__init__.py" else mod.rsplit(".", 1)[0]
        graph[mod] = {n for n in _imports(f, pkg) | _named_imports(f) if n in files and n != mod and not mod.startswith(n + ".")}
    seen: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(m: str) -> None:
        seen[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if seen.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in seen:
                visit(n)
        stack.pop()
        seen[m] = 2

    for m in sorted(graph):
        if m not in seen:
            visit(m)
    assert not cycles, cycles[:5]
    assert {"kvcodec.codecs.rans", "kvcodec.decode.registry", "kvcodec.store.tiers.s3"} <= graph["kvcodec.plugins"]
    assert [m for m, names in graph.items() if "kvcodec.plugins" in names] == ["kvcodec"]  # the root package only


def test_opening_a_lossless_file_does_not_import_the_lossy_codec(tmp_path):
    """Reading a lossless .kvc imports neither the lossy presets, the calibration store, the GPU code nor numba's
    fused decoder's planner (kvcodec.plan.presets) -- the container stands on its own."""
    from kvcodec.format import write_kvc
    from kvcodec.codecs.lossless import lossless_pipeline
    from kvcodec.core.kvcache import KVCache
    from kvcodec.core.fingerprint import ModelFingerprint
    import numpy as np
    import torch

    fp = ModelFingerprint("synthetic", 2, 2, (8, 8), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, "float16", version=1)
    ks = [torch.randn(2, 5, 8).half() for _ in range(2)]
    c = KVCache(ks, [k + 1 for k in ks], np.arange(5), fp)
    path = tmp_path / "x.kvc"
    write_kvc(c, path, lossless_pipeline("float16"))
    code = (
        "import sys\n"
        "from kvcodec.format import KvcReader\n"
        f"r = KvcReader({str(path)!r}); r.read_chunk(0, 'cpu'); r.close()\n"
        "bad = [m for m in ('kvcodec.plan.pipelines', 'kvcodec.calibration.build', 'kvcodec.plan.presets',"
        " 'kvcodec.codecs.transform', 'kvcodec.codecs.quantize', 'kvcodec.decode.triton.dequant_kernels', 'triton', 'kvcodec.models.load', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "KVCODEC_BACKEND": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.parametrize("vector", ["kvc/smollm2_8tok_f16_lossless.kvc", "kvc-lossy/smollm2_24tok_small_hadamard_tokenscale.kvc"])
def test_opening_a_kvc_imports_no_torch(vector):
    """Opening a real .kvc (lossless or lossy), describing it and decoding every chunk to numpy imports
    neither torch nor the calibration store (no scan of the calibration cache); a lossless one also
    none of the lossy codec. Only tensors (read_layer / read_cache) need torch."""
    path = ROOT / "spec" / "vectors" / vector
    lossless = vector.startswith("kvc/")
    code = (
        "import sys\n"
        "from kvcodec.format import KvcReader\n"
        f"r = KvcReader({str(path)!r})\n"
        "r.describe()\n"
        "assert r.verify() == []\n"
        "for j in range(r.num_chunks): r.read_chunk(j, 'cpu')\n"
        "r.close()\n"
        "bad = [m for m in ('torch', 'kvcodec.core.kvcache', 'kvcodec.calibration.build', 'kvcodec.models.load', 'transformers', 'triton')"
        " if m in sys.modules]\n"
        + ("bad += [m for m in ('kvcodec.codecs.transform', 'kvcodec.codecs.quantize', 'kvcodec.codecs.tokenscale', 'kvcodec.plan.presets') if m in sys.modules]\n"
           if lossless else "assert 'kvcodec.codecs.transform' in sys.modules  # the lossy file did decode through its stages\n")
        + "assert not bad, bad\n"
    )
    env = {**os.environ, "KVCODEC_BACKEND": "cpu"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
