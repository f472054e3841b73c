"""``kvcodec.runtime.warmup.prewarm``: a fresh process's one-time decode costs, paid in the background.

It is an optimisation only: with no warm-up files it does nothing, and a
damaged file must neither raise nor change any result.
"""

from __future__ import annotations

import logging

import pytest

from kvcodec.runtime import warmup
def test_no_files_no_thread(tmp_path, monkeypatch):
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    assert warmup.prewarm() is None


def test_prewarm_decodes_the_setup_files(tmp_path, monkeypatch, small_cache, lm):
    """A real balanced `.kvc` in the warm-up dir is decoded (codec stack imported) without error."""
    from kvcodec.format import KvcReader, encode_kvc_bytes
    from kvcodec.api import make_plan

    plan = make_plan(small_cache, "balanced", model=lm)
    d = tmp_path / "warmup"
    d.mkdir()
    (d / "balanced.kvc").write_bytes(encode_kvc_bytes(small_cache, plan))
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    seen: list[str] = []
    monkeypatch.setattr(warmup.log, "debug", lambda *a, **k: seen.append(a[0] % a[1:]))
    decoded: list[int] = []
    real = KvcReader.read_layer

    def counting(self, i, backend=None):
        out = real(self, i, backend)
        decoded.append(i)
        return out

    monkeypatch.setattr(KvcReader, "read_layer", counting)
    t = warmup.prewarm()
    assert t is not None and t.daemon
    t.join(60)
    assert not t.is_alive() and seen == []  # nothing failed
    assert decoded == list(range(small_cache.num_layers))  # every layer decoded


@pytest.mark.parametrize("content", [b"", b"KVC\x00garbage" * 100, b"\x00" * 4096])
def test_damaged_file_is_ignored(tmp_path, monkeypatch, content, caplog):
    d = tmp_path / "warmup"
    d.mkdir()
    (d / "balanced.kvc").write_bytes(content)
    monkeypatch.setenv("KVCODEC_CACHE", str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="kvcodec.runtime.warmup"):
        t = warmup.prewarm()
        t.join(60)
    assert not t.is_alive()
    assert any("prewarm stopped" in r.getMessage() for r in caplog.records)
    assert (d / "balanced.kvc").read_bytes() == content  # never modified


def test_context_bytes_from_the_model_config(tmp_path):
    """prewarm's prefault size: the K/V the attention reads per token (float32, all query heads)."""
    import json

    cfg = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}  # SmolLM2-135M
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert warmup.context_bytes(tmp_path, 4096) == 30 * 2 * 9 * 64 * 4 * 4096
    nested = {"text_config": dict(cfg, head_dim=256, num_attention_heads=4)}  # multimodal layout, explicit head_dim
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert warmup.context_bytes(tmp_path, 10) == 30 * 2 * 4 * 256 * 4 * 10
    for bad in ("{", "[]", json.dumps({"num_hidden_layers": "x"})):
        (tmp_path / "config.json").write_text(bad)
        assert warmup.context_bytes(tmp_path, 10) == 0
    assert warmup.context_bytes(tmp_path / "missing", 10) == 0
