"""Check the docs: every relative link resolves, and every module path they name exists.

    python3 docs/check_links.py          # README.md, CONTRIBUTING.md, docs/**/*.md; exit 1 on any problem

Checked:

* Markdown links ``[text](target)`` that are not URLs: the file or folder exists (relative
  to the page), and a ``#fragment`` names a heading of the target page (GitHub's slugs);
* repository paths the text names (``kvcodec/...``, ``tests/...``, ``benchmarks/...``,
  ``scripts/...``, ``spec/...``, ``docs/...``, ``.ci/...``), in prose and in code blocks;
  placeholders (``<package>``, ``*``) are skipped;
* dotted names ``kvcodec.a.b[.Name[.attr]]``: the module exists, and ``Name`` (and
  ``attr``) is defined in it (read from the source; nothing is imported); the plugin
  registry's entry-point groups (``kvcodec.stages``, ...) are names, not modules.

Pure standard library, no kvcodec import: it runs anywhere, in well under a second.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# pages not written yet that the docs may already link to (docs/extending.md: issue 32, against the final tree)
PENDING: set[str] = set()

LINK = re.compile(r"(?<!!)\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)\)")
PATH = re.compile(r"(?<![\w./-])((?:kvcodec|tests|benchmarks|scripts|spec|docs|\.ci)/[\w./<>*{}-]*)")
DOTTED = re.compile(r"(?<![\w./-])(kvcodec(?:\.[A-Za-z_]\w*)+)")


def plugin_groups() -> set[str]:
    """The plugin registry's entry-point group names (``kvcodec.stages``, ...): names, not modules.

    Read from kvcodec/registry.py's ``*_GROUP = "..."`` constants (source only, as everything here)."""
    src = (ROOT / "kvcodec" / "registry.py").read_text(encoding="utf-8")
    return set(re.findall(r'^[A-Z]+_GROUP = "([\w.]+)"', src, re.M))


GROUPS = plugin_groups()


def pages() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
    out += sorted((ROOT / "docs").rglob("*.md"))
    return [p for p in out if p.exists()]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"`", "", heading.strip().lower())
    h = re.sub(r"[^\w\- ]", "", h)
    return h.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    fence = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fence = not fence
        if fence:
            continue
        m = re.match(r"#{1,6}\s+(.*)", line)
        if m:
            s = slug(m.group(1))
            n = seen.get(s, 0)
            seen[s] = n + 1
            out.add(s if n == 0 else f"{s}-{n}")
    return out


def defines(module: Path, name: str) -> bool:
    src = module.read_text(encoding="utf-8")
    pats = [rf"\b(?:def|class)\s+{name}\b", rf"(?m)^\s*{name}\s*(?::|=)", rf"(?m)^\s*(?:from\s+\S+\s+)?import\b[^\n(]*\b{name}\b",
            rf"\b{name}\s+as\s+\w+", rf"\bas\s+{name}\b"]
    if any(re.search(p, src) for p in pats):
        return True
    exported = re.search(r"__all__\s*=\s*\[([^\]]*)\]", src)  # lazily exported names (a module __getattr__)
    if exported and re.search(rf"[\"']{name}[\"']", exported.group(1)):
        return True
    return any(re.search(rf"\b{name}\b", block) for block in re.findall(r"import\s*\(([^)]*)\)", src))


def module_file(parts: list[str]) -> Path | None:
    base = ROOT.joinpath(*parts)
    if (base / "__init__.py").exists():
        return base / "__init__.py"
    if base.with_suffix(".py").exists():
        return base.with_suffix(".py")
    return None


def check_dotted(name: str) -> str | None:
    parts = name.split(".")
    # the longest prefix that is a module or package
    for i in range(len(parts), 0, -1):
        f = module_file(parts[:i])
        if f is not None:
            rest = parts[i:]
            break
    else:
        return f"no module {name}"
    if not rest:
        return None
    if not defines(f, rest[0]):
        return f"{'.'.join(parts[:i])} defines no {rest[0]}"
    if len(rest) > 1 and not re.search(rf"\b(?:def\s+{rest[1]}\b|{rest[1]}\s*[:=])", f.read_text(encoding="utf-8")):
        return f"{'.'.join(parts[:i])}: no attribute {rest[1]} of {rest[0]}"
    return None


def check(page: Path) -> list[str]:
    errors: list[str] = []
    rel = page.relative_to(ROOT)
    text = page.read_text(encoding="utf-8")
    # a page may name paths and modules that do not exist on purpose (the worked examples of extending.md):
    # it lists them in a comment, <!-- examples: kvcodec/codecs/delta.py kvcodec.codecs.delta ... -->
    examples = {w for m in re.findall(r"<!--\s*examples:(.*?)-->", text, re.S) for w in m.split()}
    fence = False
    for no, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fence = not fence
        where = f"{rel}:{no}"
        if not fence:
            for target in LINK.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                    continue
                path, _, frag = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                shown = dest.relative_to(ROOT).as_posix() if dest.is_relative_to(ROOT) else str(dest)
                if not dest.exists():
                    if shown not in PENDING:
                        errors.append(f"{where}: broken link {target}")
                    continue
                if frag and dest.suffix == ".md" and frag not in anchors(dest):
                    errors.append(f"{where}: no heading #{frag} in {shown}")
        for p in PATH.findall(line):
            p = p.rstrip(".,;:)")
            if any(c in p for c in "<>*{}") or p.rstrip("/") in PENDING or p in examples:
                continue
            if not (ROOT / p).exists():
                errors.append(f"{where}: no such path {p}")
        for d in DOTTED.findall(line):
            d = d.rstrip(".")
            if d in examples or d in GROUPS:
                continue
            err = check_dotted(d)
            if err:
                errors.append(f"{where}: {err}")
    return errors


def main() -> int:
    errors = [e for p in pages() for e in check(p)]
    for e in errors:
        print(e)
    print(f"{len(pages())} pages checked, {len(errors)} problems", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
