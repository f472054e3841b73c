"""Output safety (issue 14, item 6): never clobber an input, never replace a non-regular file,
atomic writes, stale temp collection, and one-line errors for disk full / read-only filesystems.

These tests need no model: the caches are small synthetic ones because what is checked is
where bytes go, not what they mean.
"""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from kvcodec import atomic
from kvcodec.errors import KvcInputError, KvcIOError
from kvcodec.format import KvcReader, write_kvc
from kvcodec.plan.presets import get_plan
from kvcodec.core.kvcache import save_capture

from cliutil import run_kvc  # noqa: E402
from formatutil import synthetic_cache  # noqa: E402


def one_line_error(code: int, err: str) -> str:
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvc: error:") and "Traceback" not in err, err
    return lines[0]


def _kvc(path: Path, T: int = 16) -> bytes:
    c = synthetic_cache(torch.float32, T=T)
    write_kvc(c, path, get_plan("lossless", c).pipelines, preset="lossless")
    return path.read_bytes()


def _temps(d: Path) -> list[Path]:
    return sorted(p for p in d.iterdir() if p.name.endswith(atomic.TEMP_SUFFIX))


# -- same file / non-regular outputs -----------------------------------------------------------
def test_decode_onto_its_own_input_is_refused(tmp_path, capsys):
    src = tmp_path / "a.kvc"
    before = _kvc(src)
    os.link(src, tmp_path / "hard.kvc")
    (tmp_path / "sym.kvc").symlink_to(src)
    (tmp_path / "sub").mkdir()
    for out in (src, tmp_path / "hard.kvc", tmp_path / "sym.kvc", tmp_path / "sub" / ".." / "a.kvc"):
        code, _, err = run_kvc(["decode", str(src), "-o", str(out)], capsys)
        line = one_line_error(code, err)
        assert code == KvcInputError.exit_code and "same file as the input" in line, line
    # the link given as the input, the real file as the output
    code, _, err = run_kvc(["decode", str(tmp_path / "sym.kvc"), "-o", str(src)], capsys)
    assert "same file as the input" in one_line_error(code, err)
    assert src.read_bytes() == before
    with KvcReader(src) as r:
        assert r.verify() == []
    assert _temps(tmp_path) == []


def test_encode_and_prune_onto_their_input_are_refused(tmp_path, capsys):
    cap = tmp_path / "c.h5"
    save_capture(synthetic_cache(torch.float32, T=16), cap)
    before = cap.read_bytes()
    os.link(cap, tmp_path / "hard.h5")
    code, _, err = run_kvc(["encode", str(cap), "-o", str(tmp_path / "hard.h5")], capsys)
    assert "same file as the input" in one_line_error(code, err)
    code, _, err = run_kvc(["prune", str(cap), "--prune", "h2o:0.5", "-o", str(cap)], capsys)
    assert "same file as the input" in one_line_error(code, err)
    assert cap.read_bytes() == before
    # a different output still works, and is what it claims to be
    code, _, err = run_kvc(["encode", str(cap), "-o", str(tmp_path / "ok.kvc")], capsys)
    assert code == 0, err
    with KvcReader(tmp_path / "ok.kvc") as r:
        assert r.verify() == []


@pytest.mark.parametrize("kind", ["fifo", "chardev", "directory", "symlink-to-device"])
def test_non_regular_output_is_refused(kind, tmp_path, capsys):
    src = tmp_path / "a.kvc"
    _kvc(src)
    out = tmp_path / "out"
    if kind == "fifo":
        os.mkfifo(out)
    elif kind == "directory":
        out.mkdir()
    elif kind == "chardev":
        out = Path("/dev/null")
    else:
        out.symlink_to("/dev/null")
    code, _, err = run_kvc(["decode", str(src), "-o", str(out)], capsys)
    line = one_line_error(code, err)
    assert code == KvcInputError.exit_code and ("refusing to replace it" in line or "is a directory" in line), line
    if kind == "fifo":
        assert Path(out).is_fifo()
    if kind == "symlink-to-device":
        assert out.is_symlink() and os.readlink(out) == "/dev/null"
    assert _temps(tmp_path) == []


def test_missing_output_directory_is_one_line(tmp_path, capsys):
    src = tmp_path / "a.kvc"
    _kvc(src)
    cap = tmp_path / "c.h5"
    save_capture(synthetic_cache(torch.float32, T=8), cap)
    for args in (["decode", str(src), "-o", str(tmp_path / "no" / "x.h5")],
                 ["encode", str(cap), "-o", str(tmp_path / "no" / "x.kvc")],
                 ["prune", str(cap), "--prune", "h2o:0.5", "-o", str(tmp_path / "no" / "x.h5")],
                 ["decode", str(src), "-o", str(src / "x.h5")]):  # a file used as a directory
        code, _, err = run_kvc(args, capsys)
        assert "output directory" in one_line_error(code, err)


def test_library_writers_refuse_non_regular_outputs(tmp_path):
    c = synthetic_cache(torch.float32, T=8)
    writers = {".h5": lambda p: save_capture(c, p), ".safetensors": lambda p: save_capture(c, p),
               ".kvc": lambda p: write_kvc(c, p, get_plan("lossless", c).pipelines)}
    for suffix, w in writers.items():
        dev = tmp_path / f"dev{suffix}"
        dev.symlink_to("/dev/null")
        fifo = tmp_path / f"fifo{suffix}"
        os.mkfifo(fifo)
        with pytest.raises(KvcInputError, match="character device; refusing to replace"):
            w(dev)
        with pytest.raises(KvcInputError, match="FIFO; refusing to replace"):
            w(fifo)
        assert dev.is_symlink() and fifo.is_fifo()
    assert _temps(tmp_path) == []


def test_curve_outputs_must_differ_and_plot_needs_an_image_name(tmp_path, capsys):
    from kvcodec.eval.curve import run_curve

    with pytest.raises(KvcInputError, match="same file"):
        run_curve("smollm2", ["gpl3"], json_out=tmp_path / "x", csv_out=tmp_path / "x")
    with pytest.raises(KvcInputError, match="png"):
        run_curve("smollm2", ["gpl3"], plot_out=tmp_path / "x.txt")
    with pytest.raises(KvcInputError, match="refusing to replace"):
        run_curve("smollm2", ["gpl3"], json_out="/dev/null")


def test_curve_ignores_a_previous_output_it_cannot_read(tmp_path):
    """`kvc curve --json X` resumes from X; an X that is not UTF-8 or nested 100,000 deep escaped as a traceback
    (UnicodeDecodeError, RecursionError) after the model had loaded."""
    from kvcodec.eval.curve import load_previous

    for data in (b"\xff\xfe{", b"[" * 100_000 + b"]" * 100_000, b"{"):
        (tmp_path / "prev.json").write_bytes(data)
        assert load_previous(tmp_path / "prev.json") == {}


def test_demo_out_dir_that_is_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    code, _, err = run_kvc(["demo", "--out-dir", str(f), "--no-curve"], capsys)
    assert "is a file" in one_line_error(code, err)
    code, _, err = run_kvc(["demo", "--out-dir", str(f / "sub"), "--no-curve"], capsys)
    assert "not a directory" in one_line_error(code, err)


# -- atomicity and stale temps ---------------------------------------------------------------
_WRITER = textwrap.dedent("""
    import sys, time
    from kvcodec.atomic import atomic_file
    with atomic_file(sys.argv[1], "wb") as f:
        f.write(b"NEW" * 100000)
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
""")


def _killed_writer(out: Path) -> Path:
    """Start a writer of ``out``, SIGKILL it mid-write; returns the temp it left behind."""
    p = subprocess.Popen([sys.executable, "-c", _WRITER, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "writing"
        tmps = _temps(out.parent)
        assert len(tmps) == 1 and tmps[0].stat().st_size == 300000
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert p.returncode == -signal.SIGKILL
    return tmps[0]


def test_kill_9_mid_write_keeps_the_old_output_and_the_temp_is_collected_later(tmp_path):
    out = tmp_path / "out.kvc"
    old = _kvc(out)
    tmp = _killed_writer(out)
    assert out.read_bytes() == old  # the old output is intact
    assert tmp.exists()  # SIGKILL: nothing could clean up
    # a young temp is kept (its writer might be alive on a slow disk) ...
    assert atomic.collect_stale_temps(tmp_path) == [] and tmp.exists()
    # ... once past the grace period and with its pid dead, the next write collects it
    past = time.time() - atomic.GRACE_S - 10
    os.utime(tmp, (past, past))
    c = synthetic_cache(torch.float32, T=8)
    write_kvc(c, out, get_plan("lossless", c).pipelines)
    assert not tmp.exists() and _temps(tmp_path) == []
    with KvcReader(out) as r:
        assert r.verify() == [] and r.header.num_tokens == 8


def test_stale_temp_rules(tmp_path):
    past = time.time() - atomic.GRACE_S - 10
    alive = tmp_path / f".x.{atomic.host_tag()}.{os.getpid()}.0000abcd{atomic.TEMP_SUFFIX}"
    dead = _killed_writer(tmp_path / "y")
    other_host = tmp_path / f".z.00000000.{dead.name.split('.')[-3]}.0000abcd{atomic.TEMP_SUFFIX}"
    foreign = tmp_path / ".w.tmp"  # not our pattern: never touched
    for p in (alive, other_host, foreign):
        p.write_bytes(b"x")
    for p in (alive, dead, other_host, foreign):
        os.utime(p, (past, past))
    assert atomic.collect_stale_temps(tmp_path) == [dead]
    assert alive.exists() and other_host.exists() and foreign.exists()
    very_old = time.time() - atomic.MAX_AGE_S - 10
    os.utime(other_host, (very_old, very_old))
    assert atomic.collect_stale_temps(tmp_path) == [other_host]
    assert alive.exists() and foreign.exists()


def test_failed_write_leaves_the_old_output_and_no_temp(tmp_path):
    out = tmp_path / "out.kvc"
    old = _kvc(out)

    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom):
        with atomic.atomic_file(out) as f:
            f.write(b"partial")
            raise Boom()
    assert out.read_bytes() == old and _temps(tmp_path) == []


def test_output_names_up_to_name_max_work_and_longer_ones_are_one_line(tmp_path):
    ok = tmp_path / ("a" * 250 + ".h5")
    save_capture(synthetic_cache(torch.float32, T=8), ok)
    assert ok.is_file() and _temps(tmp_path) == []
    with pytest.raises(KvcIOError, match="file name too long"):
        atomic.atomic_write_bytes(tmp_path / ("b" * 300), b"x")


def test_new_files_get_umask_permissions_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic.atomic_write_bytes(tmp_path / "p", b"x")
        for name in ("c.h5", "c.safetensors"):  # safetensors' own writer made its capture 0600
            save_capture(synthetic_cache(torch.float32, T=8), tmp_path / name)
    finally:
        os.umask(old)
    for name in ("p", "c.h5", "c.safetensors"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o644, name


# -- disk full / read-only filesystem --------------------------------------------------------
def test_disk_full_on_encode_is_one_line_in_process(tmp_path, capsys, monkeypatch):
    """ENOSPC from a file write (simulated in-process) -> one KvcIOError line, old output kept, no temp."""
    cap = tmp_path / "c.h5"
    save_capture(synthetic_cache(torch.float32, T=16), cap)
    out = tmp_path / "o.kvc"
    old = _kvc(out)
    real_open = open

    class FullFile:
        def __init__(self, f):
            self._f, self.n = f, 0

        def write(self, b):
            self.n += len(b)
            if self.n > 4096:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self._f.write(b)

        def __getattr__(self, k):
            return getattr(self._f, k)

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return self._f.__exit__(*a)

    monkeypatch.setattr(atomic, "open", lambda *a, **k: FullFile(real_open(*a, **k)), raising=False)
    code, _, err = run_kvc(["encode", str(cap), "-o", str(out)], capsys)
    line = one_line_error(code, err)
    assert code == KvcIOError.exit_code and "no space left" in line, line
    assert out.read_bytes() == old and _temps(tmp_path) == []


def test_read_only_filesystem_is_one_line_in_process(tmp_path, capsys, monkeypatch):
    src = tmp_path / "a.kvc"
    _kvc(src)
    real = os.open

    def ro_open(path, flags, *a, **k):
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *a, **k)

    monkeypatch.setattr(atomic.os, "open", ro_open)
    code, _, err = run_kvc(["decode", str(src), "-o", str(tmp_path / "x.h5")], capsys)
    line = one_line_error(code, err)
    assert code == KvcIOError.exit_code and "read-only" in line, line


def _can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


@pytest.fixture()
def tiny_tmpfs(tmp_path):
    """A 256 KiB tmpfs (root only; elsewhere the in-process tests above cover the same paths)."""
    if not _can_mount():
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def test_disk_full_on_a_real_tiny_filesystem(tiny_tmpfs, tmp_path, capsys):
    cap = tmp_path / "c.h5"
    c = synthetic_cache(torch.float32, T=4096)  # 512 KiB of K/V: cannot fit in 256 KiB
    save_capture(c, cap)
    src = tmp_path / "a.kvc"
    write_kvc(c, src, get_plan("raw", c).pipelines)
    (tiny_tmpfs / "keep").write_bytes(b"old")
    (tiny_tmpfs / "keep.h5").write_bytes(b"old")  # a capture's name says its format (.h5 / .hdf5 / .safetensors)
    for args in (["encode", str(cap), "--preset", "raw", "-o", str(tiny_tmpfs / "keep")], ["decode", str(src), "-o", str(tiny_tmpfs / "keep.h5")],
                 ["decode", str(src), "-o", str(tiny_tmpfs / "x.safetensors")]):
        code, _, err = run_kvc(args, capsys)
        line = one_line_error(code, err)
        assert code == KvcIOError.exit_code and "no space left" in line, line
        assert (tiny_tmpfs / "keep").read_bytes() == b"old" and (tiny_tmpfs / "keep.h5").read_bytes() == b"old"
        assert _temps(tiny_tmpfs) == []


def test_read_only_real_filesystem(tiny_tmpfs, tmp_path, capsys):
    src = tmp_path / "a.kvc"
    _kvc(src)
    subprocess.run(["mount", "-o", "remount,ro", str(tiny_tmpfs)], check=True)
    for out in (tiny_tmpfs / "x.h5", tiny_tmpfs / "x.safetensors"):
        code, _, err = run_kvc(["decode", str(src), "-o", str(out)], capsys)
        line = one_line_error(code, err)
        assert code == KvcIOError.exit_code and "read-only" in line, line
