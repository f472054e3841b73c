"""Install a package into a temporary site directory the way pip would, for the plugin tests: no pip, no network.

:func:`install` writes ``<name>-<version>.dist-info/{METADATA,entry_points.txt}`` (and copies a package
next to it, if given) into a folder, puts the folder on ``sys.path`` and makes kvcodec's plugin
registry read the entry points again. :func:`uninstall` undoes all of it: the folder leaves
``sys.path``, the package leaves ``sys.modules``, the registry forgets it, and the stage versions it
registered leave ``kvcodec.core.stage.REGISTRY``.
"""

from __future__ import annotations

import importlib
import shutil
import sys
try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]
from pathlib import Path

PLUGIN_PKG = Path(__file__).resolve().parent / "plugin_pkg"  # tests/_support/plugin_pkg: kvc-demo-plugin's project


def entry_points_txt(groups: dict[str, dict[str, str]]) -> str:
    return "".join(f"[{g}]\n" + "".join(f"{n} = {t}\n" for n, t in names.items()) + "\n" for g, names in groups.items())


def project_entry_points(project: Path = PLUGIN_PKG) -> dict[str, dict[str, str]]:
    """``[project.entry-points]`` of a project's pyproject.toml."""
    return tomllib.loads((project / "pyproject.toml").read_text(encoding="utf-8"))["project"]["entry-points"]


def install(site: Path, dist: str, groups: dict[str, dict[str, str]], package: Path | None = None,
            version: str = "0.1.0") -> Path:
    """A distribution ``dist`` with entry points ``groups`` (and the package folder ``package``) in ``site``."""
    from kvcodec import registry

    info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n", encoding="utf-8")
    (info / "entry_points.txt").write_text(entry_points_txt(groups), encoding="utf-8")
    if package is not None:
        shutil.copytree(package, site / package.name, ignore=shutil.ignore_patterns("__pycache__"))
    if str(site) not in sys.path:
        sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    registry.refresh()
    return info


def uninstall(site: Path, modules: tuple[str, ...] = ()) -> None:
    """Take ``site`` off sys.path and forget everything loaded from it (``modules``: top-level package names)."""
    from kvcodec import registry
    from kvcodec.core.stage import REGISTRY

    while str(site) in sys.path:
        sys.path.remove(str(site))
    for name in [m for m in sys.modules if m.split(".")[0] in modules]:
        del sys.modules[name]
    for key in [k for k, cls in REGISTRY.items() if cls.__module__.split(".")[0] in modules]:
        del REGISTRY[key]
    importlib.invalidate_caches()
    registry.refresh()
