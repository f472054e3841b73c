"""``kvcodec.encode`` / ``kvcodec.open``: what they refuse is one KvcError line, never a raw exception, and
``encode`` never writes over its own input (issue 55)."""

from __future__ import annotations

import io

import pytest
import torch

import kvcodec
from kvcodec.core.kvcache import save_capture
from kvcodec.errors import KvcError, KvcInputError, KvcIOError
from kvcodec.testing.golden import _synthetic


@pytest.fixture()
def capture_file(tmp_path):
    p = tmp_path / "cap.h5"
    save_capture(_synthetic(torch.float16, 8), p)
    return p


@pytest.fixture()
def kvc_file(tmp_path):
    p = tmp_path / "a.kvc"
    p.write_bytes(kvcodec.encode(_synthetic(torch.float16, 8), None, preset="lossless").data)
    return p


def test_encode_refuses_to_overwrite_its_source(capture_file, tmp_path):
    before = capture_file.read_bytes()
    link = tmp_path / "link.h5"
    link.symlink_to(capture_file)
    for dest in (capture_file, str(capture_file), link):
        with pytest.raises(KvcInputError, match="same file as the input"):
            kvcodec.encode(capture_file, dest, preset="lossless")
    assert capture_file.read_bytes() == before
    assert kvcodec.encode(capture_file, tmp_path / "out.kvc", preset="lossless").size > 0  # a different file is fine


def test_encode_refuses_sources_and_destinations_it_cannot_use(capture_file, kvc_file, tmp_path):
    with pytest.raises(KvcInputError, match="KVCache or the path"):
        kvcodec.encode(kvc_file.read_bytes(), None, preset="lossless")
    with open(kvc_file, "rb") as ro, pytest.raises(KvcInputError, match="not writable"):
        kvcodec.encode(capture_file, ro, preset="lossless")
    with open(tmp_path / "t.txt", "w") as text, pytest.raises(KvcInputError, match="text mode"):
        kvcodec.encode(capture_file, text, preset="lossless")
    with pytest.raises(KvcInputError, match="NUL"):
        kvcodec.encode(capture_file, str(tmp_path / "a\0b.kvc"), preset="lossless")
    buf = io.BytesIO()  # a writable binary object is fine
    assert kvcodec.encode(capture_file, buf, preset="lossless").size == len(buf.getvalue()) > 0


def test_encode_refuses_settings_that_cannot_apply(capture_file):
    with pytest.raises(KvcInputError, match="chunk_heads must be an integer in \\[1, 2\\] .the cache has 2 KV heads"):
        kvcodec.encode(capture_file, None, preset="lossless", chunk_heads=99)
    with pytest.raises(KvcInputError, match="chunk_heads"):
        kvcodec.encode(capture_file, None, preset="lossless", chunk_heads=True)
    with pytest.raises(KvcInputError, match="sink .100000. is more tokens than the context has .8."):
        kvcodec.encode(capture_file, None, preset="near-lossless", overrides={"sink": 100000})


class _FailingReader:
    """A range reader whose reads fail as a network or disk would."""

    size = 4096

    def read(self, offset: int, length: int) -> bytes:
        raise OSError(5, "Input/output error")

    def close(self) -> None:
        pass


def test_open_refusals_are_kvc_errors(kvc_file):
    with pytest.raises(KvcInputError, match="NUL"):
        kvcodec.open(str(kvc_file) + "\0x")
    with pytest.raises(KvcIOError):
        kvcodec.open(_FailingReader())
    with pytest.raises(KvcError):
        kvcodec.open(kvc_file, model="no-such-model-name")


@pytest.mark.model
def test_open_takes_a_model_name_as_encode_does(lm, small_cache):
    data = kvcodec.encode(small_cache, None, preset="lossless").data
    with kvcodec.open(data, model="smollm2") as r:
        assert r.header.num_context_tokens == small_cache.num_context_tokens
