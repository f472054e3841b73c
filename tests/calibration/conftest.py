"""Fixtures the calibration tests share."""

from __future__ import annotations

import pytest


@pytest.fixture
def private_calibration_cache(tmp_path, monkeypatch):
    """A per-test KVCODEC_CACHE and an empty in-process calibration memo, before and after: the tests that write
    or plant files in the user's calibration cache never see another test's, or the real one."""
    from kvcodec.calibration import store as C_store

    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path / "cache"))
    C_store._memo_clear()
    yield
    C_store._memo_clear()
