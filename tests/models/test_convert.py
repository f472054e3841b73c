"""The GGUF conversion parses the file once (issue 21), and the patch that does it does not outlive the conversion."""

from __future__ import annotations

import gguf

from kvcodec.models.load import _gguf_parsed_once, _gguf_path


def test_one_reader_and_one_name_map_per_conversion_then_restored():
    before = (gguf.GGUFReader, gguf.get_tensor_name_map)
    path = _gguf_path()
    with _gguf_parsed_once():
        a, b = gguf.GGUFReader(path), gguf.GGUFReader(str(path))
        assert a is b and len(a.fields) > 0
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 30) is gguf.get_tensor_name_map(arch, 30)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == before
