"""Commands that refuse or fail exit non-zero with one ``kvc: error:`` line (issue 55: these exited 0)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
import torch

from cliutil import run_kvc
from kvcodec.core.kvcache import save_capture
from kvcodec.testing.golden import _synthetic


def _one_line(code: int, err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("kvc: error:") and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.fixture()
def cap(tmp_path):
    p = tmp_path / "cap.h5"
    save_capture(_synthetic(torch.float16, 8), p)
    return p


@pytest.mark.model
def test_encode_a_sink_longer_than_the_context(small_cache, tmp_path, capsys):
    """A real capture (the issue's case: balanced with the model wrote the whole context as its "sink" and
    exited 0)."""
    cap = tmp_path / "real.h5"
    save_capture(small_cache, cap)
    out = tmp_path / "o.kvc"
    code, _, err = run_kvc(["encode", str(cap), "-o", str(out), "--config", '{"preset": "balanced", "sink": 100000}'],
                           capsys)
    assert code == 2 and "sink (100000)" in _one_line(code, err) and not out.exists()


def test_encode_more_chunk_heads_than_the_cache_has(cap, tmp_path, capsys):
    out = tmp_path / "o.kvc"
    code, _, err = run_kvc(["encode", str(cap), "-o", str(out), "--chunk-heads", "99"], capsys)
    assert code == 2 and "chunk_heads" in _one_line(code, err) and not out.exists()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_store_stats_on_an_unreachable_http_store(capsys):
    """A plain http source cannot list, so it cannot be counted ("?"), but one that does not answer at all is
    an error (as a kvc+http one already was)."""
    url = f"http://127.0.0.1:{_closed_port()}/?connect_timeout=2"
    code, _, err = run_kvc(["store", "stats", "--store", url], capsys)
    assert code == 8 and "unreachable" in _one_line(code, err)


def test_a_newline_in_a_path_stays_one_error_line(tmp_path, capsys):
    """A message quoting a name that holds a newline is still one line (it printed as two)."""
    code, _, err = run_kvc(["info", str(tmp_path / "a\nb.kvc")], capsys)
    assert code == 2 and "a b.kvc" in _one_line(code, err)
    code, _, err = run_kvc(["info", str(tmp_path / "a\x1b[2J\x07b.kvc")], capsys)  # no ESC / BEL to the terminal
    assert code == 2 and "a\\x1b[2J\\x07b.kvc" in _one_line(code, err)


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_stdout_is_one_error_line(tmp_path):
    """Output that cannot be written (stdout on a full disk) is one ``kvc: error:`` line and KvcIOError's exit
    code, not a traceback (`kvc info x.kvc > /dev/full` and `kvc --help > /dev/full` printed one)."""
    from kvcodec.errors import KvcIOError
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan

    c = _synthetic(torch.float16, 8)
    write_kvc(c, tmp_path / "s.kvc", get_plan("lossless", c).pipelines)
    for args in (["--help"], ["info", str(tmp_path / "s.kvc")]):
        with open("/dev/full", "w") as full:
            p = subprocess.run([sys.executable, "-m", "kvcodec", *args], stdout=full, stderr=subprocess.PIPE, text=True,
                               timeout=120)
        assert p.returncode == KvcIOError.exit_code, p.stderr
        assert _one_line(p.returncode, p.stderr) == "kvc: error: cannot write the output: No space left on device"


def test_a_closed_pipe_on_stdout_is_one_error_line(tmp_path):
    """``kvc info --json x | true``: the reader has gone before the first line is written. click's own main
    caught the EPIPE and exited 1 with nothing said; now it is the one line and exit code a full disk gets.
    The pipe's read end is closed before the command can write (its imports alone take far longer)."""
    from kvcodec.errors import KvcIOError
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan

    c = _synthetic(torch.float16, 8)
    write_kvc(c, tmp_path / "s.kvc", get_plan("lossless", c).pipelines)
    for args in (["info", "--json", str(tmp_path / "s.kvc")], ["--help"], ["info", "--help"]):
        p = subprocess.Popen([sys.executable, "-m", "kvcodec", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()
        err = p.stderr.read()
        assert p.wait(timeout=120) == KvcIOError.exit_code, (args, err)
        assert _one_line(p.returncode, err) == "kvc: error: cannot write the output: the reader closed the pipe"
