"""LMCache chunk <-> `.kvc` helpers that need no LMCache (kvcodec.integrations.lmcache.chunks), in the main venv."""

from __future__ import annotations

import pytest
import torch

import kvcodec
from kvcodec.core.fingerprint import ModelFingerprint
from kvcodec.integrations.lmcache.chunks import FRAME_OVERHEAD, chunk_layout, to_cache, upper_bound

TINY = ModelFingerprint("llama", 1, 1, (8,), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, config_sha256="d" * 64)


@pytest.mark.parametrize("tokens", [1, 256, 40_000])
def test_the_estimate_bounds_a_long_incompressible_chunk(tokens):
    """The estimate (``upper_bound``) allowed a fixed slack for everything beyond the raw values, but a `.kvc` also
    stores the chunk's token ids (4 bytes a token): past ~16K tokens of a small model (or 32K tokens of SmolLM2, 755
    MB: 27 KB over) even the raw fallback exceeded it, and the store failed. Now the ids are in the bound."""
    g = torch.Generator().manual_seed(0)
    bits = torch.randint(-(1 << 15), 1 << 15, (2, 1, tokens, 8), generator=g, dtype=torch.int32).to(torch.int16)
    t = bits.view(torch.bfloat16).clone()
    t[t.isnan() | t.isinf()] = 1.0
    bound = upper_bound(chunk_layout([t.shape], [t.dtype]), TINY)
    for preset in ("raw", "lossless"):
        data = kvcodec.encode(to_cache(t, TINY, {}), None, preset=preset, verify="off").data
        assert FRAME_OVERHEAD + len(data) <= bound, preset


class _Key:
    def __init__(self, **kw):
        self.chunk_hash, self.model_name, self.kv_rank, self.object_group_id, self.cache_salt = b"h" * 8, "m", 0, 0, ""
        self.__dict__.update(kw)


@pytest.mark.parametrize("bad", [{"chunk_hash": 10**6}, {"chunk_hash": 3}, {"chunk_hash": "ab"}, {"chunk_hash": b""},
                                 {"model_name": None}, {"kv_rank": "0"}, {"kv_rank": True}, {"cache_salt": 5}],
                         ids=lambda b: f"{list(b)[0]}={list(b.values())[0]!r}")
def test_a_key_with_fields_of_other_types_is_one_line(bad):
    """Before: an integer chunk_hash was read as that many zero bytes (10**10: 10 GB, then its hex; 10**6 here), so hash 3 and
    b"\\0\\0\\0" were one key; a None model name became the model "None"; a string rank escaped or was taken."""
    from kvcodec.errors import KvcInputError
    from kvcodec.integrations.lmcache.chunks import key_digest, key_meta

    assert key_meta(_Key())["chunk_hash"] == (b"h" * 8).hex()
    for f in (key_meta, key_digest):
        with pytest.raises(KvcInputError) as e:
            f(_Key(**bad))
        assert "\n" not in str(e.value)


def test_register_and_server_without_lmcache_are_one_line(monkeypatch, capsys):
    """Where lmcache is not installed, register() and ``python -m kvcodec.integrations.lmcache server`` escaped as a
    ModuleNotFoundError traceback; now one KvcInputError line (exit code 2 for the command)."""
    import sys

    from kvcodec.errors import KvcInputError
    from kvcodec.integrations.lmcache import register
    from kvcodec.integrations.lmcache.__main__ import main

    for name in [m for m in sys.modules if m == "lmcache" or m.startswith("lmcache.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "lmcache", None)  # import lmcache -> ImportError
    with pytest.raises(KvcInputError, match="not installed"):
        register()
    assert main(["server", "--help"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not installed" in err


def test_a_decoded_value_past_the_buffers_dtype_is_refused_not_written_as_inf():
    """A lossy object decodes to float32; copy_ into a float16 buffer turned a value its error carried past 65504
    into inf in the engine's cache, silently. Now one KvcInputError line (the load is a miss)."""
    from kvcodec.errors import KvcInputError
    from kvcodec.integrations.lmcache.chunks import ChunkLayout, write_chunk

    class Reader:
        header = type("H", (), {"meta": {}})()

        def __init__(self, big):
            self.big = big

        def iter_layers(self):
            k = torch.zeros(1, 2, 8)
            k[0, 1, 3] = self.big
            yield 0, k, torch.zeros(1, 2, 8)

    lay = ChunkLayout(1, 2, 8, torch.float16)
    dst = torch.zeros(2, 1, 2, 8, dtype=torch.float16)
    write_chunk(Reader(65000.0), dst, lay)
    assert float(dst[0, 0, 1, 3]) == 64992.0  # float16's nearest
    with pytest.raises(KvcInputError, match="65504|float16"):
        write_chunk(Reader(65600.0), dst, lay)


def test_the_offset_search_on_keys_of_inf_or_nan_is_quiet_and_zero():
    """Keys holding inf, NaN or values near float32's limit made the RoPE offset search print numpy overflow /
    invalid-value warnings into the server's log for every such chunk, and pick an arbitrary offset; now inf and NaN
    answer 0 (the chunk is then stored lossless: kvcodec.integrations.fidelity), and none warns."""
    import warnings

    import numpy as np

    from kvcodec.integrations.lmcache.chunks import estimate_offset

    means = np.ones((1, 2, 8), dtype=np.float32)
    for v in (float("inf"), float("nan"), 3e38):
        k = torch.ones(2, 4, 8)
        k[0, 1, 2] = v
        k[1, 2, 5] = -v if v == v else v
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            off = estimate_offset([k], [(10000.0, 8)], means)
        assert off == 0 if v != 3e38 else 0 <= off < 1 << 17  # 3e38: finite sums, an offset like any other
