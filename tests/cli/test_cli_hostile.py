"""Every ``kvc`` subcommand fed hostile arguments answers with one ``kvc: error:`` line and a non-zero exit.

Empty files, directories and FIFOs where files belong, huge / negative / NaN
numbers, non-UTF-8 text, and model directories that are missing, pickle-only,
truncated or malformed (refused before transformers is called, so nothing
is ever unpickled). None of these needs the model to load.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

from kvcodec.errors import KvcModelNotFoundError
from kvcodec.format import write_kvc
from kvcodec.plan.presets import get_plan
from kvcodec.core.kvcache import save_capture

from cliutil import run_kvc  # noqa: E402
from formatutil import synthetic_cache  # noqa: E402


@pytest.fixture()
def hostile(tmp_path, monkeypatch):
    """A directory of hostile inputs; the tests run inside it."""
    monkeypatch.chdir(tmp_path)
    for name in ("empty.kvc", "empty.h5", "empty.txt"):
        Path(name).touch()
    Path("adir").mkdir()
    os.mkfifo("fifo")
    Path("u.txt").write_text("café ☃ naïve text with ünïcödé " * 20, encoding="utf-8")
    Path("bin.txt").write_bytes(b"\xff\xfe\x00\x80bad")
    c = synthetic_cache(torch.float32, T=16)
    save_capture(c, "s.h5")
    write_kvc(c, "s.kvc", get_plan("lossless", c).pipelines)
    # model directories that must never reach transformers
    cfg = json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    for d in ("pickle_model", "trunc_model", "cfg_only", "index_model", "hdr_model"):
        Path(d).mkdir()
        Path(d, "config.json").write_text(cfg)
    # a pickle that would run code if anything unpickled it
    Path("pickle_model", "pytorch_model.bin").write_bytes(
        b"\x80\x04\x95\x1f\x00\x00\x00\x00\x00\x00\x00\x8c\x02os\x8c\x06system\x93\x8c\x07touch PWNED\x85R.")
    hdr = json.dumps({"w": {"dtype": "F32", "shape": [1000, 1000], "data_offsets": [0, 4000000]}}).encode()
    Path("trunc_model", "model.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 1000)
    Path("index_model", "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    Path("index_model", "model-00001.safetensors").write_bytes(struct.pack("<Q", len(hdr)) + hdr + b"\0" * 4000000)
    Path("hdr_model", "model.safetensors").write_bytes(struct.pack("<Q", 1 << 60) + b"{}")
    # JSON nested 100,000 deep (the json module's RecursionError), a config file that is not UTF-8
    deep = "[" * 100_000 + "]" * 100_000
    Path("deep.json").write_text(deep)
    Path("bin.json").write_bytes(b"\xff\xfe{")
    Path("deep_st").mkdir()
    Path("deep_st", "kvstore.json").write_text(deep)
    Path("deep_index").mkdir()
    Path("deep_index", "config.json").write_text(cfg)
    Path("deep_index", "model.safetensors.index.json").write_text(deep)
    return tmp_path


CASES = [
    # .kvc readers
    ["info", "empty.kvc"], ["info", "fifo"], ["info", "adir"], ["info", "missing.kvc"], ["info", "s.h5"],
    ["verify", "empty.kvc"], ["verify", "fifo"], ["verify", "adir"],
    ["decode", "empty.kvc", "-o", "o.h5"], ["decode", "fifo", "-o", "o.h5"], ["decode", "s.kvc", "-o", ""],
    ["decode", "s.kvc", "-o", "adir/"], ["decode", "s.kvc", "-o", "s.kvc"], ["decode", "s.kvc", "-o", "fifo"],
    ["decode", "s.kvc", "-o", "nodir/o.h5"], ["decode", "s.kvc", "-o", "o.h5", "--backend", "tpu"],
    # encode
    ["encode", "empty.h5", "-o", "o.kvc"], ["encode", "fifo", "-o", "o.kvc"], ["encode", "s.kvc", "-o", "o.kvc"],
    ["encode", "s.h5", "-o", "o.kvc", "--chunk-tokens", "-5"], ["encode", "s.h5", "-o", "o.kvc", "--chunk-tokens", "0"],
    ["encode", "s.h5", "-o", "o.kvc", "--chunk-tokens", "abc"], ["encode", "s.h5", "-o", "o.kvc", "--preset", "nope"],
    ["encode", "s.h5", "-o", "o.kvc", "--config", '{"preset":"lossless","level":1e400}'],
    ["encode", "s.h5", "-o", "o.kvc", "--config", '{"preset":"lossless","level":99999999999999999999999}'],
    ["encode", "s.h5", "-o", "o.kvc", "--config", "adir"], ["encode", "s.h5", "-o", "o.kvc", "--config", "fifo"],
    ["encode", "s.h5", "-o", "o.kvc", "--config", "[1,2]"], ["encode", "s.h5", "-o", "s.h5"],
    ["encode", "-o", "o.kvc", "--text", "empty.txt"], ["encode", "-o", "o.kvc", "--text", "bin.txt"],
    ["encode", "-o", "o.kvc", "--text", "fifo"], ["encode", "-o", "o.kvc", "--text", "adir"],
    ["encode", "-o", "o.kvc", "--text", "u.txt", "--max-tokens", "-1"],
    ["encode", "s.h5", "-o", "o.kvc", "--prune", "h2o:1e309"], ["encode", "s.h5", "-o", "o.kvc", "--prune", "h2o:nan"],
    ["encode", "s.h5", "-o", "o.kvc", "--prune", "h2o:-0"], ["encode", "s.h5", "-o", "o.kvc", "--target-kl", "nan"],
    ["encode", "s.h5", "-o", "o.kvc", "--target-kl", "-1"],
    # prune / capture / eval / curve / ask / demo with inputs refused before any model loads
    ["prune", "empty.h5", "--prune", "h2o:0.5", "-o", "p.h5"], ["prune", "fifo", "--prune", "h2o:0.5", "-o", "p.h5"],
    ["prune", "s.h5", "--prune", "h2o:0.5", "-o", "s.h5"], ["prune", "s.h5", "--prune", "bogus", "-o", "p.h5"],
    ["capture", "--text", "fifo", "-o", "c.h5", "-m", "/nonexistent"], ["capture", "--text", "u.txt", "-o", "fifo"],
    ["capture", "--text", "u.txt", "-o", "u.txt"], ["capture", "--text", "u.txt", "-o", "trunc_model/config.json", "-m", "trunc_model"],
    ["encode", "--text", "u.txt", "-o", "trunc_model/model.safetensors", "-m", "trunc_model"], ["eval", "fifo", "--text", "u.txt"], ["eval", "empty.kvc", "--text", "fifo"],
    ["eval", "s.kvc", "--text", "u.txt", "--greedy-tokens", "-1"],
    ["curve", "--text", "u.txt", "--json", "x.json", "--csv", "x.json"], ["curve", "--text", "u.txt", "--plot", "p.gif"],
    ["curve", "--text", "u.txt", "--json", "fifo"], ["curve", "--text", "u.txt", "--continuation", "0"],
    ["ask", "--doc", "u.txt", "q", "--blend", "--recompute-ratio", "nan"], ["ask", "--doc", "u.txt", "q", "--recompute-ratio", "0.5"],
    ["ask", "--doc", "fifo", "q", "-m", "/nonexistent"], ["ask", "--doc", "u.txt", "q", "--preset", "nope", "-m", "/nonexistent"],
    ["ask", "--doc", "u.txt", "q", "--max-new-tokens", "0", "-m", "/nonexistent"], ["ask", "--doc", "u.txt", " ", "-m", "/nonexistent"],
    ["demo", "--out-dir", "fifo", "--no-curve"], ["demo", "--out-dir", "u.txt/sub", "--no-curve"],
    ["store", "get", "not-a-key", "-o", "x", "--store", "adir"], ["nosuchcommand"], ["encode", "--no-such-option"],
    # issue 35: every failure exits non-zero with one line -- unreachable or partly unreachable tiers,
    # outputs naming a directory, out-of-range options
    ["store", "ls", "--store", "redis://127.0.0.1:1/0?timeout=0.5"], ["store", "ls", "--store", "kvc+http://127.0.0.1:1"],
    ["store", "ls", "--store", "st,redis://127.0.0.1:1/0?timeout=0.5"],
    ["store", "stats", "--store", "redis://127.0.0.1:1/0?timeout=0.5"],
    ["store", "gc", "--store", "redis://127.0.0.1:1/0?timeout=0.5"],
    ["store", "put", "s.kvc", "--store", "st,redis://127.0.0.1:1/0?timeout=0.5"],
    ["store", "get", "kvc1:m:c:default:3:" + "0" * 64, "-o", "newdir/", "--store", "st"],
    ["store", "keygen", "-o", "newdir/"], ["store", "gc", "--grace", "-5", "--store", "st"],
    ["store", "gc", "--grace", "nan", "--store", "st"], ["verify", "s.kvc", "--max-decoded-ratio", "-1"],
    ["verify", "s.kvc", "--max-decoded", "0"], ["serve", "--workers", "0"], ["serve", "--header-timeout", "0"],
    ["serve", "--body-timeout", "nan"], ["serve", "--max-decoded-ratio", "-1"], ["serve", "--max-decoded", "0"],
    ["serve", "--tenant-queue", "-1"], ["capture", "--text", "u.txt", "--max-tokens", "0", "-o", "c.h5"],
    ["encode", "s.h5", "-o", "o.kvc", "--chunk-heads", "0"], ["eval", "s.kvc", "--text", "u.txt", "--continuation", "-1"],
    ["curve", "--text", "u.txt", "--threads", "0"], ["demo", "--max-tokens", "0", "--no-curve"],
    # tracebacks: a --config file nested too deep or not UTF-8, inline JSON nested too deep, an inline value too long
    # for a file name; a store marker nested too deep
    ["encode", "s.h5", "-o", "o.kvc", "--config", "deep.json"], ["encode", "s.h5", "-o", "o.kvc", "--config", "bin.json"],
    ["encode", "s.h5", "-o", "o.kvc", "--config", '{"preset":' + "[" * 50_000 + "]" * 50_000 + "}"],
    ["encode", "s.h5", "-o", "o.kvc", "--config", "x" * 5000], ["store", "ls", "--store", "deep_st"],
    # a --text / --doc too long for a file name (the text given inline) escaped as OSError ENAMETOOLONG
    ["capture", "--text", "x" * 5000, "-o", "c.h5"], ["ask", "--doc", "x" * 5000, "q"],
    ["eval", "s.kvc", "--text", "x" * 5000], ["store", "put", "x" * 5000, "--store", "st"],
    ["store", "put", "fifo", "--store", "st"], ["store", "put", "adir", "--store", "st"],
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: " ".join(a)[:60])
def test_hostile_arguments_are_one_line_errors(hostile, args, capsys):
    before = {p: p.stat().st_size for p in hostile.iterdir() if p.is_file()}
    code, out, err = run_kvc(args, capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code != 0, (args, out, err)
    assert len(lines) == 1 and lines[0].startswith("kvc: error: ") and "Traceback" not in err, (args, err)
    assert "/nonexistent" not in lines[0] or "fifo" in " ".join(args), (args, err)  # refused before the model is looked up
    after = {p: p.stat().st_size for p in hostile.iterdir() if p.is_file()}
    assert {p: n for p, n in after.items() if p in before} == before  # no input clobbered
    assert not [p for p in hostile.iterdir() if p.name.endswith(".kvctmp")]
    assert Path(hostile, "fifo").is_fifo()


@pytest.mark.parametrize("model, words", [
    ("pickle_model", "only pickle weights"), ("trunc_model", "truncated"), ("cfg_only", "no .safetensors"),
    ("index_model", "missing shard"), ("hdr_model", "not a readable safetensors"), ("/nonexistent", "neither"),
    ("u.txt", "neither"), ("adir", "no config.json"), ("deep_index", "unreadable model.safetensors.index.json"),
    ("m" * 5000, "neither"),  # escaped as OSError ENAMETOOLONG
])
@pytest.mark.parametrize("command", [
    ["capture", "--text", "u.txt", "-o", "c.h5"], ["encode", "--text", "u.txt", "-o", "o.kvc"],
    ["eval", "s.kvc", "--text", "u.txt"], ["ask", "--doc", "u.txt", "q", "--store", "st"],
    ["demo", "--no-curve", "--out-dir", "d"], ["prune", "s.h5", "--prune", "lingua:0.5", "-o", "p.h5"],
])
def test_bad_model_directories_are_refused_before_transformers(hostile, command, model, words, capsys):
    code, _, err = run_kvc(command + ["-m", model], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == KvcModelNotFoundError.exit_code, err
    assert len(lines) == 1 and words in lines[0], err
    assert not Path(hostile, "PWNED").exists()


@pytest.mark.model
def test_check_weights_accepts_the_real_model_and_forces_safetensors(lm, monkeypatch):
    """The embedded model passes the pre-check, and transformers is told to load safetensors only."""
    from transformers import AutoModelForCausalLM

    from kvcodec.models import load as m
    assert [f.suffix for f in m.check_weights(lm.path)] == [".safetensors"]
    seen = {}

    def fake(path, **kw):
        seen.update(kw)
        raise OSError("stop here")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", fake)
    with pytest.raises(KvcModelNotFoundError, match="stop here"):
        m.load_model(str(lm.path))
    assert seen.get("use_safetensors") is True
