"""Run the ``kvc`` command in-process for tests: (exit code, stdout, stderr)."""

from __future__ import annotations

import pytest

from kvcodec.cli.main import main


def run_kvc(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out = capsys.readouterr()
    return int(exc.value.code or 0), out.out, out.err
