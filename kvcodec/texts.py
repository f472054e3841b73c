"""Real text that exists on a fresh machine, for captures, tests and benchmarks.

KV caches have structure random tensors lack, so everything is measured on
real documents: the license texts Debian ships in /usr/share/common-licenses
and the Python language reference topics bundled with CPython
(``pydoc_data.topics``). A name below or any file path is accepted.
"""

from __future__ import annotations

from pathlib import Path

from .errors import KvcInputError

LICENSES = Path("/usr/share/common-licenses")
NAMED: dict[str, str] = {
    "gpl3": "GPL-3",
    "lgpl21": "LGPL-2.1",
    "gfdl13": "GFDL-1.3",
    "gpl2": "GPL-2",
    "mpl2": "MPL-2.0",
    "apache2": "Apache-2.0",
}
# Three documents of different kinds used by tests and benchmarks by default.
DEFAULT_BENCH_TEXTS = ("gpl3", "pydoc", "lgpl21")


def pydoc_text(topics: tuple[str, ...] = ("datamodel", "types", "compound", "specialnames")) -> str:
    """Concatenated chapters of the Python language reference (ships with CPython)."""
    from pydoc_data.topics import topics as t

    return "\n\n".join(t[k] for k in topics if k in t)


def load_text(name_or_path: str) -> str:
    """Return the text of a named corpus document or of a UTF-8 file."""
    if name_or_path == "pydoc":
        return pydoc_text()
    if name_or_path in NAMED:
        path = LICENSES / NAMED[name_or_path]
    else:
        path = Path(name_or_path)
    if not path.is_file():
        raise KvcInputError(f"no such text file: {path}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvcInputError(f"{path} is not UTF-8 text") from None
    if not text.strip():
        raise KvcInputError(f"{path} is empty")
    return text
