"""Device selection (kvcodec.decode.device) and import hygiene of kvcodec.decode.triton (no kernels run here)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvcodec.errors import KvcBackendError, KvcInputError


def test_import_needs_no_triton_or_gpu():
    code = ("import sys; import kvcodec, kvcodec.decode.triton, kvcodec.decode.triton.backend, kvcodec.decode.registry, kvcodec.decode.device as b; "
            "assert 'triton' not in sys.modules, 'triton imported'; print(b.resolve_device('cpu'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, "KVCODEC_BACKEND": ""})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "cpu"


def test_resolve_order(monkeypatch):
    from kvcodec.decode import device as b
    monkeypatch.delenv("KVCODEC_BACKEND", raising=False)
    assert b.resolve_device("cpu") == "cpu"
    monkeypatch.setenv("KVCODEC_BACKEND", "cpu")
    assert b.resolve_device(None) == "cpu"
    assert b.resolve_device("auto") == ("gpu" if b._cuda_available() and b._triton_importable() else "cpu")
    monkeypatch.setenv("KVCODEC_BACKEND", "tpu")
    with pytest.raises(KvcInputError):
        b.resolve_device(None)
    with pytest.raises(KvcInputError):
        b.resolve_device("cuda")


def test_auto_never_picks_the_interpreter(monkeypatch):
    from kvcodec.decode import device as b
    monkeypatch.setattr(b, "_cuda_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert b.resolve_device("auto") == "cpu"


def test_gpu_without_device_is_a_clear_error(monkeypatch):
    from kvcodec.decode import device as b
    monkeypatch.setattr(b, "_cuda_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(KvcBackendError, match="no CUDA device; set TRITON_INTERPRET=1"):
        b.resolve_device("gpu")
    monkeypatch.setenv("KVCODEC_BACKEND", "gpu")
    with pytest.raises(KvcBackendError):
        b.resolve_device(None)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    if b._triton_importable():
        assert b.resolve_device("gpu") == "gpu"
        assert str(b.gpu_device()) == "cpu"


def test_gpu_without_triton(monkeypatch):
    from kvcodec.decode import device as b
    monkeypatch.setattr(b, "_triton_importable", lambda: False)
    with pytest.raises(KvcBackendError, match="Triton"):
        b.resolve_device("gpu")
    monkeypatch.setattr(b, "_cuda_available", lambda: True)
    assert b.resolve_device("auto") == "cpu"
