"""JSON nested deeper than the json module recurses is one error line in every file kvcodec parses.

The json module's C scanner recurses once per ``[`` or ``{``: text nested a few thousand deep raised
RecursionError, which no ``except ValueError`` catches, so a capture whose meta, fingerprint or
safetensors header held such JSON (or a model directory's safetensors header) left ``kvc encode`` with a
50-line traceback. ``kvcodec.errors.json_loads`` raises it as the JSONDecodeError malformed JSON raises.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from kvcodec.core.kvcache import KVCache, load_capture, save_capture
from kvcodec.errors import KvcFormatError, KvcModelNotFoundError, json_loads
from kvcodec.testing.attacks import SMALL_FP

DEEP = "[" * 50_000 + "]" * 50_000


def test_json_loads_raises_deep_nesting_as_malformed_json():
    assert json_loads('{"a": [1, 2]}') == {"a": [1, 2]}
    with pytest.raises(json.JSONDecodeError, match="nested too deep"):
        json_loads(DEEP)
    with pytest.raises(ValueError):
        json_loads(DEEP.encode())


@pytest.fixture()
def capture(tmp_path):
    g = np.random.default_rng(0)
    ks = [torch.from_numpy(g.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(2)]
    vs = [torch.from_numpy(g.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(2)]
    path = tmp_path / "c.safetensors"
    save_capture(KVCache(ks, vs, np.arange(8), SMALL_FP, meta={"doc": "x"}), path)
    load_capture(path)  # the honest file loads
    return path


def _rewrite(path, edit) -> None:
    b = path.read_bytes()
    n = struct.unpack("<Q", b[:8])[0]
    hdr = json.loads(b[8:8 + n])
    out = edit(hdr)
    hb = out.encode() if isinstance(out, str) else json.dumps(hdr).encode()
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + (b"" if isinstance(out, str) else b[8 + n:]))


def _set_rope(hdr):
    fp = json.loads(hdr["__metadata__"]["fingerprint"])
    fp["rope"] = DEEP
    hdr["__metadata__"]["fingerprint"] = json.dumps(fp)


@pytest.mark.parametrize("what, edit", [
    ("meta", lambda h: h["__metadata__"].__setitem__("meta", DEEP)),
    ("fingerprint", lambda h: h["__metadata__"].__setitem__("fingerprint", DEEP)),
    ("the fingerprint's rope", _set_rope),
    ("the whole header", lambda h: DEEP),
])
def test_a_capture_holding_deep_json_is_one_format_error(capture, what, edit):
    _rewrite(capture, edit)
    with pytest.raises(KvcFormatError):
        load_capture(capture)


def test_a_capture_with_deep_json_meta_in_hdf5_is_one_format_error(tmp_path):
    import h5py

    g = np.random.default_rng(0)
    ks = [torch.from_numpy(g.standard_normal((2, 8, 4)).astype(np.float32)) for _ in range(2)]
    path = tmp_path / "c.h5"
    save_capture(KVCache(ks, [k.clone() for k in ks], np.arange(8), SMALL_FP), path)
    with h5py.File(path, "r+") as f:
        f.attrs["meta"] = DEEP
    with pytest.raises(KvcFormatError, match="meta"):
        load_capture(path)


def test_a_model_directory_whose_safetensors_header_is_deep_json_is_refused(tmp_path):
    from kvcodec.models.load import check_weights

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    hb = DEEP.encode()
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", len(hb)) + hb)
    with pytest.raises(KvcModelNotFoundError):
        check_weights(tmp_path)
