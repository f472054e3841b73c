"""``kvc store`` as two tenants with their own key files, and odd ids on the command line."""

from __future__ import annotations

import json

import pytest

from cliutil import run_kvc

GOOD = "kvc1:m:c:default:300:" + "0" * 64
ODD_KEYS = [
    "kvc1:m:c:default:\u0663\u0660\u0660:" + "0" * 64,       # Arabic-Indic digits
    "kvc1:m:c:default:\u00b2:" + "0" * 64,                  # superscript two (isdigit, not int)
    "kvc1:m:c:default:" + "9" * 5000 + ":" + "0" * 64,      # past int()'s digit limit
    "kvc1:m:c:default\n:300:" + "0" * 64,                   # a newline inside the namespace
    "kvc1:m:c:de\udcfffault:300:" + "0" * 64,               # a lone surrogate
    "kvc1:m:c:default:300:" + "\uff10" * 64,                # fullwidth zeros as the digest
    "kvc1:m:c:default:-1:" + "0" * 64,
    "kvc1:" + "m" * 200 + ":c:default:1:" + "0" * 64,
    "",
]


@pytest.mark.parametrize("bad", ODD_KEYS)
@pytest.mark.parametrize("cmd", ["get", "rm"])
def test_odd_store_ids_are_one_line_errors(bad, cmd, tmp_path, capsys):
    args = ["store", cmd, bad, "--store", str(tmp_path / "st")] + (["-o", str(tmp_path / "o")] if cmd == "get" else [])
    code, out, err = run_kvc(args, capsys)
    assert code == 2, err
    assert err.startswith("kvc: error:") and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("url", ["redis://127.0.0.1:\u0666\u0663\u0667\u0669/0", "http://[::1/x/",
                                 "file:///tmp/x?max_bytes=\u0661\u0660M", "mem://?max_bytes=1\u00b2"])
def test_odd_store_urls_are_one_line_errors(url, capsys):
    code, _, err = run_kvc(["store", "ls", "--store", url], capsys)
    assert code == 2 and err.startswith("kvc: error:") and err.count("\n") == 1, err


@pytest.mark.parametrize("flt", [["--namespace", "a/b"], ["--namespace", ""], ["--namespace", "n" * 200],
                                 ["--model", "m:x"]])
def test_ls_filters_no_key_can_carry_are_one_line_errors(flt, tmp_path, capsys):
    """``kvc store ls --namespace a/b`` listed nothing and exited 0, as if the store held no such entry."""
    code, out, err = run_kvc(["store", "ls", "--store", str(tmp_path / "st"), *flt], capsys)
    assert code == 2 and err.startswith("kvc: error:") and err.count("\n") == 1 and not out, err
    assert "is invalid" in err
    code, out, err = run_kvc(["store", "ls", "--store", str(tmp_path / "st"), "--namespace", "ok", "--json"], capsys)
    assert code == 0 and json.loads(out) == [], err


def test_key_file_errors(tmp_path, capsys):
    code, out, _ = run_kvc(["store", "keygen", "-o", str(tmp_path / "a.key"), "--json"], capsys)
    assert code == 0 and len(json.loads(out)["key_id"]) == 16
    code, _, err = run_kvc(["store", "keygen", "-o", str(tmp_path / "a.key")], capsys)
    assert code == 2 and "refusing to replace" in err
    code, _, err = run_kvc(["store", "ls", "--store", str(tmp_path / "st"), "--key-file",
                            str(tmp_path / "missing.key")], capsys)
    assert code == 2 and "no such store key file" in err


@pytest.mark.model
def test_cli_tenants_see_only_their_own_entries(lm, small_cache, tmp_path, capsys):
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.plan.presets import get_plan

    plan = get_plan("lossless", small_cache)
    f = tmp_path / "c.kvc"
    f.write_bytes(encode_kvc_bytes(small_cache, plan.pipelines, preset=plan.preset))
    url = str(tmp_path / "st")
    ka, kb = str(tmp_path / "a.key"), str(tmp_path / "b.key")
    for k in (ka, kb):
        assert run_kvc(["store", "keygen", "-o", k], capsys)[0] == 0

    def run(who, *args):
        return run_kvc(list(args) + ["--store", url, "--key-file", who], capsys)

    code, out, _ = run(kb, "store", "put", str(f), "--namespace", "tenant-b", "--json")
    assert code == 0
    key_b = json.loads(out)["key"]
    code, out, _ = run(ka, "store", "put", str(f), "--json")      # same file, A's own entry
    assert code == 0
    key_a = json.loads(out)["key"]
    assert json.loads(run(ka, "store", "ls", "--json")[1]) and \
        [r["key"] for r in json.loads(run(ka, "store", "ls", "--json")[1])] == [key_a]
    assert [r["key"] for r in json.loads(run(kb, "store", "ls", "--json")[1])] == [key_b]
    assert json.loads(run(ka, "store", "ls", "--namespace", "tenant-b", "--json")[1]) == []
    # A names B's key: a miss, and A's rm removes nothing
    code, _, err = run(ka, "store", "get", key_b, "-o", str(tmp_path / "x.kvc"))
    assert code == 8 and "no entry" in err and not (tmp_path / "x.kvc").exists()
    code, _, err = run(ka, "store", "rm", key_b)
    assert code == 8 and "no entry" in err
    # A's gc and stats cover A only; B still has its entry
    code, out, _ = run(ka, "store", "gc", "--json")
    assert code == 0 and json.loads(out)["directory"]["auth_checked"] == 1
    stats = json.loads(run(ka, "store", "stats", "--json")[1])
    assert [t["entries"] for t in stats["tiers"] if t["kind"] == "directory"] == [1]
    code, _, _ = run(kb, "store", "get", key_b, "-o", str(tmp_path / "back.kvc"))
    assert code == 0 and (tmp_path / "back.kvc").read_bytes() == f.read_bytes()


def test_an_output_naming_a_directory_is_refused_even_when_the_entry_exists(tmp_path, capsys, monkeypatch):
    """Issue 35: ``-o out/`` used to write a *file* called ``out`` and exit 0."""
    from kvcodec.store import Store, StoreKey

    monkeypatch.setenv("KVC_STORE_KEY", "ab" * 32)
    url = str(tmp_path / "st")
    k = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    Store.open(url).put(k, b"payload")
    for out in (tmp_path / "newdir", tmp_path):
        code, _, err = run_kvc(["store", "get", k.to_str(), "-o", f"{out}/", "--store", url], capsys)
        assert code == 2 and "directory" in err and err.count("\n") == 1, err
    assert not (tmp_path / "newdir").exists()
    code, _, err = run_kvc(["store", "keygen", "-o", f"{tmp_path / 'kd'}/"], capsys)
    assert code == 2 and "names a directory" in err
    code, out, _ = run_kvc(["store", "get", k.to_str(), "-o", str(tmp_path / "ok.bin"), "--store", url], capsys)
    assert code == 0 and (tmp_path / "ok.bin").read_bytes() == b"payload"


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_unreachable_and_read_only_tiers_are_one_line_errors(tmp_path, capsys, monkeypatch):
    """A store of one read-only http source: ``put`` kept the entry only in the process's memory and exited 0;
    on an unreachable one ``ls`` exited 0 with an empty listing, and ``get`` printed a warning line and then
    "no entry", not saying the store could not be read."""
    import torch

    from formatutil import synthetic_cache
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan

    monkeypatch.setenv("KVC_STORE_KEY", "ab" * 32)
    c = synthetic_cache(torch.float32, T=8)
    kvc = tmp_path / "s.kvc"
    write_kvc(c, kvc, get_plan("lossless", c).pipelines)
    url = f"http://127.0.0.1:{_closed_port()}/?connect_timeout=2"

    def one_line(args):
        code, _, err = run_kvc(args, capsys)
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert code == 8 and len(lines) == 1 and lines[0].startswith("kvc: error:"), (args, err)
        return lines[0]

    assert "stored in no persistent tier" in one_line(["store", "put", str(kvc), "--store", url])
    assert "unreachable" in one_line(["store", "ls", "--store", url])
    assert "could not read http" in one_line(["store", "get", GOOD, "-o", str(tmp_path / "o.kvc"), "--store", url])
    assert not (tmp_path / "o.kvc").exists()
    # beside a directory tier, the http source is only skipped by put and rm: no error
    both = f"{tmp_path / 'st'},{url}"
    code, out, err = run_kvc(["store", "put", str(kvc), "--store", both, "--json"], capsys)
    assert code == 0 and json.loads(out)["stored_in"] == ["memory", "directory"], err


def test_get_of_a_corrupt_entry_says_so(tmp_path, capsys, monkeypatch):
    """The store quarantines a corrupt copy and treats it as a miss: the one error line says it was corrupt."""
    import torch

    from formatutil import synthetic_cache
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan

    monkeypatch.setenv("KVC_STORE_KEY", "ab" * 32)
    c = synthetic_cache(torch.float32, T=8)
    kvc = tmp_path / "s.kvc"
    write_kvc(c, kvc, get_plan("lossless", c).pipelines)
    st = tmp_path / "st"
    code, out, err = run_kvc(["store", "put", str(kvc), "--store", str(st), "--json"], capsys)
    assert code == 0, err
    key = json.loads(out)["key"]
    (obj,) = st.glob("objects/*/*/*.kve")
    b = bytearray(obj.read_bytes())
    b[len(b) // 2] ^= 1
    obj.write_bytes(bytes(b))
    code, _, err = run_kvc(["store", "get", key, "-o", str(tmp_path / "o.kvc"), "--store", str(st)], capsys)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 8 and len(lines) == 1 and "corrupt" in lines[0], err
