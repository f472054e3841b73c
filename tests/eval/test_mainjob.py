"""The README's main job (``kvc demo``) end to end on the real model, at a size CI affords."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.model


def test_main_job_small(tmp_path, lm):
    from kvcodec.format import KvcReader
    from kvcodec.eval.demo import render, run_main_job

    rep = run_main_job(text="apache2", max_tokens=96, continuation=16, out_dir=tmp_path, repeats=1,
                       methods=["kvcodec:balanced", "int8"])
    with KvcReader(rep["kvc_file"]) as r:
        assert r.verify() == [] and r.header.num_context_tokens == rep["tokens"] == 96
    assert rep["verify"] == "ok"
    # the demo's quality and the curve's kvcodec row are one measurement of one plan: same bytes, same numbers
    rows = {(r["family"], r["method"]): r for r in json.loads((tmp_path / "curve.json").read_text())["rows"]}
    main = rows[("kvcodec", "balanced")]
    assert main["file_bytes"] == rep["kvc_bytes"] and "note" not in rep["quality"]
    assert main["kl_mean"] == pytest.approx(rep["quality"]["kl_mean"], rel=1e-9)
    assert rows[("int8", "int8")]["kl_mean"] >= 0 and rows[("int8", "int8")]["bits_per_element"] > 8
    assert 0 <= rep["quality"]["kl_mean"] < 0.05
    t = rep["ttft"]
    assert t["prefill_s"] > 0 and t["kvc_s"] > 0 and t["cold_kvc_s"] > 0 and t["cold_prefill_s"] > 0
    text = render(rep)
    assert "TTFT warm" in text and "TTFT cold" in text and "kvcodec:balanced" in text
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert set(rep["phases_s"]) == {"model_load", "capture", "encode", "evaluate", "ttft", "curve"}
    assert all(v >= 0 for v in rep["phases_s"].values()) and "time " in text
    # a peer the machine lacks is a skipped row with its reason, not a crash of the demo's report
    skipped = {"family": "cachegen", "method": "cachegen-ctx", "bits_per_element": None, "kl_mean": None,
               "error": "codec 'bl_cachegen' needs constriction==0.5.0"}
    more = dict(rep, curve=dict(rep["curve"], rows=rep["curve"]["rows"] + [skipped]))
    assert "cachegen:cachegen-ctx" in render(more) and "skipped: codec 'bl_cachegen' needs" in render(more)


def test_demo_cli_default_is_the_library_default():
    from kvcodec.cli.demo_cmd import demo_command
    from kvcodec.eval.demo import DEMO_TOKENS

    assert next(p.default for p in demo_command.params if p.name == "max_tokens") == DEMO_TOKENS
