"""The ``kvc`` command: parse, call the library, render.

Every command lives in its own module of this package and is attached to the
group below. Errors from the library (:class:`kvcodec.errors.KvcError`) are
printed on one line with the error's exit code; no traceback reaches users.
"""

from __future__ import annotations

import logging
import sys

import click

from kvcodec.errors import KvcError


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="kvcodec", prog_name="kvc")
def cli() -> None:
    """kvcodec: compress, store and deliver LLM KV caches (.kvc files)."""


class _WarningLine(logging.Handler):
    """Library warnings (e.g. an unreadable store entry that was evicted) as one ``kvc: warning:`` line each.

    Writes through click to whatever stderr is current, so it is installed once.
    """

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"kvc: warning: {' '.join(record.getMessage().split())}", err=True)


def _show_warnings() -> None:
    lib = logging.getLogger("kvcodec")
    if not any(isinstance(h, _WarningLine) for h in lib.handlers):
        h = _WarningLine(logging.WARNING)
        lib.addHandler(h)
        if lib.level == logging.NOTSET:
            lib.setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> None:
    from kvcodec.runtime.allocator import tune_allocator

    tune_allocator()  # reuse freed tensor memory across requests (kvcodec/runtime/allocator.py says why)
    _show_warnings()
    try:
        rv = cli.main(args=argv, prog_name="kvc", standalone_mode=False)
    except KvcError as exc:
        click.echo(f"kvc: error: {exc}", err=True)
        sys.exit(exc.exit_code)
    except click.exceptions.Abort:
        click.echo("kvc: aborted", err=True)
        sys.exit(130)
    except click.UsageError as exc:  # bad arguments are bad input: one line like every other error
        cmd = exc.ctx.command_path if exc.ctx is not None else "kvc"
        msg = " ".join(exc.format_message().split())
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
