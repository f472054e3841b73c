"""Issue 14: the vLLM connector treats any unusable stored chunk as a miss (no vLLM needed).

The connector's scheduler (``usable_run``) and worker loader (``fetch_chunk`` +
``next_layer``, then ``evict_unreadable``) are composed of the pure functions
tested here on real K/V of the embedded model: a chunk that is corrupt behind a
valid header, vanished, another prefix's, or needs a calibration this machine
lacks is evicted with one warning, and never raises out of the connector.
"""

from __future__ import annotations

import hashlib
import logging

import pytest
import torch

from kvcodec.store import Store
from kvcodec.integrations.vllm.config import chunk_keys
from kvcodec.integrations.vllm.entries import (
    ChunkUnreadable, decode_chunk_layers, encode_chunk, entry_problem, evict_unreadable, fetch_chunk, next_layer,
    usable_run,
)

from kvcodec.testing.surgery import header_obj, split, with_header  # noqa: E402

pytestmark = pytest.mark.model

C = 32  # tokens per chunk: the 64-token real cache makes two chunks


@pytest.fixture()
def chunks(lm, small_cache, tmp_path):
    """A store holding the two lossless chunks of the real 64-token GPL-3 cache, as the connector saves them."""
    ids = [int(t) for t in small_cache.token_ids]
    keys = chunk_keys(ids, 64, model=lm.fingerprint.id, codec="lossless", namespace="t", chunk_tokens=C)
    st = Store.open(str(tmp_path / "st"))
    for i, key in enumerate(keys):
        s, e = i * C, (i + 1) * C
        st.put(key, encode_chunk(lm.fingerprint, "lossless", ids, s, e, [k[:, s:e] for k in small_cache.keys],
                                 [v[:, s:e] for v in small_cache.values]))
    yield st, keys, ids
    st.close()


def _load(st, key, fp, ids, i):
    """What the connector's loader does for chunk i: fetch, check, decode every layer."""
    r = fetch_chunk(st, key, fp, ids, i * C, (i + 1) * C)
    it = decode_chunk_layers(r, i * C, (i + 1) * C)
    return [next_layer(it, key, layer) for layer in range(fp.num_layers)]


def _warnings(caplog, key) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvcodec.integrations.vllm" and str(key) in r.getMessage()]


def test_good_chunks_load_exactly(lm, small_cache, chunks):
    st, keys, ids = chunks
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 2
    for i, key in enumerate(keys):
        layers = _load(st, key, lm.fingerprint, ids, i)
        for (k, v), k0, v0 in zip(layers, small_cache.keys, small_cache.values):
            assert torch.equal(k, k0[:, i * C:(i + 1) * C].transpose(0, 1))
            assert torch.equal(v, v0[:, i * C:(i + 1) * C].transpose(0, 1))


def test_scheduler_evicts_a_chunk_whose_header_does_not_fit(lm, small_cache, chunks, caplog):
    caplog.set_level(logging.WARNING, logger="kvcodec.integrations.vllm")
    st, keys, ids = chunks
    other = list(ids)
    other[40] += 1  # chunk 1 of another prompt planted under this prompt's key
    st.put(keys[1], encode_chunk(lm.fingerprint, "lossless", other, C, 2 * C, [k[:, C:] for k in small_cache.keys],
                                 [v[:, C:] for v in small_cache.values]))
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 1
    assert st.contains_many(keys) == [True, False]  # evicted: the next request computes and saves it
    assert len(_warnings(caplog, keys[1])) == 1


def test_loader_evicts_a_corrupt_chunk_behind_a_valid_header(lm, chunks, caplog):
    caplog.set_level(logging.WARNING, logger="kvcodec.integrations.vllm")
    st, keys, ids = chunks
    data = bytearray(st.get(keys[0]))
    p = split(bytes(data))
    mid = p["dstart"] + len(p["data"]) // 2
    data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
    st.put(keys[0], bytes(data))
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 2  # the header is fine: the scheduler cannot tell
    with pytest.raises(ChunkUnreadable, match="undecodable") as exc:
        _load(st, keys[0], lm.fingerprint, ids, 0)
    evict_unreadable(st, exc.value)
    assert st.contains_many(keys) == [False, True] and len(_warnings(caplog, keys[0])) == 1
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 0


def test_loader_survives_a_chunk_vanishing_after_lookup(lm, chunks, caplog):
    caplog.set_level(logging.WARNING, logger="kvcodec.integrations.vllm")
    st, keys, ids = chunks
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 2
    st.rm(keys[1])  # evicted by another process between the scheduler's lookup and the worker's load
    with pytest.raises(ChunkUnreadable, match="vanished") as exc:
        _load(st, keys[1], lm.fingerprint, ids, 1)
    assert exc.value.vanished
    evict_unreadable(st, exc.value)  # nothing to delete, no error
    assert len(_warnings(caplog, keys[1])) == 1
    assert "vanished" in entry_problem(st, keys[1], lm.fingerprint, ids, C, 2 * C).why


def test_loader_evicts_a_chunk_needing_a_calibration_this_machine_lacks(lm, small_cache, chunks, caplog):
    caplog.set_level(logging.WARNING, logger="kvcodec.integrations.vllm")
    st, keys, ids = chunks
    data = encode_chunk(lm.fingerprint, "balanced", ids, 0, C, [k[:, :C] for k in small_cache.keys],
                        [v[:, :C] for v in small_cache.values])
    h = header_obj(data)
    ext = [n for n, a in h["attachments"].items() if a.get("blob") is None]
    assert ext
    for n in ext:
        h["attachments"][n]["sha256"] = hashlib.sha256(b"elsewhere" + n.encode()).hexdigest()
    st.put(keys[0], with_header(data, h))
    assert usable_run(st, keys, lm.fingerprint, ids, C) == 2
    with pytest.raises(ChunkUnreadable, match="undecodable") as exc:
        _load(st, keys[0], lm.fingerprint, ids, 0)
    evict_unreadable(st, exc.value)
    assert st.contains_many(keys) == [False, True]


def test_a_tier_raising_anything_is_a_miss_not_a_crash(lm, chunks, caplog):
    st, keys, ids = chunks

    class Broken:
        def reader(self, key):
            raise RuntimeError("tier exploded")

        def rm(self, key):
            raise RuntimeError("still exploded")

    assert usable_run(Broken(), keys, lm.fingerprint, ids, C) == 0  # evict_unreadable swallowed the rm failure
    bad = entry_problem(Broken(), keys[0], lm.fingerprint, ids, 0, C)
    assert "RuntimeError: tier exploded" in bad.why
