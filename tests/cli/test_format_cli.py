"""kvc encode / decode / info / verify, including bad inputs (one-line error, non-zero exit)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from kvcodec.cli.main import cli
from kvcodec.core.kvcache import load_capture, save_capture

from cliutil import run_kvc as run_main  # noqa: E402
from formatutil import assert_same_cache, synthetic_cache  # noqa: E402


@pytest.fixture()
def capture_file(tmp_path) -> Path:
    c = synthetic_cache(torch.float32, T=12, n_ctx=20, positions=np.arange(0, 24, 2)[:12] % 20)
    p = tmp_path / "cap.h5"
    save_capture(c, p)
    return p


def test_encode_info_verify_decode(tmp_path, capture_file, capsys):
    out = tmp_path / "c.kvc"
    code, o, e = run_main(["encode", str(capture_file), "-o", str(out), "--preset", "lossless", "--chunk-tokens", "5", "--json"], capsys)
    assert code == 0, e
    info = json.loads(o)
    assert info["bytes"] == out.stat().st_size and info["preset"] == "lossless"

    code, o, e = run_main(["info", str(out)], capsys)
    assert code == 0, e
    assert "bits per KV element" in o and "pipeline 0: raw -> shuffle(elementsize=4) -> zstd(level=3)" in o
    assert "20 context, 12 stored (kept 60.0%" in o
    code, o, _ = run_main(["info", str(out), "--json"], capsys)
    d = json.loads(o)
    assert d["stored_tokens"] == 12 and d["chunks"] == 2 * 2 * 3 and abs(d["kept_fraction"] - 0.6) < 1e-9
    assert d["bits_per_element"] == pytest.approx(out.stat().st_size * 8 / d["kv_elements"])
    s = d["sizes"]
    assert s["header"] + sum(s["blobs"].values()) + s["chunks"] + s["index"] + s["footer"] + s["padding"] == s["file"]

    code, o, _ = run_main(["verify", str(out)], capsys)
    assert code == 0 and o.startswith("OK ")
    code, o, _ = run_main(["verify", str(out), "--json"], capsys)
    assert code == 0 and json.loads(o)["ok"] is True

    for ext in ("h5", "safetensors"):
        back = tmp_path / f"back.{ext}"
        code, o, e = run_main(["decode", str(out), "-o", str(back), "--backend", "cpu"], capsys)
        assert code == 0, e
        assert_same_cache(load_capture(back), load_capture(capture_file))


@pytest.mark.parametrize("preset", ["raw", "zstd"])
def test_encode_other_builtin_presets(tmp_path, capture_file, preset):
    r = CliRunner().invoke(cli, ["encode", str(capture_file), "-o", str(tmp_path / "x.kvc"), "--preset", preset])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(cli, ["verify", str(tmp_path / "x.kvc")])
    assert r.exit_code == 0, r.output


def _one_line_error(code: int, err: str) -> None:
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvc: error:"), err
    assert "Traceback" not in err


def test_bad_inputs(tmp_path, capture_file, capsys, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the GPU tests set it for the session
    good = tmp_path / "g.kvc"
    assert run_main(["encode", str(capture_file), "-o", str(good)], capsys)[0] == 0
    data = good.read_bytes()
    garbage = tmp_path / "garbage.kvc"
    garbage.write_bytes(b"hello world, definitely not kvc" * 10)
    trunc = tmp_path / "trunc.kvc"
    trunc.write_bytes(data[: len(data) // 2])
    flipped = tmp_path / "flip.kvc"
    fb = bytearray(data)
    fb[len(fb) // 2] ^= 4
    flipped.write_bytes(bytes(fb))
    empty = tmp_path / "empty.kvc"
    empty.write_bytes(b"")
    for cmd in ("info", "verify", "decode"):
        extra = ["-o", str(tmp_path / "o.h5")] if cmd == "decode" else []
        code, _, err = run_main([cmd, str(tmp_path / "missing.kvc")] + extra, capsys)
        _one_line_error(code, err)
        assert code == 2 and "no such file" in err
        for bad in (garbage, trunc, empty):
            code, _, err = run_main([cmd, str(bad)] + extra, capsys)
            _one_line_error(code, err)
            assert code == 3
    code, _, err = run_main(["verify", str(flipped)], capsys)
    _one_line_error(code, err)
    assert "CRC32C" in err
    # a capture's extension names its format: any other is refused before the work, and nothing is written (an
    # HDF5 file was written under .kvc or .txt, which no reader takes for one)
    for name in ("o.kvc", "o.txt", "o"):
        for argv in (["decode", str(good), "-o", str(tmp_path / name)],
                     ["prune", str(capture_file), "--prune", "h2o:0.5", "-o", str(tmp_path / name)]):
            code, _, err = run_main(argv, capsys)
            _one_line_error(code, err)
            assert ".h5, .hdf5, .safetensors" in err and not (tmp_path / name).exists()
    code, _, err = run_main(["decode", str(good), "-o", str(tmp_path / "o.HDF5")], capsys)
    assert code == 0 and load_capture(tmp_path / "o.HDF5").num_tokens > 0
    code, o, err = run_main(["verify", str(flipped), "--json"], capsys)
    assert code == 3 and json.loads(o)["ok"] is False
    _one_line_error(code, err)  # the JSON on stdout and the error line (it exited 3 without one)
    # a backend that cannot be used is the caller's error, never a problem of the (good) file
    monkeypatch.setenv("KVCODEC_BACKEND", "tpu")
    code, _, err = run_main(["verify", str(good)], capsys)
    _one_line_error(code, err)
    assert code == 2 and "unknown backend 'tpu'" in err and "g.kvc" not in err
    monkeypatch.delenv("KVCODEC_BACKEND")
    code, _, err = run_main(["encode", str(tmp_path / "missing.h5"), "-o", str(tmp_path / "x.kvc")], capsys)
    _one_line_error(code, err)
    code, _, err = run_main(["encode", str(garbage), "-o", str(tmp_path / "x.kvc")], capsys)
    _one_line_error(code, err)
    code, _, err = run_main(["encode", str(capture_file), "-o", str(tmp_path / "x.kvc"), "--preset", "no-such-preset"], capsys)
    _one_line_error(code, err)
    assert "no-such-preset" in err
    code, _, err = run_main(["encode", str(capture_file), "-o", str(tmp_path / "x.kvc"), "--chunk-tokens", "0"], capsys)
    _one_line_error(code, err)
    assert not (tmp_path / "x.kvc").exists()
    if not torch.cuda.is_available():
        code, _, err = run_main(["decode", str(good), "-o", str(tmp_path / "o.h5"), "--backend", "gpu"], capsys)
        _one_line_error(code, err)
        assert code == 7
        code, _, err = run_main(["verify", str(good), "--backend", "gpu"], capsys)  # said the good file was bad (3)
        _one_line_error(code, err)
        assert code == 7


def test_info_escapes_the_files_control_characters(tmp_path, capsys):
    """A file's writer / codec / meta strings holding a newline printed a forged line in `kvc info` (here a second
    "model:" line), and an ANSI or BEL sequence reached the terminal."""
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan
    from kvcodec.testing.surgery import Parts

    c = synthetic_cache(torch.float32, T=8)
    good = tmp_path / "g.kvc"
    write_kvc(c, good, get_plan("lossless", c).pipelines)
    p = Parts(good.read_bytes())
    h = p.own_header()
    h["writer"] = "kvcodec 0.1.0\nmodel:       FORGED \x1b[2J"
    h["codec"] = "lossless\x07\u202e"
    evil = tmp_path / "evil.kvc"
    evil.write_bytes(p.build())
    code, out, err = run_main(["info", str(evil)], capsys)
    assert code == 0, err
    assert [ln for ln in out.splitlines() if ln.startswith("model:")] == [out.splitlines()[1]]
    assert "FORGED" in out.splitlines()[0] and not any(ch in out for ch in "\x1b\x07\u202e")
    assert "codec:       lossless\\x07\\u202e" in out
