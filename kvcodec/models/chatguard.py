"""Render a model's chat template with bounded work: a hostile template is one KvcInputError line.

Why: the template is a program that comes with the model directory (``chat_template.jinja`` or the
tokenizer config), and ``kvc ask`` and onboarding render it. transformers renders it in Jinja's
sandbox, which stops attribute tricks but not work: nested loops over ``range(100000)`` ran for
hours, ``'x' * 2000000000`` was folded into one constant while the template compiled (a MemoryError
traceback, or 2 GB), and a template that raised (``raise_exception``) or did not parse escaped as a
jinja2 traceback. Here:

* the template's own code (Jinja compiles it into Python whose file name is ``<template>``) may run
  :data:`MAX_TEMPLATE_LINES` lines per render, counted by a trace function on this thread;
* before transformers renders it, a dry run in a sandbox that intercepts ``*``, ``+``, ``%`` and ``**``
  (so they are never folded at compile time) and every call refuses any value past
  :data:`MAX_TEMPLATE_CHARS` characters or any call with an integer argument past it (``center``,
  ``ljust``, ``format`` widths); the dry run's other errors are left to transformers' own render,
  whose template environment may offer more than this one;
* the template text and what it renders are at most :data:`MAX_TEMPLATE_CHARS` characters.
"""

from __future__ import annotations

import re
import sys
from typing import Any, Callable

from kvcodec.errors import KvcInputError

MAX_TEMPLATE_CHARS = 1 << 20  # real templates are a few KB, their prompts a few hundred characters here
MAX_TEMPLATE_LINES = 1_000_000  # lines of template code per render (a real one runs a few hundred)


class TemplateBudgetError(KvcInputError):
    """The chat template did more work than rendering a prompt takes (no other rendering of it is tried)."""


class _OverBudget(BaseException):
    """Raised inside the template; a BaseException, so neither Jinja nor transformers' fallbacks swallow it."""


_WIDE = re.compile(r"%[^a-zA-Z%]*\d{5,}|\{[^}]*\d{5,}[^}]*\}")  # a %- or {}-format field 10,000+ wide


def _too_big(x: Any) -> bool:
    if isinstance(x, bool):
        return False
    if isinstance(x, int):
        return abs(x) > MAX_TEMPLATE_CHARS
    return isinstance(x, (str, bytes, list, tuple, dict)) and len(x) > MAX_TEMPLATE_CHARS


def _size(x: Any) -> int:
    return len(x) if isinstance(x, (str, bytes, list, tuple)) else 1


def _precheck(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Refuse a call whose result would be past the budget, before it is computed: an integer argument past it
    (widths of center, ljust, indent, ...), a replace or join whose result would be, a format field that wide."""
    if any(isinstance(a, int) and _too_big(a) for a in (*args, *kwargs.values())):
        raise _OverBudget
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        s, old, new = args[:3]
        if len(s) + (s.count(old) if old else len(s) + 1) * len(new) > MAX_TEMPLATE_CHARS:
            raise _OverBudget
    elif name == "join" and len(args) >= 2:
        sep, seq = (args[0], args[1]) if isinstance(args[0], str) else (args[1] if len(args) > 1 else "", args[0])
        items = list(seq) if isinstance(seq, (list, tuple, str)) else []
        if sum(len(str(x)) for x in items[:MAX_TEMPLATE_CHARS + 1]) + len(str(sep)) * len(items) > MAX_TEMPLATE_CHARS:
            raise _OverBudget
    elif name == "format" and args and isinstance(args[0], str) and _WIDE.search(args[0]):
        raise _OverBudget


def _hardened_env() -> Any:
    """A sandbox like transformers' (same globals, filters and tags) whose operators and calls are size-checked."""
    import json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    import jinja2.nodes
    import jinja2.runtime
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):  # transformers' {% generation %} tag: here its body, rendered
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    class Hardened(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "%", "**"})  # intercepted: never folded while compiling

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "*" and isinstance(left, int) != isinstance(right, int):  # a sequence repeated n times
                seq, n = (right, left) if isinstance(left, int) else (left, right)
                if _size(seq) * abs(n) > MAX_TEMPLATE_CHARS:
                    raise _OverBudget
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise _OverBudget
            if operator == "%" and isinstance(left, str) and _WIDE.search(left):
                raise _OverBudget
            out = super().call_binop(context, operator, left, right)  # "+" of two bounded values: bounded
            if _too_big(out) and not isinstance(out, int):
                raise _OverBudget
            return out

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805 - jinja's names
            owner = getattr(__obj, "__self__", None)
            _precheck(getattr(__obj, "__name__", ""), (owner, *args) if isinstance(owner, str) else args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            if _too_big(out):
                raise _OverBudget
            return out

    def bounded_concat(parts: Any) -> str:  # the render's output, joined: each part is bounded, their count is not
        out, n = [], 0
        for p in parts:
            n += len(p)
            if n > MAX_TEMPLATE_CHARS:
                raise _OverBudget
            out.append(p)
        return "".join(out)

    def raise_exception(message: Any) -> None:
        raise jinja2.exceptions.TemplateError(message)

    passed = (jinja2.nodes.EvalContext, jinja2.runtime.Context, jinja2.Environment)  # what jinja hands some filters

    def guarded(name: str, f: Any) -> Any:
        def g(*args: Any, **kwargs: Any) -> Any:
            _precheck(name, tuple(a for a in args if not isinstance(a, passed)), kwargs)
            out = f(*args, **kwargs)
            if _too_big(out):
                raise _OverBudget
            return out
        for attr in ("jinja_pass_arg",):  # keep the context/eval-context marker jinja passes arguments by
            if hasattr(f, attr):
                setattr(g, attr, getattr(f, attr))
        return g

    env = Hardened(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.concat = bounded_concat  # type: ignore[method-assign]
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, sort_keys=False: json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    env.filters.update({k: guarded(k, f) for k, f in env.filters.items()})
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _line_budget(fn: Callable[[], Any]) -> Any:
    """``fn()`` with at most :data:`MAX_TEMPLATE_LINES` lines of Jinja-compiled template code run on this thread."""
    left = [MAX_TEMPLATE_LINES]

    def local(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            left[0] -= 1
            if left[0] < 0:
                raise _OverBudget
        return local

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        return local if frame.f_code.co_filename == "<template>" else None

    old = sys.gettrace()
    sys.settrace(tracer)
    try:
        return fn()
    finally:
        sys.settrace(old)


def render_chat_template(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)``, bounded (module doc).

    Raises KvcInputError for a template that runs past its budget, does not parse or raises while rendering.
    """
    template = getattr(tokenizer, "chat_template", None)
    # a tokenizer may carry several named templates (a dict); each is checked, whichever transformers picks
    sources = [t for t in (template.values() if isinstance(template, dict) else [template]) if isinstance(t, str)]
    if any(len(t) > MAX_TEMPLATE_CHARS for t in sources):
        raise TemplateBudgetError(f"the model's chat template is more than the {MAX_TEMPLATE_CHARS:,} characters "
                                  "kvcodec renders")
    try:
        kw = dict(getattr(tokenizer, "special_tokens_map", None) or {})
        for source in sources:
            try:
                env = _hardened_env()
                _line_budget(lambda: env.from_string(source).render(  # noqa: B023 - called at once, in this iteration
                    **{**kw, "messages": messages, "tools": None, "documents": None, "add_generation_prompt": True}))
            except Exception:  # noqa: BLE001 - transformers' own render below decides what this one could not
                pass
        text = _line_budget(lambda: tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False))
    except _OverBudget:
        raise TemplateBudgetError("the model's chat template does more work than rendering a prompt takes (loops or "
                                  f"values past {MAX_TEMPLATE_LINES:,} lines or {MAX_TEMPLATE_CHARS:,} characters); "
                                  "refused") from None
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError / TemplateSyntaxError, transformers' ValueError
        msg = " ".join(str(exc).split())[:200]
        raise KvcInputError(f"the model's chat template cannot be rendered: {type(exc).__name__}: {msg}") from None
    if not isinstance(text, str) or len(text) > MAX_TEMPLATE_CHARS:
        raise TemplateBudgetError("the model's chat template renders no text, or more than "
                            f"{MAX_TEMPLATE_CHARS:,} characters")
    return text
