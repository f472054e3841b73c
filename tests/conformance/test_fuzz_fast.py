"""The soak fuzz of kvcodec/testing/fuzz.py, small: 300 structure-aware mutations (checksums recomputed) with a
fixed seed, over seed files of every preset plus pruned, chunked, embedded-calibration and id-hash files of a
real cache, in a worker process. Only KvcError may come out; no crash, no run over 10 s, peak RSS <= 512 MB."""

from __future__ import annotations


import pytest

from kvcodec.testing import fuzz as bench_fuzz  # noqa: E402


@pytest.mark.model
def test_fast_soak_fuzz(lm, tmp_path):
    bench_fuzz.make_seeds(tmp_path, tokens=16, lm=lm)
    names = {p.stem for p in tmp_path.glob("*.kvc")}
    assert {"lossless", "fp16", "near-lossless", "balanced", "small", "balanced-pruned", "balanced-chunked",
            "balanced-embedded", "lossless-chunked"} <= names
    res = bench_fuzz.run(tmp_path, n=300, workers=1, seed=20261122, progress=False)
    assert res["mutations"] == 300
    assert res["non_kvc_exceptions"] == 0, res["non_kvc_examples"]
    assert res["crashes"] == 0, res["crash_examples"]
    assert res["over_10s"] == 0, res["slow_examples"]
    assert res["peak_rss_mb"] <= 512, res
    assert set(res["seed_files"]) == names  # every seed file was mutated
    ops = res["by_operator"]
    assert {"header.value", "index", "record.side.values", "record.payload", "blob"} <= set(ops)
    assert res["outcomes"].get("ok", 0) > 10 and sum(v for k, v in res["outcomes"].items() if k.startswith("kvc:")) > 100
