"""kvcodec.digest.array_sha256: the one attachment identity, memoised only where it cannot go stale."""

from __future__ import annotations

import hashlib

import numpy as np

from kvcodec.digest import _MEMO, array_sha256


def _ref(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()).hexdigest()


def test_identity_is_the_little_endian_c_order_bytes():
    a = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    assert array_sha256(a) == _ref(a)
    assert array_sha256(a.astype(">f4")) == _ref(a)  # byte order does not change the identity
    assert array_sha256(np.asfortranarray(a)) == _ref(a)  # nor the memory layout


def test_a_writable_array_is_hashed_again_after_a_change():
    a = np.zeros(1000, np.float16)
    before = array_sha256(a)
    a[7] = 1
    assert array_sha256(a) != before and array_sha256(a) == _ref(a)


def test_a_frozen_array_is_memoised_and_a_thawed_one_is_not():
    a = np.arange(1000, dtype=np.float32)
    a.setflags(write=False)
    v = a.reshape(10, 100)  # a read-only view of a read-only owner: frozen too
    sha = array_sha256(v)
    assert id(v) in _MEMO and array_sha256(v) == sha
    a.setflags(write=True)  # the owner can be made writable again: then nothing is trusted
    a[0] = 5
    assert array_sha256(v) == _ref(v) != sha


def test_a_view_of_a_mutable_buffer_is_never_memoised():
    buf = bytearray(400)
    a = np.frombuffer(buf, np.float32)  # read-only flag unset... and even when set, the bytearray can change
    a.setflags(write=False)
    sha = array_sha256(a)
    buf[0] = 1
    assert array_sha256(a) != sha


def test_a_loaded_calibration_is_frozen_all_the_way_down():
    """The calibration is shared by every file open in the process (memoised): none of its arrays, nor
    the attachment views files read, may be writable -- a write would change every later decode."""
    import pytest

    from kvcodec.digest import _frozen
    from kvcodec.calibration.store import SHIPPED_DIR, SHIPPED_SHA256, load_calibration_file

    cal = load_calibration_file(SHIPPED_DIR / next(iter(SHIPPED_SHA256)))
    for name, a in [*cal.attachments.items(), ("eigval", cal.eigval), ("sensitivity", cal.sensitivity)]:
        assert _frozen(a), name
        with pytest.raises(ValueError):
            a.reshape(-1)[0] = 1
    sha = array_sha256(cal.attachments["pca.basis"])
    assert sha == cal.meta["sha256.pca.basis"] and id(cal.attachments["pca.basis"]) in _MEMO
