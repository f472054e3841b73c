"""The ``kvc`` command: parse, call the library, render.

Every command lives in its own module of this package and is attached to the
group below. Errors from the library (:class:`kvcodec.errors.KvcError`) are
printed on one line with the error's exit code; no traceback reaches users.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sys
from typing import Any, Iterator

import click

from kvcodec.errors import KvcError


class _Root(click.Group):
    """The ``kvc`` group. A write to stdout that fails inside a command reaches :func:`main` as one error line:
    click's own ``main`` catches ``EPIPE`` (``kvc info --json x | true``) and exits 1 with nothing said, even
    outside its standalone mode, so it is answered here, before click sees it."""

    def make_context(self, *args: Any, **kwargs: Any) -> click.Context:  # ``kvc --help`` / ``--version`` print here
        with _answer_write_failures():
            return super().make_context(*args, **kwargs)

    def invoke(self, ctx: click.Context) -> Any:  # every command, and its own ``--help``
        with _answer_write_failures():
            return super().invoke(ctx)


@contextlib.contextmanager
def _answer_write_failures() -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        if not _terminal_write_failed(exc):
            raise
        _stdout_failed(exc)


@click.group(cls=_Root, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvcodec", prog_name="kvc")
def cli() -> None:
    """kvcodec: compress, store and deliver LLM KV caches (.kvc files)."""


class _WarningLine(logging.Handler):
    """Library warnings (e.g. an unreadable store entry that was evicted) as one ``kvc: warning:`` line each.

    Writes through click to whatever stderr is current, so it is installed once.
    """

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"kvc: warning: {_one_line(record.getMessage())}", err=True)


def _show_warnings() -> None:
    lib = logging.getLogger("kvcodec")
    if not any(isinstance(h, _WarningLine) for h in lib.handlers):
        h = _WarningLine(logging.WARNING)
        lib.addHandler(h)
        if lib.level == logging.NOTSET:
            lib.setLevel(logging.WARNING)


def _one_line(text: object) -> str:
    """``text`` on one line: a message that quotes a path or a value holding a newline must not become two
    lines of output (the CLI's promise: one ``kvc: error:`` line), nor carry a quoted control or format character
    (ESC, BEL, a bidi override) to the terminal: those are escaped."""
    import unicodedata

    flat = " ".join(str(text).split())
    return "".join(c if unicodedata.category(c) not in ("Cc", "Cf") else ascii(c)[1:-1] for c in flat)


def _terminal_write_failed(exc: OSError) -> bool:
    """Whether ``exc`` came out of writing the command's output (every line goes through ``click.echo``): a
    full disk or a closed pipe on stdout is not a library bug, and gets one line, not a traceback."""
    tb = exc.__traceback__
    while tb is not None:
        f = tb.tb_frame
        if f.f_code.co_name == "echo" and f.f_globals.get("__name__") == "click.utils":
            return True
        tb = tb.tb_next
    return False


def _stdout_failed(exc: OSError) -> None:
    """Report a failed write to stdout on stderr (one line) and exit with KvcIOError's code. stdout is pointed
    at /dev/null first, so the interpreter's final flush of what could not be written adds nothing."""
    from kvcodec.errors import KvcIOError

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):  # stdout already closed, or not a real file (a test's capture)
        pass
    why = "the reader closed the pipe" if exc.errno == errno.EPIPE else (exc.strerror or str(exc))
    try:
        click.echo(f"kvc: error: cannot write the output: {_one_line(why)}", err=True)
    except OSError:  # stderr is gone too: the exit code is all that is left
        pass
    sys.exit(KvcIOError.exit_code)


def main(argv: list[str] | None = None) -> None:
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()  # reuse freed tensor memory across requests (kvcodec/runtime/allocator.py says why)
    _show_warnings()
    try:
        rv = cli.main(args=argv, prog_name="kvc", standalone_mode=False)
    except KvcError as exc:
        click.echo(f"kvc: error: {_one_line(exc.cli_message())}", err=True)
        sys.exit(exc.exit_code)
    except OSError as exc:
        if not _terminal_write_failed(exc):
            raise
        _stdout_failed(exc)
    except click.exceptions.Abort:
        click.echo("kvc: aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # bad arguments are bad input: one line like every other error
        cmd = exc.ctx.command_path if exc.ctx is not None else "kvc"
        msg = _one_line(exc.format_message())
        click.echo(f"kvc: error: {msg} (see '{cmd} --help')", err=True)
        sys.exit(exc.exit_code)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except click.exceptions.Exit as exc:
        sys.exit(exc.exit_code)
    sys.exit(rv if isinstance(rv, int) else 0)


def _attach() -> None:
    from kvcodec.cli import (ask_cmd, calibrate_cmd, capture_cmd, codec_cmd, demo_cmd, edit_cmd, eval_cmd, profile_cmd, prune_cmd,
                             serve_cmd, store_cmd)

    for mod in (capture_cmd, demo_cmd, codec_cmd, eval_cmd, ask_cmd, store_cmd, serve_cmd, prune_cmd, calibrate_cmd, edit_cmd):
        for cmd in mod.COMMANDS:
            cli.add_command(cmd)
    for cmd in profile_cmd.EDIT_COMMANDS:  # `kvc edit profile-heads`: beside the edits, in a module of its own
        edit_cmd.edit_group.add_command(cmd)


_attach()
