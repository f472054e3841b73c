"""``kvc edit``: thin over the library; bad input is one line and a non-zero exit."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvcodec.format import KvcReader
from tests._support.cliutil import run_kvc
from tests.edit.conftest import EMAIL

pytestmark = pytest.mark.model


@pytest.fixture()
def parent(entry, tmp_path):
    _, data = entry(160)
    p = tmp_path / "doc.kvc"
    p.write_bytes(data)
    return p


def test_redact_then_append_through_the_cli(parent, tmp_path, capsys):
    red = tmp_path / "red.kvc"
    rc, out, err = run_kvc(["edit", "redact", str(parent), "--pattern", EMAIL, "-o", str(red), "--json"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    assert info["op"] == "redact" and info["removed_tokens"] > 0 and info["output"] == str(red)
    more = tmp_path / "more.txt"
    more.write_text("Thanks to all translators.")
    both = tmp_path / "both.kvc"
    rc, out, err = run_kvc(["edit", "append", str(red), "--text-file", str(more), "-o", str(both)], capsys)
    assert rc == 0, err
    assert "append ->" in out and "prefilling" in err  # progress goes to stderr
    with KvcReader(str(both)) as r:
        assert [e["op"] for e in r.header.meta["edits"]] == ["redact", "append"]
        assert np.array_equal(r.token_ids[:info["tokens"]], KvcReader(str(red)).token_ids)


def test_redact_through_the_cli_names_its_parent_only_under_a_lineage_key(parent, tmp_path, capsys):
    """Issue 55: --repair prefill is the default, the log keeps neither the pattern nor a plain parent digest,
    and --lineage-key-file makes the parent checkable by whoever holds the key."""
    from kvcodec.edit.log import file_sha256, lineage_mac

    key = tmp_path / "lineage.key"
    key.write_bytes(b"s" * 32)
    red = tmp_path / "red.kvc"
    rc, out, err = run_kvc(["edit", "redact", str(parent), "--pattern", EMAIL, "--lineage-key-file", str(key),
                            "-o", str(red), "--json"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    assert info["repair"] == "prefill" and "parent_sha256" not in info and "pattern" not in info["params"]
    with KvcReader(str(red)) as r:
        rec = r.header.meta["edits"][-1]
    assert rec["parent_mac"] == info["parent_mac"] == lineage_mac(b"s" * 32, file_sha256(parent.read_bytes()))
    assert EMAIL not in red.read_bytes().decode("latin-1")


@pytest.mark.parametrize("args, msg", [
    (["redact", "{p}", "--pattern", "(", "-o", "{o}"], "bad regular expression"),
    (["redact", "{p}", "--tokens", "3:5", "--ratio", "0.1", "-o", "{o}"], "tune repair='blend'"),
    (["redact", "{p}", "--pattern", "(a|aa)+$", "-o", "{o}"], ""),  # matches nothing, quickly or at its bound
    (["redact", "{p}", "--tokens", "3-9", "-o", "{o}"], "START:END"),
    (["redact", "{p}", "--tokens", "0:100000", "-o", "{o}"], "outside"),
    (["append", "{p}", "-o", "{o}"], "exactly one of --text"),
    (["append", "{p}", "--text", "ab\udcffcd", "-o", "{o}"], "lone surrogate"),  # argv bytes not UTF-8: was a TypeError
    (["append", "{p}", "--text", "x", "-o", "{p}"], ""),  # never in place
    (["steer", "{p}", "--tokens", "2:5", "--heads", "99:0", "-o", "{o}"], "out of range"),
    (["steer", "{p}", "--tokens", "2:5", "--heads", "20:*", "--alpha", "nan", "-o", "{o}"], "finite"),
    (["steer", "{p}", "--tokens", "2:5", "--heads", "20", "-o", "{o}"], "LAYER:HEAD"),
    (["steer", "{p}", "--auto", "0", "--heads", "20:*", "-o", "{o}"], "integer in [1,"),
    (["steer", "{p}", "--auto", "9999", "--heads", "20:*", "-o", "{o}"], "integer in [1,"),
    (["steer", "{p}", "--auto", "2", "--tokens", "2:5", "--heads", "20:*", "-o", "{o}"], "exactly one of"),
    (["steer", "{p}", "--auto", "2", "--heads", "99:0", "-o", "{o}"], "out of range"),
])
def test_bad_input_is_one_line(parent, tmp_path, capsys, args, msg):
    out_path = tmp_path / "out.kvc"
    rc, out, err = run_kvc(["edit"] + [a.format(p=parent, o=out_path) for a in args], capsys)
    assert rc != 0 and len(err.strip().splitlines()) == 1 and msg in err
    assert not out_path.exists()


def test_steer_through_the_cli(parent, tmp_path, capsys):
    out_path = tmp_path / "steered.kvc"
    rc, out, err = run_kvc(["edit", "steer", str(parent), "--tokens", "2:5", "--heads", "20:*,23:1", "-o", str(out_path),
                            "--json"], capsys)
    assert rc == 0, err
    info = json.loads(out)
    assert info["op"] == "steer" and info["steered_heads"] == 10 and info["spans"] == [[2, 5]]
    with KvcReader(str(out_path)) as r:
        assert len(r.header.attention_bias.entries) == 10


def test_steer_auto_through_the_cli(parent, tmp_path, capsys):
    """``--auto K``: the scorer's K sentences become the spans, and the log records that they were chosen."""
    out_path = tmp_path / "auto.kvc"
    rc, out, err = run_kvc(["edit", "steer", str(parent), "--auto", "2", "--heads", "20:*", "-o", str(out_path), "--json"],
                           capsys)
    assert rc == 0, err
    info = json.loads(out)
    assert 1 <= len(info["spans"]) <= 2  # two sentences; adjacent ones merge into one span
    with KvcReader(str(out_path)) as r:
        assert r.header.meta["edits"][-1]["params"]["auto"] == 2


def test_kvc_info_says_what_an_edited_entry_promises(parent, tmp_path, capsys):
    """Issue 57: the edit prints its repair and promise; ``kvc info`` (text and --json) shows the entry's promise,
    and nothing about edits for an entry never edited."""
    lossy = tmp_path / "lossy.kvc"
    with KvcReader(str(parent)) as r:
        cache = r.read_cache()
    from kvcodec.api import encode

    encode(cache, lossy, preset="balanced")  # no model: uniform steps, still lossy
    cheap, fresh = tmp_path / "cheap.kvc", tmp_path / "fresh.kvc"
    rc, out, err = run_kvc(["edit", "append", str(lossy), "--text", " More text.", "--repair", "incremental",
                            "--preset", "lossless", "-o", str(cheap)], capsys)
    assert rc == 0, err
    assert "incremental: prefilled" in out and "promise: none: the parent is lossy (balanced)" in out
    assert "decode error is carried" in err  # the progress line names the path
    rc, out, err = run_kvc(["edit", "append", str(lossy), "--text", " More text.", "--preset", "lossless",
                            "-o", str(fresh)], capsys)
    assert rc == 0, err
    assert "prefill: prefilled" in out and "prefilled afresh" in err
    rc, out, _ = run_kvc(["info", str(cheap)], capsys)
    assert "edits:       append" in out and "promise:     none: the parent is lossy (balanced)" in out
    rc, out, _ = run_kvc(["info", str(fresh), "--json"], capsys)
    assert json.loads(out)["edit"] == {"ops": ["append"], "promise": {"preset": "lossless",
                                                                      "basis": "fresh prefill of the child's ids"}}
    rc, out, _ = run_kvc(["info", str(lossy), "--json"], capsys)
    assert json.loads(out)["edit"] is None
    rc, out, _ = run_kvc(["info", str(lossy)], capsys)
    assert "promise:" not in out and "edits:" not in out


def test_a_lineage_key_file_is_read_bounded_and_in_one_line(tmp_path, capsys, monkeypatch):
    """A huge file given as --lineage-key-file was read whole into memory, and an unreadable one escaped as a
    traceback; both are one error line before the model loads or the entry is opened."""
    import builtins

    big = tmp_path / "big.key"
    with open(big, "wb") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB that cost no disk
    missing_entry = tmp_path / "never-opened.kvc"
    rc, out, err = run_kvc(["edit", "redact", str(missing_entry), "--tokens", "0:1", "--lineage-key-file", str(big),
                            "-o", str(tmp_path / "c.kvc")], capsys)
    assert rc != 0 and "longer than 4,096 bytes" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    small = tmp_path / "small.key"
    small.write_bytes(b"s" * 32)
    real_open = builtins.open

    def deny(path, *a, **k):  # the box runs as root, where chmod 000 denies nothing
        if str(path) == str(small):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *a, **k)

    monkeypatch.setattr(builtins, "open", deny)
    monkeypatch.setattr("pathlib.Path.read_bytes", lambda self: deny(self).read())
    rc, out, err = run_kvc(["edit", "redact", str(missing_entry), "--tokens", "0:1", "--lineage-key-file", str(small),
                            "-o", str(tmp_path / "c.kvc")], capsys)
    assert rc != 0 and "permission denied" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("which", ["text-file", "lineage-key-file"])
def test_the_child_never_replaces_a_file_the_command_reads(parent, tmp_path, capsys, which):
    """-o naming the --text-file (or the --lineage-key-file: the secret that checks the lineage) wrote the child over it."""
    src = tmp_path / "input.bin"
    src.write_bytes(b"k" * 32 if which == "lineage-key-file" else b"Thanks to all translators.")
    args = (["append", str(parent), "--text-file", str(src)] if which == "text-file" else
            ["redact", str(parent), "--tokens", "3:5", "--lineage-key-file", str(src)])
    rc, out, err = run_kvc(["edit", *args, "-o", str(src)], capsys)
    assert rc != 0 and len(err.strip().splitlines()) == 1 and "same file as the input" in err
    assert src.read_bytes() == (b"k" * 32 if which == "lineage-key-file" else b"Thanks to all translators.")
