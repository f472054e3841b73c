"""`kvc eval` and `kvc curve` on real captures of the embedded model."""

from __future__ import annotations

import dataclasses
import json

import pytest


from cliutil import run_kvc as run_cli  # noqa: E402

pytestmark = pytest.mark.model

N_CTX, N_CONT = 128, 32
REQUIRED = ("bits_per_element", "ratio_vs_fp16", "dppl_percent", "kl_mean", "top1_agreement", "greedy_match")


@pytest.fixture(autouse=True)
def _reuse_loaded_model(lm, monkeypatch):
    """The CLI loads its model by name; hand it the session's (same name, same weights) to save the reloads."""
    import kvcodec.models.load

    real = kvcodec.models.load.load_model
    monkeypatch.setattr(kvcodec.models.load, "load_model", lambda name="smollm2", **kw: lm if name == "smollm2" and not kw else real(name, **kw))


@pytest.fixture(scope="module")
def cache(lm, gpl3_ids):
    from kvcodec.models.capture import capture

    return capture(lm, token_ids=gpl3_ids[:N_CTX])


@pytest.fixture(scope="module")
def kvc_files(cache, tmp_path_factory):
    from kvcodec.plan.baselines import get_baseline_plan
    from kvcodec.format import write_kvc
    from kvcodec.plan.presets import get_plan

    d = tmp_path_factory.mktemp("eval")
    out = {}
    plan = get_plan("lossless", cache)
    write_kvc(cache, d / "lossless.kvc", plan.pipelines, preset=plan.preset)
    out["lossless"] = d / "lossless.kvc"
    plan = get_baseline_plan("int8", cache)
    write_kvc(cache, d / "int8.kvc", plan.pipelines, chunk_tokens=plan.chunk_tokens, preset=plan.preset)
    out["int8"] = d / "int8.kvc"
    # the same cache claiming to come from another checkpoint
    other = dataclasses.replace(cache.fingerprint, weights_sha256="0" * 64)
    alien = dataclasses.replace(cache, fingerprint=other)
    write_kvc(alien, d / "alien.kvc", plan.pipelines, chunk_tokens=plan.chunk_tokens, preset=plan.preset)
    out["alien"] = d / "alien.kvc"
    return out


def eval_json(path, capsys, *extra):
    code, out, err = run_cli(["eval", str(path), "--text", "gpl3", "--continuation", str(N_CONT), "--json", *extra], capsys)
    assert code == 0, err
    return json.loads(out)


def test_eval_lossless_is_exact(kvc_files, cache, capsys):
    r = eval_json(kvc_files["lossless"], capsys)
    for k in REQUIRED:
        assert k in r and isinstance(r[k], (int, float)), k
    assert r["kl_mean"] == 0.0 and r["top1_agreement"] == 1.0 and r["greedy_match"] == 1.0
    assert r["dppl_percent"] == 0.0
    assert r["file_bytes"] == kvc_files["lossless"].stat().st_size
    assert r["bits_per_element"] == pytest.approx(r["file_bytes"] * 8 / cache.num_elements)
    assert r["ratio_vs_fp16"] == pytest.approx(16 / r["bits_per_element"])
    assert r["continuation_tokens"] == N_CONT and r["context_tokens"] == N_CTX


def test_eval_int8_is_close(kvc_files, capsys):
    r = eval_json(kvc_files["int8"], capsys, "--greedy-tokens", "4")
    assert 8.2 < r["bits_per_element"] < 9.5
    assert 0 < r["kl_mean"] < 5e-3
    assert r["top1_agreement"] >= 0.9
    assert abs(r["dppl_percent"]) < 2.0
    lo, hi = r["dppl_ci95_percent"]  # the interval of the mean holds the mean, and is not a point
    assert lo < r["dppl_percent"] < hi


def test_eval_default_continuation_is_long_but_fits_the_text(kvc_files, capsys):
    """No --continuation: up to 1024 tokens, as many as the text has after the context; the interval narrows."""
    code, out, err = run_cli(["eval", str(kvc_files["int8"]), "--text", "gpl3", "--greedy-tokens", "0", "--json"], capsys)
    assert code == 0, err
    long = json.loads(out)
    assert long["continuation_tokens"] == 1024
    short = eval_json(kvc_files["int8"], capsys, "--greedy-tokens", "0")
    width = lambda r: r["dppl_ci95_percent"][1] - r["dppl_ci95_percent"][0]  # noqa: E731
    assert width(long) < width(short)


def test_eval_human_output(kvc_files, capsys):
    code, out, _ = run_cli(["eval", str(kvc_files["int8"]), "--text", "gpl3", "--continuation", "8", "--greedy-tokens", "2"], capsys)
    assert code == 0 and "bits/element" in out and "KL" in out


def test_eval_pruned_cache(lm, cache, tmp_path, capsys):
    h2o = pytest.importorskip("kvcodec.prune.h2o")
    from kvcodec.plan.baselines import get_baseline_plan
    from kvcodec.format import write_kvc
    from kvcodec.prune.budget import parse_prune

    _, scores = h2o.attention_scores(lm, cache.token_ids)
    pruned = h2o.h2o_prune(cache, scores, parse_prune("h2o:0.5"))
    plan = get_baseline_plan("fp16", pruned)
    path = tmp_path / "h2o.kvc"
    write_kvc(pruned, path, plan.pipelines, chunk_tokens=plan.chunk_tokens, preset=plan.preset)
    r = eval_json(path, capsys, "--greedy-tokens", "4")
    assert r["pruned"] and r["stored_tokens"] == N_CTX // 2 and r["context_tokens"] == N_CTX
    # charged against the full context: about half of fp16
    assert 7.5 < r["bits_per_element"] < 9.5
    assert 0 < r["kl_mean"] < 1.0


@pytest.mark.parametrize(
    "case, match",
    [
        ("mismatch", "differs from the tokens this file encodes at token"),
        ("short", "fewer than --continuation"),
        ("model", "different model"),
        ("missing", "no such file"),
        ("greedy", "more than the model's context window"),  # --greedy-tokens 100000000 ran on without end
    ],
)
def test_eval_bad_inputs(case, match, kvc_files, tmp_path, capsys):
    path, args = kvc_files["int8"], ["--text", "gpl3", "--continuation", str(N_CONT)]
    if case == "mismatch":
        args = ["--text", "lgpl21"]
    elif case == "short":
        args = ["--text", "gpl3", "--continuation", "1000000"]
    elif case == "model":
        path = kvc_files["alien"]
    elif case == "missing":
        path = tmp_path / "nope.kvc"
    elif case == "greedy":
        args = [*args, "--greedy-tokens", "100000000"]
    code, out, err = run_cli(["eval", str(path), *args, "--json"], capsys)
    assert code != 0 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvc: error:") and match in lines[0], err


def test_eval_text_shorter_than_context(kvc_files, tmp_path, lm, cache, capsys):
    short = tmp_path / "short.txt"
    short.write_text(lm.tokenizer.decode(cache.token_ids[:40].tolist()))
    code, _, err = run_cli(["eval", str(kvc_files["int8"]), "--text", str(short), "--continuation", "4"], capsys)
    assert code != 0 and "kvc: error:" in err and len(err.strip().splitlines()) == 1


def test_curve_cli_writes_outputs_and_resumes(tmp_path, capsys):
    out_json, out_csv, out_png = tmp_path / "c.json", tmp_path / "c.csv", tmp_path / "c.png"
    args = ["curve", "--text", "gpl3", "--max-tokens", "96", "--continuation", "16", "--greedy-tokens", "2",
            "--methods", "fp16,int8,kivi4,nosuchfamily", "--json", str(out_json), "--no-progress",
            "--capture-dir", str(tmp_path / "caps")]
    code, _, err = run_cli(args, capsys)
    assert code != 0 and "unknown method 'nosuchfamily'" in err
    args[args.index("fp16,int8,kivi4,nosuchfamily")] = "fp16,int8,kivi4"
    code, out, err = run_cli([*args, "--csv", str(out_csv), "--plot", str(out_png)], capsys)
    assert code == 0, err
    res = json.loads(out_json.read_text())
    rows = res["rows"]
    assert [r["method"] for r in rows] == ["fp16", "int8", "kivi4"]
    for r in rows:
        for k in REQUIRED:
            assert isinstance(r[k], float), (r["method"], k)
    assert rows[0]["kl_mean"] < rows[1]["kl_mean"]
    assert out_csv.read_text().splitlines()[0].startswith("text,family,method,bits_per_element")
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(list((tmp_path / "caps").glob("*.h5"))) == 1
    assert "| gpl3 | int8 | int8 |" in out
    # a re-run reuses every row already measured
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    again = json.loads(out_json.read_text())["rows"]
    assert all(r.get("reused") for r in again)
    assert [r["kl_mean"] for r in again] == [r["kl_mean"] for r in rows]


def test_pareto_frontier():
    from kvcodec.eval.report import pareto

    assert pareto([(4, 0.1), (2, 0.5), (3, 0.6), (8, 0.01), (9, 0.02)]) == [(2, 0.5), (4, 0.1), (8, 0.01)]


def test_every_family_is_selected():
    from kvcodec.eval.methods import codec_presets, select_methods
    from kvcodec.plan.presets import PRESETS

    got = select_methods(["h2o", "kvcodec-kl", "kvcodec", "int8"], target_kls=[1e-3], h2o_budgets=["h2o:0.5"])
    assert not got.notes
    assert [m.key for m in got.methods] == (["h2o/h2o:0.5", "kvcodec-kl/kl<=0.001"] + [f"kvcodec/{n}" for n in codec_presets()]
                                            + ["int8/int8"])
    assert codec_presets()[:2] == ["lossless", "fp16"] and {n for n, p in PRESETS.items() if p.lossy} <= set(codec_presets())
