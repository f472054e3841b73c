"""The docs cannot rot silently: every relative link, repository path and dotted kvcodec name they cite
exists, and the CLI reference page is what ``kvc --help`` says today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_links_paths_and_names_resolve():
    r = _run("docs/check_links.py")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_cli_reference_matches_the_help():
    r = _run("docs/generate_cli_help.py", "--check")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]


def test_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 150
