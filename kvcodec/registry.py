"""The ONE plugin registry: codec stages, decoders and store tiers by name, kvcodec's own and any installed package's.

Three groups, one mechanism (zarr-python v3's ``zarr.registry`` is the model: a registry per group,
fed by ``importlib.metadata`` entry points):

* ``kvcodec.stages``: a name is a stage name in a file's header; its target a module that registers
  the stage (``@register``) or a :class:`~kvcodec.core.stage.Stage` subclass;
* ``kvcodec.decoders``: a name is a decoder (backend) name; its target a
  :class:`~kvcodec.decode.registry.Backend`;
* ``kvcodec.tiers``: a name is a store URL scheme; its target a
  :class:`~kvcodec.store.tiers.base.Tier` subclass that declares it.

A target is written as an entry point is, ``"package.module:attr"`` (or ``"package.module"``), and
imported only when its name is looked up or its group is listed in full (the decoder pick lists the
decoders). Targets come from:

* kvcodec itself: :mod:`kvcodec.plugins` declares kvcodec's own in code (it says why not in
  pyproject.toml); :meth:`Registry.register` adds more at run time;
* every installed distribution's entry points in the group (``[project.entry-points."kvcodec.stages"]``
  in its pyproject.toml), read from the installed metadata once per process, the first time a name
  kvcodec does not declare is looked up or a group is listed. A name kvcodec declares never reads
  the metadata: opening a file of built-in stages reads none; its first chunk decode reads it once
  (a few ms: the decoder pick lists the decoders).

Every refusal is a one-line error of the group's :class:`~kvcodec.errors.KvcError` subclass: an
unknown name; a name two installed packages declare; a plugin that fails to import or whose target
is not what the group holds. Each fails only its own name. An entry point reusing a name kvcodec
declares is never loaded (a warning says so, :meth:`Registry.problems` lists it): a file's built-in
stages decode exactly as the spec says whatever else is installed.
"""

from __future__ import annotations

import importlib
import threading
import warnings
from collections.abc import Mapping
from typing import Any, Callable, Generic, NamedTuple, TypeVar

from kvcodec.errors import KvcError

__all__ = ["BUILTIN", "DECODERS_GROUP", "GROUPS", "Provider", "Registry", "STAGES_GROUP", "TIERS_GROUP",
           "declare_builtins", "generation", "refresh"]

STAGES_GROUP = "kvcodec.stages"
DECODERS_GROUP = "kvcodec.decoders"
TIERS_GROUP = "kvcodec.tiers"
GROUPS = (STAGES_GROUP, DECODERS_GROUP, TIERS_GROUP)
BUILTIN = "kvcodec"  # the origin of kvcodec's own declarations

T = TypeVar("T")
# check(name, loaded object, builtin) -> None if the object is what the group holds, else what is wrong with it
Check = Callable[[str, Any, bool], "str | None"]


class Provider(NamedTuple):
    """Who provides a name: a target (``"module:attr"``), or an object registered directly, and its origin."""

    name: str
    target: str
    origin: str  # BUILTIN, "register()", or the distribution whose entry point declares it
    obj: Any = None

    @property
    def builtin(self) -> bool:
        return self.origin == BUILTIN


_lock = threading.RLock()
_declared: dict[str, dict[str, Provider]] = {g: {} for g in GROUPS}  # in code: kvcodec's own, register()
_scanned: dict[str, dict[str, list[Provider]]] | None = None  # entry points, once read
_generation = 0


def generation() -> int:
    """A number that changes whenever any group gains, loses or re-reads a name (for caches of a listing)."""
    return _generation


def _bump() -> None:
    global _generation
    _generation += 1


def declare_builtins(table: Mapping[str, Mapping[str, str]]) -> None:
    """Declare kvcodec's own plugins, ``group -> name -> target`` (called once, by :mod:`kvcodec.plugins`)."""
    with _lock:
        for group, names in table.items():
            have = _declared.setdefault(group, {})
            for name, target in names.items():
                old = have.get(name)
                if old is not None and old.target != target:
                    raise KvcError(f"{group}: {name!r} declared twice ({old.target} and {target})")
                have[name] = Provider(name, target, BUILTIN)
        _bump()


def refresh() -> None:
    """Forget the entry points read so far and what was loaded from them; the next need reads them again.

    For a long-lived process after a package was installed, and for tests that put one on sys.path."""
    global _scanned
    with _lock:
        _scanned = None
        for reg in _instances:
            reg._forget()
        _bump()


def _entry_points() -> dict[str, dict[str, list[Provider]]]:
    """Every installed distribution's entry points in kvcodec's groups, read once (one pass over the metadata)."""
    global _scanned
    with _lock:
        if _scanned is None:
            from importlib.metadata import entry_points  # already imported by numba wherever a chunk is decoded

            found: dict[str, dict[str, list[Provider]]] = {g: {} for g in GROUPS}
            try:
                eps: Any = entry_points()
                for group in GROUPS:
                    for ep in eps.select(group=group):
                        dist = getattr(getattr(ep, "dist", None), "name", None) or "an unnamed distribution"
                        same = found[group].setdefault(ep.name, [])
                        if all(p.target != ep.value for p in same):  # one package seen twice on sys.path: once
                            same.append(Provider(ep.name, ep.value, dist))
            except Exception as exc:  # unreadable metadata must not take kvcodec's own plugins down with it
                warnings.warn(f"kvcodec: could not read installed entry points: {type(exc).__name__}: {exc}",
                              RuntimeWarning, stacklevel=3)
            _scanned = found
        return _scanned


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _load_target(target: str) -> Any:
    """Import ``"package.module:attr.attr"`` (entry-point syntax; a trailing ``[extras]`` is ignored)."""
    module, _, attr = target.split("[", 1)[0].strip().partition(":")
    obj: Any = importlib.import_module(module.strip())
    for part in attr.strip().split(".") if attr.strip() else ():
        obj = getattr(obj, part)
    return obj


_instances: list[Registry[Any]] = []


class Registry(Generic[T]):
    """One group's names: what provides each, loaded on first use and checked by the group's owner.

    ``kind`` names a member in messages ("codec stage"); ``error`` is the group's KvcError subclass;
    ``check(name, obj, builtin)`` returns None when ``obj`` is what the group holds, else what is wrong.
    """

    def __init__(self, group: str, kind: str, error: type[KvcError], check: Check | None = None) -> None:
        if group not in GROUPS:
            raise KvcError(f"unknown plugin group {group!r} (known: {', '.join(GROUPS)})")
        self.group, self.kind, self.error, self._check = group, kind, error, check
        self._loaded: dict[str, T] = {}
        self._failed: dict[str, KvcError] = {}
        self._warned: set[str] = set()  # names whose shadowing entry point was warned about
        self._skipped: set[str] = set()  # plugins load_all warned about
        with _lock:
            _instances.append(self)

    def __repr__(self) -> str:
        return f"Registry({self.group!r})"

    # -- names, without importing anything -------------------------------------------------------
    def _declared(self) -> dict[str, Provider]:
        return _declared.setdefault(self.group, {})

    def _discovered(self) -> dict[str, list[Provider]]:
        """Entry points of this group whose names kvcodec does not declare (the others are warned about)."""
        found = _entry_points()[self.group]
        declared = self._declared()
        for name, provs in found.items():
            if name in declared and name not in self._warned:
                self._warned.add(name)
                warnings.warn(f"kvcodec: {self._shadow_message(name, provs)}", RuntimeWarning, stacklevel=4)
        return {n: p for n, p in found.items() if n not in declared}

    def _shadow_message(self, name: str, provs: list[Provider]) -> str:
        theirs = ", ".join(f"{p.target} from {p.origin}" for p in provs)
        return f"{self.kind} {name!r} of {self._declared()[name].origin} kept; the entry point(s) {theirs} ignored"

    def has(self, name: str) -> bool:
        """Whether any provider declares ``name`` (reads the entry points only for a name kvcodec does not declare)."""
        return name in self._declared() or name in self._discovered()

    def names(self, entry_points: bool = True) -> list[str]:
        """Every name: declared ones in declaration order, then the entry points' sorted (none loaded)."""
        out = list(self._declared())
        return out + sorted(self._discovered()) if entry_points else out

    def builtin_names(self) -> list[str]:
        """The names kvcodec itself declares (:mod:`kvcodec.plugins`)."""
        return [n for n, p in self._declared().items() if p.builtin]

    def provider(self, name: str) -> Provider:
        """Who provides ``name``, without importing it; the group's error for an unknown or doubly declared name."""
        p = self._declared().get(name)
        if p is not None:
            return p
        provs = self._discovered().get(name)
        if not provs:
            known = self.names()
            raise self.error(f"unknown {self.kind} {name!r} (known: {', '.join(known) if known else 'none'})")
        if len(provs) > 1:
            both = " and ".join(f"{p.target} from {p.origin}" for p in sorted(provs, key=lambda p: (p.origin, p.target)))
            raise self.error(f"{self.kind} {name!r} is declared by two installed packages ({both}): uninstall one")
        return provs[0]

    def target(self, name: str) -> str:
        """``"module:attr"`` of ``name`` (imports nothing)."""
        return self.provider(name).target

    # -- loading -----------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object ``name`` stands for, imported and checked on first use (the group's error otherwise)."""
        hit = self._loaded.get(name)
        if hit is not None:
            return hit
        with _lock:
            if name in self._loaded:
                return self._loaded[name]
            if name in self._failed:
                raise self._failed[name]
            p = self.provider(name)
            try:
                obj = p.obj if p.obj is not None else _load_target(p.target)
            except Exception as exc:  # ImportError, a missing attribute, an error raised by the plugin's import
                err = self.error(f"{self.kind} {name!r} ({p.target}, from {p.origin}) failed to load: {_one_line(exc)}")
                self._failed[name] = err
                raise err from exc
            wrong = self._check(name, obj, p.builtin) if self._check is not None else None
            if wrong:
                err = self.error(f"{self.kind} {name!r} ({p.target}, from {p.origin}) {wrong}")
                self._failed[name] = err
                raise err
            self._loaded[name] = obj
            return obj

    def load_all(self, entry_points: bool = True) -> dict[str, T]:
        """Every name's object, in :meth:`names` order. A plugin that fails is skipped with a warning (once);
        one of kvcodec's own that fails raises (a bug in kvcodec, never skipped)."""
        out: dict[str, T] = {}
        for name in self.names(entry_points):
            try:
                out[name] = self.get(name)
            except KvcError as exc:
                if name in self._declared() and self._declared()[name].builtin:
                    raise
                if name not in self._skipped:
                    self._skipped.add(name)
                    warnings.warn(f"kvcodec: skipped: {exc}", RuntimeWarning, stacklevel=2)
        return out

    def problems(self) -> list[str]:
        """What is wrong with this group's plugins, one line each: doubly declared names, entry points that reuse
        a name kvcodec declares, plugins that failed to load (after a lookup or :meth:`load_all`)."""
        found = _entry_points()[self.group]
        out = [self._shadow_message(n, ps) for n, ps in found.items() if n in self._declared()]
        for name in self._discovered():
            try:
                self.provider(name)
            except KvcError as exc:
                out.append(str(exc))
        return out + [str(e) for e in self._failed.values()]

    # -- changing the table at run time ------------------------------------------------------------
    def register(self, name: str, target: str | object) -> None:
        """Add ``name`` from code: a ``"module:attr"`` target (imported on first use) or the object itself.

        A name already declared in code is refused (the group's error); an entry point of the same name is
        then ignored, as for kvcodec's own names."""
        if not isinstance(name, str) or not name or name != name.strip():
            raise self.error(f"a {self.kind} needs a non-empty name without spaces around it, got {name!r}")
        obj = None if isinstance(target, str) else target
        text = target if isinstance(target, str) else f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', type(target).__name__)}"
        with _lock:
            old = self._declared().get(name)
            if old is not None:
                raise self.error(f"{self.kind} {name!r} is already registered ({old.target}, from {old.origin}); "
                                 f"cannot register {text}")
            self._declared()[name] = Provider(name, text, "register()", obj)
            self._failed.pop(name, None)
            _bump()

    def unregister(self, name: str) -> None:
        """Remove a name added with :meth:`register` (kvcodec's own cannot be removed)."""
        with _lock:
            p = self._declared().get(name)
            if p is None or p.builtin:
                raise self.error(f"{self.kind} {name!r} was not added with register()")
            del self._declared()[name]
            self._forget()
            _bump()

    def _forget(self) -> None:
        """Drop what was loaded (or failed) for names kvcodec does not declare: the entry points' and removed ones."""
        declared = self._declared()
        for table in (self._loaded, self._failed):
            for name in [n for n in table if n not in declared]:
                del table[name]
        self._warned.clear()
        self._skipped.clear()
