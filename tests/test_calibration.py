"""Calibration: the shipped file of the embedded model, and the Fisher sensitivity estimate (issue 21)."""

from __future__ import annotations

import hashlib
import shutil

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcFormatError
from kvcodec.quant import calibrate as C

from cliutil import run_kvc  # noqa: E402


def test_shipped_calibration_matches_its_pin():
    assert C.SHIPPED_SHA256, "the embedded model's calibration must ship with the package"
    for name, sha in C.SHIPPED_SHA256.items():
        path = C.SHIPPED_DIR / name
        assert path.is_file(), f"{path} is pinned but missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        cal = C.load_calibration_file(path)
        assert cal.meta["fingerprint_id"] == path.stem


@pytest.mark.model
def test_embedded_model_never_calibrates(lm, tmp_path, monkeypatch):
    """A fresh home (empty cache) still has the embedded model's calibration: the shipped file, not a build."""
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("build_calibration ran for the embedded model")

    monkeypatch.setattr(C, "build_calibration", refuse)
    cal = C.get_calibration(lm)
    assert cal.path is not None and cal.path.parent == C.SHIPPED_DIR
    assert cal.path.name == f"{lm.fingerprint.id}.safetensors"
    # a .kvc that references it externally decodes in that fresh home too
    name, arr = "pca.mean", cal.attachments["pca.mean"]
    got = C.resolve_attachment(name, C.array_sha256(arr))
    assert got is not None and np.array_equal(got, arr)


def test_tampered_shipped_calibration_is_refused(tmp_path, monkeypatch):
    (name, sha), = list(C.SHIPPED_SHA256.items())[:1]
    d = tmp_path / "ship"
    d.mkdir()
    data = bytearray((C.SHIPPED_DIR / name).read_bytes())
    data[-1] ^= 1
    (d / name).write_bytes(bytes(data))
    monkeypatch.setattr(C, "SHIPPED_DIR", d)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KvcFormatError, match="pinned sha256"):
        C.load_calibration(name.removesuffix(".safetensors"))


@pytest.mark.model
def test_fisher_sensitivity_predicts_measured_noise_kl(lm, real_cache, gpl3_ids):
    """The Hutchinson/Fisher estimate agrees with KL actually measured under small Gaussian noise.

    For a few (layer, kind) blocks: add noise of per-element power s^2 to tokens >= sink,
    measure KL(exact || noisy) on the continuation and compare KL / s^2 with the estimate.
    Both are random; they must agree within a factor of 2.5 (they differ by far more if
    the estimator's scale or block assignment is wrong, e.g. K/V swapped or 1/2 missing).
    """
    from kvcodec.evaluate import compare_logits, continue_logits
    from kvcodec.kvcache import KVCache

    n, m, sink = 256, 32, C.DEFAULT_SINK
    cache = real_cache(n)
    cont = gpl3_ids[n : n + m]
    est = C.measure_sensitivity(lm, cache, cont, sink=sink, samples=16, seed=1)
    assert est.shape == (cache.num_layers, 2) and np.all(est > 0)
    exact = continue_logits(lm, cache, cont)
    rng = np.random.default_rng(0)
    for layer, ki in [(0, 1), (5, 0), (15, 1), (29, 0)]:
        src = cache.keys if ki == 0 else cache.values
        x = src[layer].float().numpy()
        sigma = 0.02 * float(np.sqrt((x[:, sink:] ** 2).mean()))
        kls = []
        for _ in range(3):
            noisy = x.copy()
            noisy[:, sink:] += (rng.standard_normal(noisy[:, sink:].shape) * sigma).astype(np.float32)
            keys, values = list(cache.keys), list(cache.values)
            (keys if ki == 0 else values)[layer] = torch.from_numpy(noisy)
            pert = KVCache(keys, values, cache.token_ids, cache.fingerprint, cache.positions)
            kls.append(compare_logits(exact, continue_logits(lm, pert, cont), cont)["kl_mean"])
        measured = float(np.mean(kls)) / sigma**2
        assert 1 / 2.5 < est[layer, ki] / measured < 2.5, (layer, ki, est[layer, ki], measured)


@pytest.mark.model
def test_sensitivity_runs_under_inference_mode(lm, real_cache, gpl3_ids):
    """ask -> deposit -> plan may build a calibration inside torch.inference_mode: the backward passes still work."""
    cache = real_cache(64)
    with torch.inference_mode():
        est = C.measure_sensitivity(lm, cache, gpl3_ids[64:72], samples=1)
    assert np.all(np.isfinite(est)) and np.all(est > 0)


def test_shipped_dir_copy_is_found_by_fingerprint(tmp_path, monkeypatch):
    """The lookup is by file name = fingerprint id (no scan of every calibration on the machine)."""
    (name, sha), = list(C.SHIPPED_SHA256.items())[:1]
    d = tmp_path / "ship"
    d.mkdir()
    shutil.copy(C.SHIPPED_DIR / name, d / name)
    monkeypatch.setattr(C, "SHIPPED_DIR", d)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    assert C.shipped_calibration_path(name.removesuffix(".safetensors")) == d / name
    assert C.shipped_calibration_path("0" * 32) is None
    assert C.load_calibration("0" * 32) is None


@pytest.mark.model
def test_kvc_calibrate_reports_the_shipped_calibration(lm, tmp_path, monkeypatch, capsys):
    """`kvc calibrate` on the embedded model in a fresh home finds the shipped file and builds nothing."""
    import json

    from kvcodec.model import cache_root

    (tmp_path / "models").symlink_to(cache_root() / "models")  # the converted model, but no calibration
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    monkeypatch.setattr(C, "build_calibration", lambda *a, **k: pytest.fail("calibrated the embedded model"))
    code, out, err = run_kvc(["calibrate", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["built"] is False and rep["fingerprint"] == lm.fingerprint.id
    assert rep["path"].startswith(str(C.SHIPPED_DIR))
