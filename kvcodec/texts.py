"""Real text that exists on a fresh machine, for captures, tests and benchmarks.

KV caches have structure random tensors lack, so everything is measured on
real documents that any fresh Debian + CPython + gcc machine has, so that a
clean CI box and a reader of BENCHMARKS.md see the same bytes:

* license texts from /usr/share/common-licenses (package ``base-files``,
  always installed);
* chapters of the Python language reference bundled with CPython
  (``pydoc_data.topics``) and CPython's own standard-library source;
* C headers from /usr/include (``libc6-dev``, pulled in by gcc);
* a Debian changelog (``apt``, an essential package).

Man pages are left out on purpose: Debian's slim images strip
/usr/share/man, so they are not on every fresh machine.

Two named sets split them (issue 15). ``TUNING`` is what presets and every
other codec constant were tuned on (historically gpl3/pydoc/lgpl21); ``HELD_OUT``
is never used to tune anything, only to report, so a claim measured on it is
a claim about text the codec has not seen. Every name in both sets is
accepted by :func:`load_text`, as is any file path.
"""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Callable

from kvcodec.errors import KvcInputError

LICENSES = Path("/usr/share/common-licenses")
NAMED: dict[str, str] = {
    "gpl3": "GPL-3",
    "lgpl21": "LGPL-2.1",
    "gfdl13": "GFDL-1.3",
    "gpl2": "GPL-2",
    "mpl2": "MPL-2.0",
    "apache2": "Apache-2.0",
}
# Three documents of different kinds used by tests and benchmarks by default (all in TUNING).
DEFAULT_BENCH_TEXTS = ("gpl3", "pydoc", "lgpl21")
# Presets and codec constants are tuned on these only (the rate model, kvcodec.onboard.ratefit, is fitted
# on one of each kind: a license, reference prose, Python source, a C header).
TUNING: tuple[str, ...] = ("gpl3", "pydoc", "lgpl21", "py-textwrap", "c-linux-bpf")
# Reported on, never tuned on, and disjoint from the calibration corpus
# (kvcodec.calibration.record.CALIB_TEXTS: the PCA bases and sensitivities are fitted on
# those, so MPL-2.0, GFDL-1.3 and the calibration's pydoc chapters cannot be held out;
# tests/plan/test_peers_guard.py checks the three sets are disjoint): a license, other Python
# reference chapters, Python source, C headers, a changelog.
HELD_OUT: tuple[str, ...] = ("apache2", "pydoc-exec", "py-argparse", "py-heapq", "c-stdio", "c-stdlib", "changelog-apt")
EVAL_SET: tuple[str, ...] = TUNING + HELD_OUT

PYDOC_TUNING_TOPICS = ("datamodel", "types", "compound", "specialnames")
# Chapters in neither PYDOC_TUNING_TOPICS nor the calibration corpus (nor inside one of them:
# "try"/"function" are sections of "compound", "naming" of "execmodel").
PYDOC_HELD_OUT_TOPICS = ("execmodel", "import", "exceptions", "assignment", "comparisons", "calls", "typesmapping")


def pydoc_text(topics: tuple[str, ...] = PYDOC_TUNING_TOPICS) -> str:
    """Concatenated chapters of the Python language reference (ships with CPython)."""
    from pydoc_data.topics import topics as t

    return "\n\n".join(t[k] for k in topics if k in t)


def _stdlib_source(module: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec(module)
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise KvcInputError(f"the standard-library source of {module} is not on this machine")
    return Path(spec.origin).read_text(encoding="utf-8")


def _gz(path: str) -> str:
    p = Path(path)
    if not p.is_file():
        raise KvcInputError(f"no such text file: {p}")
    try:
        return gzip.decompress(p.read_bytes()).decode("utf-8")
    except (OSError, UnicodeDecodeError, EOFError):
        raise KvcInputError(f"{p} is not gzip-compressed UTF-8 text") from None


# Texts that are not one plain file: name -> how to read them.
GENERATED: dict[str, Callable[[], str]] = {
    "pydoc": pydoc_text,
    "pydoc-exec": lambda: pydoc_text(PYDOC_HELD_OUT_TOPICS),
    "py-argparse": lambda: _stdlib_source("argparse"),
    "py-heapq": lambda: _stdlib_source("heapq"),
    "py-textwrap": lambda: _stdlib_source("textwrap"),
    "changelog-apt": lambda: _gz("/usr/share/doc/apt/changelog.gz"),
}
FILES: dict[str, str] = {"c-stdio": "/usr/include/stdio.h", "c-stdlib": "/usr/include/stdlib.h",
                         # the kernel's UAPI header (linux-libc-dev, pulled in by libc6-dev): no glibc license block
                         # shared with the held-out glibc headers
                         "c-linux-bpf": "/usr/include/linux/bpf.h"}


def load_text(name_or_path: str) -> str:
    """Return the text of a named corpus document or of a UTF-8 file."""
    if name_or_path.startswith("pydoc:"):  # chosen chapters of the language reference, e.g. "pydoc:execmodel,import"
        topics = tuple(t for t in name_or_path[6:].split(",") if t)
        from pydoc_data.topics import topics as known

        if not topics or any(t not in known for t in topics):
            raise KvcInputError(f"unknown pydoc chapter in {name_or_path!r}")
        return pydoc_text(topics)
    if name_or_path in GENERATED:
        text = GENERATED[name_or_path]()
        if not text.strip():
            raise KvcInputError(f"text {name_or_path!r} is empty on this machine")
        return text
    if name_or_path in NAMED:
        path = LICENSES / NAMED[name_or_path]
    elif name_or_path in FILES:
        path = Path(FILES[name_or_path])
    else:
        path = Path(name_or_path)
    try:
        is_file = path.is_file()
    except OSError:  # a name too long for a file (text given inline) escaped as OSError ENAMETOOLONG
        is_file = False
    if not is_file:
        shown = str(path) if len(str(path)) <= 200 else str(path)[:200] + "..."
        raise KvcInputError(f"no such text file: {shown}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvcInputError(f"{path} is not UTF-8 text") from None
    except OSError as exc:  # unreadable (permission denied, I/O error) escaped as a raw OSError
        raise KvcInputError(f"cannot read the text file {path}: {exc.strerror or exc}") from None
    if not text.strip():
        raise KvcInputError(f"{path} is empty")
    return text
