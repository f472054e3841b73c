"""A model that computes NaN or inf is refused by the calibration build in one line, and nothing is saved.

Before: the build finished and saved a calibration holding NaNs; the first lossy encode then crashed in a
matrix inverse (torch LinAlgError) and every later one said the file was corrupt and to rebuild it, which
saved the same file again. A tiny random model (tests/_support/tiny_models.py) is given an inf in one
key projection (its keys in that layer turn non-finite) or NaN final-norm weights (its keys are finite,
its logits and so its sensitivities are not).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from kvcodec.errors import KvcInputError

pytestmark = pytest.mark.model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests._support.tiny_models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("nonfinite") / "base", "dense")


@pytest.mark.parametrize("tensor, where, words", [
    ("model.layers.1.self_attn.k_proj.weight", (0, 0), "layer 1 keys hold NaN or inf"),
    ("model.norm.weight", slice(None), "its sensitivities hold NaN or inf"),
])
def test_a_model_computing_non_finite_values_is_not_calibrated(tiny, tmp_path, monkeypatch, tensor, where, words):
    import shutil

    from safetensors.numpy import load_file, save_file

    from kvcodec.calibration import build
    from kvcodec.calibration.store import calibration_root, load_calibration
    from kvcodec.models.load import load_model

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "build_calibration", functools.partial(build.build_calibration, texts=("mpl2",),
                                                                      context=build.MIN_CONTEXT))
    d = tmp_path / "m"
    shutil.copytree(tiny, d)
    t = load_file(d / "model.safetensors")
    t[tensor][where] = np.inf if "k_proj" in tensor else np.nan
    save_file(t, d / "model.safetensors", metadata={"format": "pt"})
    lm = load_model(str(d))
    with pytest.raises(KvcInputError, match=words) as e:
        build.ensure_calibration(lm, progress=False)
    assert "\n" not in str(e.value)
    assert load_calibration(lm.fingerprint.id) is None
    assert not list(calibration_root().rglob("calib-*"))


def test_a_bad_onboard_dtype_is_the_one_line_before_any_build_notice(tiny, tmp_path, monkeypatch, capsys):
    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.models.load import load_model

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KVCODEC_ONBOARD_DTYPE", "float16")
    lm = load_model(str(tiny))
    capsys.readouterr()
    with pytest.raises(KvcInputError, match="KVCODEC_ONBOARD_DTYPE='float16'"):
        ensure_calibration(lm, progress=True)
    assert "building it once" not in capsys.readouterr().err
