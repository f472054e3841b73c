"""kvcodec.calibration.ratemodel: what a rate model file says about the predictor."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.model


def test_chat_residual_is_the_worst_probe_row_after_the_factor(lm, tmp_path):
    """RateModel.chat_residual: max(measured / predicted) over a preset's chat rows, divided by its factor; None when
    the preset has no chat record; rows that are not numbers (a tampered file) are skipped, never crash."""
    from dataclasses import replace

    from kvcodec.calibration.build import ensure_calibration
    from kvcodec.calibration.ratemodel import load_rate_model

    rm = load_rate_model(ensure_calibration(lm))
    rows = [{"kl": 3e-3, "predicted": 1e-3}, {"kl": 1e-3, "predicted": 1e-3}, {"kl": "x", "predicted": 1e-3},
            {"kl": 1.0, "predicted": 0.0}, "junk"]
    got = replace(rm, chat_factor={"balanced": {"factor": 1.5, "rows": rows}})
    assert got.chat_residual("balanced") == pytest.approx(2.0)
    assert replace(rm, chat_factor={}).chat_residual("balanced") is None
    assert replace(rm, chat_factor={"balanced": {"factor": 1.5, "rows": "junk"}}).chat_residual("balanced") is None
