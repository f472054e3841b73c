"""The per-user calibration cache holding something hostile where a calibration or rate model goes: one line.

Reads were already strict (truncated, random, swapped, FIFO files); these are the cases that escaped: a rate
model of JSON nested 100,000 deep (RecursionError), and every save into a cache where a file stands in place
of a directory or a directory in place of the file (FileExistsError / NotADirectoryError / IsADirectoryError
tracebacks after a minutes-long build).
"""

from __future__ import annotations

import numpy as np
import pytest

from kvcodec.calibration import record as C_record
from kvcodec.calibration import store as C_store
from kvcodec.calibration.record import Calibration
from kvcodec.errors import KvcFormatError, KvcIOError

FID = "c" * 32


pytestmark = pytest.mark.usefixtures("private_calibration_cache")  # tests/calibration/conftest.py


def _cal() -> Calibration:
    rng = np.random.default_rng(0)
    q = np.linalg.qr(rng.standard_normal((2, 2, 2, 8, 8)))[0]
    eig = np.sort(rng.random((2, 2, 2, 8)), axis=-1)[..., ::-1].astype(np.float32)
    mean = rng.standard_normal((2, 2, 2, 8)).astype(np.float32)
    return Calibration(C_record.snap_basis(q), mean, np.ascontiguousarray(eig), np.ones((2, 2), np.float32),
                       {"texts": ["synthetic"]})


def _rate_model(cal: Calibration):
    from kvcodec.calibration.ratemodel import RateModel

    return RateModel(FID, str(cal.meta["content_sha256"]), {"balanced": 1.5}, {"balanced": 0.3}, 1024, 0.05)


def test_a_rate_model_nested_too_deep_is_one_format_error():
    from kvcodec.calibration.ratemodel import load_rate_model, rate_model_path

    cal = C_store.load_calibration_file(C_store.save_calibration(_cal(), FID))
    path = rate_model_path(cal)
    path.write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(KvcFormatError, match="unreadable rate model"):
        load_rate_model(cal)


@pytest.mark.parametrize("block", ["model_dir_is_a_file", "root_is_a_file", "file_is_a_dir"])
def test_saving_into_a_cache_with_something_in_the_way_is_one_io_error(block):
    path = C_store.calibration_dir(FID) / f"calib-v{C_record.CALIB_VERSION}.safetensors"
    root = C_store.calibration_root()
    if block == "model_dir_is_a_file":
        root.mkdir(parents=True)
        path.parent.write_text("x")
    elif block == "root_is_a_file":
        root.parent.mkdir(parents=True)
        root.write_text("x")
    else:
        path.mkdir(parents=True)
    with pytest.raises(KvcIOError, match="cannot save the calibration in") as e:
        C_store.save_calibration(_cal(), FID)
    assert "\n" not in str(e.value)


def test_saving_a_rate_model_where_a_directory_stands_is_one_io_error():
    from kvcodec.calibration.ratemodel import rate_model_path, save_rate_model

    cal = C_store.load_calibration_file(C_store.save_calibration(_cal(), FID))
    path = rate_model_path(cal)
    path.mkdir()
    with pytest.raises(KvcIOError, match="cannot save the rate model in .*ratemodel-"):
        save_rate_model(_rate_model(cal), path)


def test_an_attachment_pointer_nested_too_deep_is_no_pointer():
    """<cache>/calibration/sha256/<sha>.json of JSON nested 2,000 deep: decoding any .kvc naming that attachment
    escaped as RecursionError."""
    from kvcodec.digest import array_sha256

    cal = C_store.load_calibration_file(C_store.save_calibration(_cal(), FID))
    name, arr = next(iter(cal.attachments.items()))
    sha = array_sha256(arr)
    (C_store.calibration_root() / "sha256" / f"{sha}.json").write_text("[" * 2000 + "]" * 2000)
    assert C_store.resolve_attachment(name, sha) is None
