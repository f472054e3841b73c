"""``kvc prune``: errors are one clear line; a real H2O prune writes per-head positions."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from kvcodec.core.kvcache import load_h5, save_h5

from cliutil import run_kvc as run  # noqa: E402


@pytest.mark.parametrize("spec", ["h2o:0", "h2o:1.5", "lingua:-1", "foo:0.5", "h2o:heavy=0.7,recent=0.7"])
def test_bad_spec_is_input_error(spec, capsys, tmp_path):
    code, _, err = run(["prune", str(tmp_path / "missing.h5"), "--prune", spec, "-o", str(tmp_path / "o.h5")], capsys)
    assert code == 2 and err.startswith("kvc: error: prune spec") and "Traceback" not in err


@pytest.mark.model
def test_prune_command_h2o(lm, small_cache, capsys, tmp_path, monkeypatch):
    import kvcodec.models.load

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        save_h5(small_cache, tmp_path / "in.h5")
        code, out, _ = run(["prune", str(tmp_path / "in.h5"), "--prune", "h2o:0.5", "-o", str(tmp_path / "o.h5"), "--json"], capsys)
        assert code == 0
        info = json.loads(out)
        assert info["kept_tokens"] == 32 and info["kept_fraction"] == 0.5 and info["per_head"]
        back = load_h5(tmp_path / "o.h5")
        assert back.positions.shape == (30, 3, 32) and back.next_position == 64
        assert np.array_equal(back.token_ids, small_cache.token_ids)
        code, _, err = run(["prune", str(tmp_path / "o.h5"), "--prune", "h2o:0.5", "-o", str(tmp_path / "p.h5")], capsys)
        assert code == 2 and "already pruned" in err
        code, _, err = run(["prune", str(tmp_path / "in.h5"), "--prune", "h2o:100", "-o", str(tmp_path / "p.h5")], capsys)
        assert code == 2 and "only 64" in err
    finally:
        torch.set_num_threads(old)


@pytest.mark.model
@pytest.mark.parametrize("method", ["lingua:0.5", "h2o:0.5"])
def test_eval_of_pruned_files(method, capsys, tmp_path):
    """`kvc eval` on pruned files: compared with the exact cache of the whole original context,
    rate charged against that context, and a text that is not the original is refused."""
    text = tmp_path / "t.txt"
    from kvcodec.texts import load_text

    text.write_text(load_text("gpl3")[:6000], encoding="utf-8")
    kvc = tmp_path / "p.kvc"
    code, out, _ = run(["encode", "--text", str(text), "--max-tokens", "96", "--prune", method, "--preset", "fp16", "-o", str(kvc),
                        "--json"], capsys)
    assert code == 0
    enc = json.loads(out)
    code, out, err = run(["eval", str(kvc), "--text", str(text), "--continuation", "32", "--json"], capsys)
    assert code == 0, err
    ev = json.loads(out)
    assert ev["pruned"] and ev["context_tokens"] == 96 and ev["stored_tokens"] == 48
    assert ev["bits_per_element"] == pytest.approx(enc["bits_per_element"])  # both charged against the 96-token context
    assert 0 < ev["kl_mean"] < 5 and 0 <= ev["top1_agreement"] <= 1
    other = tmp_path / "o.txt"
    other.write_text(load_text("lgpl21")[:6000], encoding="utf-8")
    code, _, err = run(["eval", str(kvc), "--text", str(other), "--continuation", "32"], capsys)
    assert code == 2 and "kvc: error:" in err and "Traceback" not in err
