"""``kvc encode --prune`` / lossy presets with the model / ``--target-kl``, and ``kvc info``'s kept fraction."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcodec.core.kvcache import save_capture

from cliutil import run_kvc as run_main  # noqa: E402
from formatutil import synthetic_cache  # noqa: E402


def one_line_error(code: int, err: str) -> str:
    assert code != 0
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("kvc: error:") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture()
def synth_file(tmp_path) -> Path:
    p = tmp_path / "synth.h5"
    save_capture(synthetic_cache(torch.float32, T=16), p)
    return p


@pytest.mark.parametrize("spec", ["h2o:0", "h2o:1.5", "lingua:-1", "foo:0.5", "h2o:heavy=0.7,recent=0.7", "h2o", "",
                                  "h2o:0.5,0.2", "h2o:heavy=0.1,bogus=1"])
def test_bad_prune_spec_is_one_line(spec, synth_file, tmp_path, capsys):
    out = tmp_path / "x.kvc"
    # refused before the file is even looked at, and with an existing file alike
    for src in (tmp_path / "missing.h5", synth_file):
        code, _, err = run_main(["encode", str(src), "-o", str(out), "--prune", spec], capsys)
        line = one_line_error(code, err)
        assert code == 2 and "prune spec" in line
    assert not out.exists()


def test_bad_target_options(synth_file, tmp_path, capsys):
    out = str(tmp_path / "x.kvc")
    cases = [
        (["--target-kl", "0.01", "--target-dppl", "1"], "only one of"),
        (["--text", "gpl3"], "not both"),
        (["--target-kl", "0.01", "--preset", "lossless"], "cannot be used with --preset lossless"),
        (["--check"], "not lossy"),
        (["--preset", "no-such-preset", "--prune", "h2o:0.5"], "unknown preset 'no-such-preset'"),
    ]
    for extra, want in cases:
        code, _, err = run_main(["encode", str(synth_file), "-o", out] + extra, capsys)
        assert code == 2 and want in one_line_error(code, err), (extra, err)
    code, _, err = run_main(["encode", str(synth_file), "-o", out, "--target-kl", "-1"], capsys)
    assert code == 2 and "must be positive" in err
    assert not Path(out).exists()


def test_info_kept_fraction_prefers_prune_record(tmp_path, capsys):
    """A lingua file stores the pruned text's ids (no positions): only meta["prune"] knows the original context."""
    c = synthetic_cache(torch.float32, T=8)
    c.meta["prune"] = {"method": "lingua", "spec": "lingua:keep=0.25", "context_tokens": 32, "kept_tokens": 8,
                       "kept_fraction": 0.25, "positions": "renumbered"}
    save_capture(c, tmp_path / "l.h5")
    code, o, e = run_main(["encode", str(tmp_path / "l.h5"), "-o", str(tmp_path / "l.kvc"), "--json"], capsys)
    assert code == 0, e
    enc = json.loads(o)
    assert enc["kv_elements"] == 4 * c.num_elements  # charged against the 32-token original context
    code, o, e = run_main(["info", str(tmp_path / "l.kvc"), "--json"], capsys)
    d = json.loads(o)
    assert d["kept_fraction"] == 0.25 and d["original_context_tokens"] == 32 and d["positions"] == "renumbered"
    assert d["bits_per_context_element"] == pytest.approx(enc["bits_per_element"])
    code, o, e = run_main(["info", str(tmp_path / "l.kvc")], capsys)
    assert "8 context, 8 stored (kept 25.0% of 32, renumbered positions)" in o
    # an unpruned file still reports no kept fraction
    save_capture(synthetic_cache(torch.float32, T=8), tmp_path / "u.h5")
    assert run_main(["encode", str(tmp_path / "u.h5"), "-o", str(tmp_path / "u.kvc")], capsys)[0] == 0
    d = json.loads(run_main(["info", str(tmp_path / "u.kvc"), "--json"], capsys)[1])
    assert d["kept_fraction"] is None and d["bits_per_context_element"] is None


@pytest.fixture()
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture()
def model_patched(lm, monkeypatch):
    import kvcodec.models.load

    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda *a, **k: lm)
    return lm


@pytest.mark.model
def test_encode_prune_h2o_info_eval(model_patched, small_cache, tmp_path, capsys, one_thread):
    cap = tmp_path / "cap.h5"
    save_capture(small_cache, cap)
    out = tmp_path / "p.kvc"
    code, o, e = run_main(["encode", str(cap), "-o", str(out), "--prune", "h2o:0.5", "--json"], capsys)
    assert code == 0, e
    enc = json.loads(o)
    assert enc["kv_elements"] == small_cache.num_elements  # the unpruned cache's elements
    assert enc["bits_per_element"] == pytest.approx(out.stat().st_size * 8 / small_cache.num_elements)
    assert enc["prune"]["kept_fraction"] == 0.5 and enc["prune"]["kept_tokens"] == 32

    code, o, e = run_main(["info", str(out)], capsys)
    assert code == 0, e
    assert "64 context, 32 stored (kept 50.0%" in o
    d = json.loads(run_main(["info", str(out), "--json"], capsys)[1])
    assert d["kept_fraction"] == 0.5 and d["meta"]["prune"]["method"] == "h2o"
    assert d["bits_per_context_element"] == pytest.approx(enc["bits_per_element"])

    code, o, e = run_main(["eval", str(out), "--text", "gpl3", "--continuation", "16", "--greedy-tokens", "2", "--json"], capsys)
    assert code == 0, e
    r = json.loads(o)
    assert r["stored_tokens"] == 32 and r["context_tokens"] == 64 and r["pruned"]
    assert r["bits_per_element"] == pytest.approx(enc["bits_per_element"])
    assert np.isfinite(r["kl_mean"]) and r["kl_mean"] > 0

    code, _, err = run_main(["encode", str(cap), "-o", str(tmp_path / "q.kvc"), "--prune", "h2o:100"], capsys)
    assert code == 2 and "only 64" in one_line_error(code, err)


@pytest.mark.model
def test_lossy_preset_gets_the_model(model_patched, small_cache, synth_file, tmp_path, capsys, one_thread):
    """balanced weights its steps by per-token importance, which needs the model: the encoder passes it."""
    cap = tmp_path / "cap.h5"
    save_capture(small_cache, cap)
    out = tmp_path / "b.kvc"
    code, o, e = run_main(["encode", str(cap), "-o", str(out), "--preset", "balanced"], capsys)
    assert code == 0, e
    d = json.loads(run_main(["info", str(out), "--json"], capsys)[1])
    assert d["codec"] == "balanced" and all("tokenscale" in p["pipeline"] for p in d["pipelines"])
    # a capture of another model is refused on one line
    code, _, err = run_main(["encode", str(synth_file), "-o", str(tmp_path / "s.kvc"), "--preset", "balanced"], capsys)
    assert code != 0 and "different model" in one_line_error(code, err)


@pytest.mark.model
def test_encode_target_kl(model_patched, real_cache, tmp_path, capsys, one_thread):
    """--target-kl replaces balanced's promise: rate control aims its predicted KL under it (no --text needed);
    --check confirms on the tail; a target outside the preset's range is one line and writes nothing."""
    cap = tmp_path / "cap.h5"
    save_capture(real_cache(256), cap)
    out = tmp_path / "t.kvc"
    code, o, e = run_main(["encode", str(cap), "-o", str(out), "--target-kl", "0.004", "--json"], capsys)
    assert code == 0, e
    enc = json.loads(o)
    assert enc["preset"] == "target-kl-0.004" and enc["target"]["preset"] == "balanced"
    assert enc["rate"]["aim_kl"] == pytest.approx(0.6 * 0.004) and enc["rate"]["predicted_kl"] <= enc["rate"]["aim_kl"] * (1 + 1e-9)
    loose = tmp_path / "l.kvc"
    code, o, e = run_main(["encode", str(cap), "-o", str(loose), "--target-kl", "0.03", "--json"], capsys)
    assert code == 0, e
    assert json.loads(o)["rate"]["step0"] > enc["rate"]["step0"] and loose.stat().st_size < out.stat().st_size
    code, o, e = run_main(["encode", str(cap), "-o", str(tmp_path / "c.kvc"), "--preset", "balanced", "--check", "--json"], capsys)
    assert code == 0, e
    chk = json.loads(o)["check"]
    assert chk["checked"] and chk["tries"][0]["step0"] == pytest.approx(json.loads(o)["rate"]["step0"])
    code, _, err = run_main(["encode", str(cap), "-o", str(tmp_path / "u.kvc"), "--target-kl", "1e-6"], capsys)
    assert "outside preset balanced's range" in one_line_error(code, err) and not (tmp_path / "u.kvc").exists()
    code, _, err = run_main(["encode", str(cap), "-o", str(tmp_path / "v.kvc"), "--preset", "lossless", "--check"], capsys)
    assert "not lossy" in one_line_error(code, err)


@pytest.mark.model
def test_encode_check_json_reports_the_step_written(model_patched, real_cache, tmp_path, capsys, one_thread, monkeypatch):
    """--check --json reports the step the file was written at, with the rate control's first choice and the check's
    tries beside it (issue 57: it printed the first try's step, 0.547 where 0.468 was written). The rate model is made
    30x too optimistic, so the first probe misses and the check lowers the step. "Written" is checked on the file:
    its quantizer steps are the rate control's per-layer allocation of the reported step0. 128 tokens (a 32-token
    probe) keep the check's forward passes to seconds; 256 tokens and a second encode took 95 s on the loaded box."""
    from kvcodec.calibration.ratemodel import RateModel
    from kvcodec.calibration.store import require_calibration
    from kvcodec.plan.pipelines import layer_steps
    from kvcodec.api import resolve_rate_model

    real = RateModel.factor
    monkeypatch.setattr(RateModel, "factor", lambda self, preset, tokens: real(self, preset, tokens) / 30)
    cap = tmp_path / "cap.h5"
    save_capture(real_cache(128), cap)
    out = tmp_path / "c.kvc"
    code, o, e = run_main(["encode", str(cap), "-o", str(out), "--preset", "balanced", "--check", "--json"], capsys)
    assert code == 0, e
    enc = json.loads(o)
    tries, rate = enc["check"]["tries"], enc["rate"]
    assert len(tries) >= 2 and rate["check_tries"] == len(tries)
    assert rate["predicted_step0"] == pytest.approx(tries[0]["step0"])
    assert all(t["kl_mean"] > 0 and 0 < t["top1"] <= 1 for t in tries)  # each try's measured quality
    # the check's last step, or the one before it where the format's quality floor stopped the search
    assert rate["step0"] == pytest.approx(tries[-2 if tries[-1].get("floor") else -1]["step0"])
    assert rate["step0"] < rate["predicted_step0"]
    cal = require_calibration(model_patched.fingerprint)
    want = np.float32(layer_steps(resolve_rate_model(model_patched, cal).allocated(cal), rate["step0"]))
    info = json.loads(run_main(["info", str(out), "--json"], capsys)[1])
    got = {st["config"]["step"] for p in info["pipelines"] for st in p["stages"] if st["name"] == "quantize"}
    assert sorted(got) == pytest.approx(sorted(set(want.ravel().tolist())), rel=1e-6)


@pytest.mark.parametrize("args,msg", [
    (["--config", '{"preset": "balanced", "bogus": 1}'], "unknown keys"),
    (["--config", '{"step0": 0.2}'], '"preset" name'),
    (["--config", "[1, 2]"], '"preset" name'),
    (["--config", "{not json"], "neither a JSON object"),
    (["--config", '{"preset": "balanced", "step0": -1}'], "step0 must be a positive number"),
    # under- and overflowing steps were refused only after the calibration loaded (helper sweep, 2026-12-07)
    (["--config", '{"preset": "balanced", "step0": 1e-300}'], "step0 must be a positive number in [1e-12, 1000]"),
    (["--config", '{"preset": "balanced", "step0": 1e308}'], "step0 must be a positive number in [1e-12, 1000]"),
    (["--config", '{"preset": "balanced", "sink": true}'], "sink must be an integer"),
    (["--config", '{"preset": "raw", "step0": 0.3}'], "preset raw does not take ['step0']"),
    (["--config", '{"preset": "balanced", "level": 3}'], "preset balanced does not take ['level']"),
    (["--config", '{"preset": "balanced"}', "--preset", "small"], "not both"),
    (["--config", '{"preset": "balanced", "step0": 0.3}', "--target-kl", "0.01"], "choose step0 themselves"),
    (["--max-tokens", "8"], "IN is already a capture"),
])
def test_bad_config_and_capture_options(args, msg, synth_file, tmp_path, capsys):
    out = tmp_path / "x.kvc"
    code, _, err = run_main(["encode", str(synth_file), "-o", str(out), *args], capsys)
    assert code == 2 and msg in one_line_error(code, err)
    assert not out.exists()


def test_encode_without_capture_needs_text(tmp_path, capsys):
    out = tmp_path / "x.kvc"
    code, _, err = run_main(["encode", "-o", str(out)], capsys)
    assert code == 2 and "--text" in one_line_error(code, err)
    code, _, err = run_main(["encode", "-o", str(out), "--text", "gpl3", "--max-tokens", "0"], capsys)
    assert code == 2 and "at least 1" in one_line_error(code, err)


def test_config_from_file_sets_zstd_level(synth_file, tmp_path, capsys):
    """A config file overrides the plan: zstd level 19 on the lossless preset, recorded in the header."""
    from kvcodec.format import KvcReader

    cfg = tmp_path / "codec.json"
    cfg.write_text(json.dumps({"preset": "lossless", "level": 19}))
    sizes = {}
    for name, extra in (("default", []), ("config", ["--config", str(cfg)])):
        out = tmp_path / f"{name}.kvc"
        code, o, _ = run_main(["encode", str(synth_file), "-o", str(out), "--json", *extra], capsys)
        assert code == 0
        sizes[name] = json.loads(o)
    assert sizes["config"]["preset"] == "lossless+config" and sizes["default"]["preset"] == "lossless"
    with KvcReader(str(tmp_path / "config.kvc")) as r:
        assert r.header.meta["config"] == {"preset": "lossless", "level": 19}


@pytest.mark.model
def test_encode_from_text_equals_capture_then_encode(tmp_path, capsys):
    """`kvc encode --text T --max-tokens N` == `kvc capture` then `kvc encode IN`, byte for byte,
    with a lossy --config; the config's step0 changes the size."""
    cfg = '{"preset": "small", "step0": 1.6}'
    a, b, h5 = tmp_path / "a.kvc", tmp_path / "b.kvc", tmp_path / "c.h5"
    code, _, _ = run_main(["encode", "--text", "gpl3", "--max-tokens", "96", "--config", cfg, "-o", str(a)], capsys)
    assert code == 0
    code, _, _ = run_main(["capture", "--text", "gpl3", "--max-tokens", "96", "-o", str(h5)], capsys)
    assert code == 0
    code, _, _ = run_main(["encode", str(h5), "--config", cfg, "-o", str(b)], capsys)
    assert code == 0
    assert a.read_bytes() == b.read_bytes()
    c = tmp_path / "small.kvc"
    code, _, _ = run_main(["encode", str(h5), "--preset", "small", "-o", str(c)], capsys)
    assert code == 0 and c.stat().st_size > a.stat().st_size
