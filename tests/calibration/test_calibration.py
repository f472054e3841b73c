"""Calibration: the shipped file of the embedded model, and the Fisher sensitivity estimate (issue 21)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from kvcodec.errors import KvcFormatError
from kvcodec.calibration import build as C_build
from kvcodec.calibration import record as C_record
from kvcodec.calibration import store as C_store
from cliutil import run_kvc  # noqa: E402


def test_shipped_calibration_matches_its_pin():
    assert C_store.SHIPPED_SHA256, "the embedded model's calibration must ship with the package"
    for name, sha in C_store.SHIPPED_SHA256.items():
        path = C_store.SHIPPED_DIR / name
        assert path.is_file(), f"{path} is pinned but missing"
        assert hashlib.sha256(path.read_bytes()).hexdigest() == sha
        cal = C_store.load_calibration_file(path)
        assert cal.meta["fingerprint_id"] == path.name.split(".")[0]
        assert cal.meta["version"] == C_record.CALIB_VERSION and np.array_equal(C_record.snap_basis(cal.basis), cal.basis)
        if path.name.count(".") > 1:  # a superseded file is named by the first 8 hex of its own sha256
            assert path.name.split(".")[1] == sha[:8]


@pytest.mark.model
def test_a_file_encoded_with_a_superseded_shipped_calibration_still_decodes(real_cache, tmp_path, monkeypatch):
    """After the shipped calibration is replaced, a store's entries encoded against the old one decode from the
    package alone (the pinned superseded file), and new encodes use the current one."""
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.core.roundtrip import roundtrip
    from kvcodec.plan.pipelines import transform_plan

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))  # no user calibrations, no attachment index
    cache = real_cache(64)
    old = [n for n in C_store.SHIPPED_SHA256 if n.startswith(cache.fingerprint.id + ".") and n.count(".") > 1]
    assert old, "the calibration shipped before the current one is kept"
    cal_old = C_store.load_calibration_file(C_store.SHIPPED_DIR / old[0], cache.fingerprint.id)
    cal_now = C_store.require_calibration(cache.fingerprint)
    assert cal_now.path is not None and cal_now.path.name == f"{cache.fingerprint.id}.safetensors"
    assert cal_old.meta["sha256.pca.basis"] != cal_now.meta["sha256.pca.basis"]
    plan = transform_plan(cache, 0.05, cal=cal_old)  # external: the file holds only the basis's sha256
    data = encode_kvc_bytes(cache, plan)
    expected, _ = roundtrip(cache, plan)
    got = KvcReader(data).read_cache()
    for a, b in zip(got.keys + got.values, expected.keys + expected.values):
        assert torch.equal(a, b)


@pytest.mark.model
def test_a_file_is_charged_the_calibration_file_a_decoder_needs(real_cache, tmp_path, monkeypatch):
    """Issue 38: what a file costs besides its own bytes is the calibration file a decoder must be sent (the
    shipped v3 file: under 55 % of the float16 basis + mean arrays it holds), counted once however many
    attachments reference it; a calibration only handed to the encoder in memory is charged its arrays."""
    import dataclasses

    from kvcodec.plan.pipelines import external_bytes, transform_plan

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    cache = real_cache(64)
    cal = C_store.require_calibration(cache.fingerprint)
    plan = transform_plan(cache, 0.33, cal=cal)
    assert len(plan.attachments) == 2
    shipped = C_store.SHIPPED_DIR / f"{cache.fingerprint.id}.safetensors"
    assert external_bytes(plan) == shipped.stat().st_size
    arrays = cal.basis.nbytes + cal.mean.nbytes
    assert external_bytes(plan) < 0.55 * arrays
    loose = dataclasses.replace(cal, basis=C_record.snap_basis(cal.basis.astype(np.float32) * 2), path=None)
    assert external_bytes(transform_plan(cache, 0.33, cal=loose)) == cal.basis.nbytes + shipped.stat().st_size  # its mean is the shipped one's
    loose = dataclasses.replace(loose, mean=cal.mean + 1)
    assert external_bytes(transform_plan(cache, 0.33, cal=loose)) == arrays
    assert external_bytes(transform_plan(cache, 0.33, cal=cal, calibration="embedded")) == 0


@pytest.mark.model
def test_embedded_model_never_calibrates(lm, tmp_path, monkeypatch):
    """A fresh home (empty cache) still has the embedded model's calibration: the shipped file, not a build."""
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))

    def refuse(*a, **k):
        raise AssertionError("build_calibration ran for the embedded model")

    monkeypatch.setattr(C_build, "build_calibration", refuse)
    cal = C_build.ensure_calibration(lm)
    assert cal.path is not None and cal.path.parent == C_store.SHIPPED_DIR
    assert cal.path.name == f"{lm.fingerprint.id}.safetensors"
    # a .kvc that references it externally decodes in that fresh home too
    name, arr = "pca.mean", cal.attachments["pca.mean"]
    got = C_store.resolve_attachment(name, C_store.array_sha256(arr))
    assert got is not None and np.array_equal(got, arr)


def test_tampered_shipped_calibration_is_refused(tmp_path, monkeypatch):
    (name, sha), = list(C_store.SHIPPED_SHA256.items())[:1]
    d = tmp_path / "ship"
    d.mkdir()
    data = bytearray((C_store.SHIPPED_DIR / name).read_bytes())
    data[-1] ^= 1
    (d / name).write_bytes(bytes(data))
    monkeypatch.setattr(C_store, "SHIPPED_DIR", d)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    with pytest.raises(KvcFormatError, match="pinned sha256"):
        C_store.load_calibration(name.removesuffix(".safetensors"))


@pytest.mark.model
def test_fisher_sensitivity_predicts_measured_noise_kl(lm, real_cache, gpl3_ids):
    """The Hutchinson/Fisher estimate agrees with KL actually measured under small Gaussian noise.

    For a few (layer, kind) blocks: add noise of per-element power s^2 to tokens >= sink,
    measure KL(exact || noisy) on the continuation and compare KL / s^2 with the estimate.
    Both are random; they must agree within a factor of 2.5 (they differ by far more if
    the estimator's scale or block assignment is wrong, e.g. K/V swapped or 1/2 missing).
    """
    from kvcodec.models.quality import compare_logits, continue_logits
    from kvcodec.core.kvcache import KVCache

    n, m, sink = 256, 32, C_record.DEFAULT_SINK
    cache = real_cache(n)
    cont = gpl3_ids[n : n + m]
    est = C_build.measure_sensitivity(lm, cache, cont, sink=sink, samples=16, seed=1)
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
        est = C_build.measure_sensitivity(lm, cache, gpl3_ids[64:72], samples=1)
    assert np.all(np.isfinite(est)) and np.all(est > 0)


def test_shipped_dir_copy_is_found_by_fingerprint(tmp_path, monkeypatch):
    """The lookup is by file name = fingerprint id (no scan of every calibration on the machine)."""
    (name, sha), = list(C_store.SHIPPED_SHA256.items())[:1]
    d = tmp_path / "ship"
    d.mkdir()
    shutil.copy(C_store.SHIPPED_DIR / name, d / name)
    monkeypatch.setattr(C_store, "SHIPPED_DIR", d)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    assert C_store.shipped_calibration_path(name.removesuffix(".safetensors")) == d / name
    assert C_store.shipped_calibration_path("0" * 32) is None
    assert C_store.load_calibration("0" * 32) is None


@pytest.mark.model
def test_kvc_calibrate_reports_the_shipped_calibration(lm, tmp_path, monkeypatch, capsys):
    """`kvc calibrate` on the embedded model in a fresh home finds the shipped file and builds nothing."""
    import json

    from kvcodec.models.load import cache_root

    (tmp_path / "models").symlink_to(cache_root() / "models")  # the converted model, but no calibration
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    monkeypatch.setattr(C_build, "build_calibration", lambda *a, **k: pytest.fail("calibrated the embedded model"))
    code, out, err = run_kvc(["calibrate", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert rep["built"] is False and rep["fingerprint"] == lm.fingerprint.id
    assert rep["path"].startswith(str(C_store.SHIPPED_DIR))
    assert rep["version"] == C_record.CALIB_VERSION and rep["bytes"] == Path(rep["path"]).stat().st_size
    assert rep["rate_model_fitted"] is False  # the embedded model ships its rate model too: no minutes of fitting
    assert set(rep["rate_model"]["alpha"]) == {"near-lossless", "faithful", "balanced", "small"}


def test_kvc_calibrate_thorough_replaces_a_quick_rate_model_and_says_which(lm, tmp_path, monkeypatch, capsys):
    """Onboarding (issue 54): a plain `kvc calibrate` keeps the model's rate model; `--thorough` refits it with the
    thorough recipe when the one it has is quick (and the report names the recipe); a thorough one is kept."""
    import json
    from dataclasses import replace

    from kvcodec.calibration import ratemodel
    from kvcodec.onboard import ratefit

    shipped = ratefit.find_rate_model(C_store.load_calibration(lm.fingerprint.id), _lossy(), _answers())
    path = tmp_path / "rm.json"
    ratemodel.save_rate_model(replace(shipped, recipe="quick"), path)
    monkeypatch.setattr(ratemodel, "rate_model_path", lambda c: path)
    monkeypatch.setattr(ratefit, "rate_model_path", lambda c: path)  # where the fit saves: never the user's cache
    monkeypatch.setattr(ratemodel, "shipped_rate_model_path", lambda c: tmp_path / "none.json")
    fits = []

    def fake_fit(lm_, cal_, presets, answers=None, targets=None, recipe=None, **k):
        fits.append(recipe.name)
        return replace(shipped, recipe=recipe.name, prefill_dtype="bfloat16")

    monkeypatch.setattr(ratefit, "fit_rate_model", fake_fit)
    code, out, err = run_kvc(["calibrate", "--json"], capsys)
    assert code == 0, err
    assert json.loads(out)["rate_model_recipe"] == "quick" and fits == []
    assert json.loads(out)["compute_dtype"] == {"calibration": None, "rate_model": None}  # shipped: float32 throughout
    code, out, err = run_kvc(["calibrate", "--thorough", "--json"], capsys)
    assert code == 0, err
    rep = json.loads(out)
    assert fits == ["thorough"] and rep["rate_model_recipe"] == "thorough" and rep["rate_model_fitted"] is True
    assert rep["compute_dtype"] == {"calibration": None, "rate_model": "bfloat16"}
    assert ratemodel.RateModel.from_json(json.loads(path.read_text()), "f").recipe == "thorough"
    code, out, err = run_kvc(["calibrate", "--thorough", "--json"], capsys)
    assert code == 0 and fits == ["thorough"] and json.loads(out)["rate_model_fitted"] is False  # kept


def _lossy():
    from kvcodec.plan.presets import lossy_settings

    return lossy_settings()


def _answers():
    from kvcodec.plan.presets import answer_targets

    return answer_targets()


def _moments(D: int, L: int = 2, H: int = 2, seed: int = 0):
    from kvcodec.calibration.fit import Moments

    rng = np.random.default_rng(seed)
    mom = Moments(L, H, D)
    x = rng.standard_normal((2048, D)) @ rng.standard_normal((D, D)) + rng.standard_normal(D)
    mom.n[:] = len(x)
    mom.s1[:] = x.sum(0)
    mom.s2[:] = x.T @ x
    a = rng.standard_normal((L, 2, H, D, D))
    return mom, a @ np.swapaxes(a, -1, -2) / D + np.eye(D)


@pytest.mark.parametrize("D", [96, 128, 256])
def test_wide_heads_get_a_block_diagonal_basis(D):
    """head_dim > 64: every basis column lives on one channel block (the fused decoder then costs a
    block's width per coefficient), columns ordered by decreasing variance, and each block's columns
    are exactly the weighted PCA of that block alone."""
    from kvcodec.codecs.blocks import channel_blocks
    from kvcodec.calibration.fit import _weighted_pca, compute_pca

    mom, met = _moments(D)
    basis, mean, eig = compute_pca(mom, met)
    blocks = channel_blocks(D)
    assert len(blocks) > 1 and basis.shape == (2, 2, 2, D, D)
    assert (np.diff(eig, axis=-1) <= 0).all()
    b = basis.astype(np.float64)
    owner = np.array([[j for j, (c0, c1) in enumerate(blocks) if np.any(b[0, 0, 0, c0:c1, k])] for k in range(D)], dtype=object)
    assert all(len(o) == 1 for o in owner), "a column spans two blocks"
    c0, c1 = blocks[1]
    cols = [k for k in range(D) if owner[k] == [1]]
    assert len(cols) == c1 - c0
    cov = mom.s2[0, 0, 0] / mom.n[0, 0] - np.outer(mom.s1[0, 0, 0], mom.s1[0, 0, 0]) / mom.n[0, 0] ** 2
    v, _ = _weighted_pca(cov[c0:c1, c0:c1], met[0, 0, 0, c0:c1, c0:c1])
    assert np.array_equal(b[0, 0, 0, c0:c1][:, cols], v.astype(np.float16).astype(np.float64))
    full, _, eig_full = compute_pca(mom, met, [(0, D)])  # kvc calibrate --basis full
    assert np.count_nonzero(full[0, 0, 0]) > 0.9 * D * D


def test_narrow_heads_keep_one_pca_per_head():
    """head_dim <= 64 is one block: the basis is the whole-head PCA, bit for bit what it was before
    blocks existed (the shipped SmolLM2 calibration, pinned by sha256, was built that way)."""
    from kvcodec.calibration.fit import _weighted_pca, compute_pca

    mom, met = _moments(64)
    basis, _, _ = compute_pca(mom, met)
    cov = mom.s2 / mom.n[:, :, None, None, None] - (mom.s1 / mom.n[:, :, None, None])[..., :, None] * \
        (mom.s1 / mom.n[:, :, None, None])[..., None, :]
    v, _ = _weighted_pca(cov, met)
    assert np.array_equal(basis.view(np.uint16), v.astype(np.float16).view(np.uint16))


def test_coded_tensor_of_chosen_tokens_equals_selecting_them_afterwards(small_cache):
    """The rate search un-RoPEs only the tokens it reads: the same bits as un-RoPEing the layer and then
    selecting, with the cache's own positions, explicit positions, and a sliding layer's later first token."""
    import torch

    from kvcodec.calibration.build import coded_tensor
    from kvcodec.core.kvcache import KVCache

    c = small_cache
    T = c.num_tokens
    pos = np.arange(1, T, 2, dtype=np.int64)  # a pruned cache: every other token, at its own position
    shifted = KVCache([k[:, 1::2].clone() for k in c.keys], [v[:, 1::2].clone() for v in c.values], c.token_ids,
                      c.fingerprint, pos)
    ragged = KVCache([k[:, 20:].clone() if l == 1 else k for l, k in enumerate(c.keys)],
                     [v[:, 20:].clone() if l == 1 else v for l, v in enumerate(c.values)], c.token_ids, c.fingerprint)
    for cache in (c, shifted, ragged):
        for layer in (0, 1):
            Tl = int(cache.keys[layer].shape[1])
            for tokens in (np.arange(4, Tl), np.arange(4, Tl)[::3], np.array([Tl - 1, 0, 5]), np.arange(0)):
                for kind in "kv":
                    whole = coded_tensor(cache, layer, kind)
                    got = coded_tensor(cache, layer, kind, tokens)
                    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(whole[:, tokens]).view(np.uint32))
    k = coded_tensor(shifted, 0, "k", np.arange(len(pos)))
    assert np.array_equal(k, coded_tensor(c, 0, "k", pos))  # the positions are used
    assert torch.equal(torch.from_numpy(coded_tensor(c, 0, "v", np.arange(T))), c.values[0].float())
