"""The kvcodec connector inside real vLLM (CPU build), on the embedded SmolLM2 model.

Runs only in the vLLM venv (``bash .ci/vllm.sh``). One plain vLLM engine gives
the reference greedy tokens; one engine with the connector then
1. prefills a prompt (miss) and saves its whole chunks into a directory store,
2. serves the same prompt again loading those chunks from the store (vLLM's
   own prefix cache is off, so nothing else can supply them): same tokens,
3. meets entries stored under the right keys but written for another model:
   rejected (clean miss), still the reference tokens,
and the connector's constructor refuses a bad store URL / config clearly.
"""

from __future__ import annotations

import gc
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine in-process: the test sees the connector's stats

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.model, pytest.mark.slow]

vllm = pytest.importorskip("vllm")

MAX_TOKENS = 12
CHUNK = 256


@pytest.fixture(scope="module")
def model_dir():
    from kvcodec.models.load import resolve_model_dir

    return str(resolve_model_dir("smollm2"))


@pytest.fixture(scope="module")
def prompts(model_dir):
    from transformers import AutoTokenizer

    from kvcodec.texts import load_text

    tok = AutoTokenizer.from_pretrained(model_dir)
    ids = tok(load_text("gpl3"))["input_ids"]
    assert len(ids) > 1400
    # A: 600 tokens -> 2 whole chunks loadable; B: another part of the text, 560 tokens
    return {"A": ids[:600], "B": ids[700:1260]}


def _engine(model_dir, **kw):
    from vllm import LLM

    return LLM(model=model_dir, max_model_len=1024, enforce_eager=True, dtype="float32", max_num_seqs=1,
               kv_cache_memory_bytes=192 << 20, enable_prefix_caching=False, seed=0, **kw)


def _greedy(llm, ids):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    out = llm.generate([TokensPrompt(prompt_token_ids=list(ids))], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
                       use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _drop(llm):
    try:
        llm.llm_engine.engine_core.shutdown()
    except Exception:
        pass
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference(model_dir, prompts):
    llm = _engine(model_dir)
    ref = {k: _greedy(llm, v) for k, v in prompts.items()}
    _drop(llm)
    return ref


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("kvstore")


@pytest.fixture(scope="module")
def connector_llm(model_dir, store_dir, reference):
    from vllm.config import KVTransferConfig

    cfg = KVTransferConfig(
        kv_connector="KvcodecConnector", kv_connector_module_path="kvcodec.integrations.vllm.connector", kv_role="kv_both",
        kv_connector_extra_config={"store_url": str(store_dir), "preset": "lossless", "namespace": "ci",
                                   "chunk_tokens": CHUNK},
    )
    llm = _engine(model_dir, kv_transfer_config=cfg)
    yield llm
    _drop(llm)


def _stats():
    from kvcodec.integrations.vllm.connector import STATS

    return dict(STATS)


def test_same_prompt_twice_loads_from_store_and_matches_plain_vllm(connector_llm, prompts, reference, store_dir):
    from kvcodec.store import Store

    s0 = _stats()
    first = _greedy(connector_llm, prompts["A"])
    s1 = _stats()
    assert s1.get("saved_chunks", 0) - s0.get("saved_chunks", 0) == 2, s1
    assert s1.get("loaded_tokens", 0) == s0.get("loaded_tokens", 0)  # nothing stored yet: a miss
    assert first == reference["A"]
    with Store.open(str(store_dir)) as st:
        assert len(st.ls(namespace="ci")) == 2

    second = _greedy(connector_llm, prompts["A"])
    s2 = _stats()
    assert s2.get("loaded_tokens", 0) - s1.get("loaded_tokens", 0) == 2 * CHUNK, s2  # the hit: 512 of 600 tokens
    assert s2.get("load_errors", 0) == 0
    assert second == reference["A"], (second, reference["A"])


def test_loaded_kv_is_what_the_model_attends_to(connector_llm, prompts, reference, monkeypatch):
    """Negative control: perturb the decoded KV on its way into the paged cache -> different tokens.

    Shows the hit above really served the prefix from the store (vLLM did not recompute it).
    """
    import kvcodec.integrations.vllm.connector as conn

    real = conn.decode_chunk_layers

    def noisy(r, start, end, *device):
        for i, k, v in real(r, start, end, *device):
            yield i, k + 3.0 * k.std() * __import__("torch").randn_like(k), v

    monkeypatch.setattr(conn, "decode_chunk_layers", noisy)
    s0 = _stats()
    out = _greedy(connector_llm, prompts["A"])
    assert _stats().get("loaded_tokens", 0) - s0.get("loaded_tokens", 0) == 2 * CHUNK
    assert out != reference["A"]


def test_entries_of_another_model_are_a_clean_miss(connector_llm, prompts, reference, store_dir):
    """Entries under the right keys whose `.kvc` says another model: rejected, never loaded as KV."""
    import torch

    from kvcodec.core.fingerprint import ModelFingerprint
    from kvcodec.store import Store
    from kvcodec.integrations.vllm.config import chunk_keys
    from kvcodec.integrations.vllm.connector import _FPS
    from kvcodec.integrations.vllm.entries import encode_chunk
    from kvcodec.store.keys import codec_key

    fp = next(iter(_FPS.values()))
    other = ModelFingerprint(**{**fp.to_json(), "head_dims": fp.head_dims, "weights_sha256": "0" * 64})
    ids = prompts["B"]
    keys = chunk_keys(ids, 2 * CHUNK, model=fp.id, codec=codec_key("lossless"), namespace="ci", chunk_tokens=CHUNK)
    g = torch.Generator().manual_seed(0)
    with Store.open(str(store_dir)) as st:
        for j, key in enumerate(keys):
            kv = [torch.randn(fp.num_kv_heads, CHUNK, fp.head_dims[0], generator=g) * 50 for _ in range(fp.num_layers)]
            st.put(key, encode_chunk(other, "lossless", ids, j * CHUNK, (j + 1) * CHUNK, kv, kv))
    s0 = _stats()
    out = _greedy(connector_llm, ids)
    s1 = _stats()
    assert s1.get("rejected_chunks", 0) > s0.get("rejected_chunks", 0)
    assert s1.get("loaded_tokens", 0) == s0.get("loaded_tokens", 0)
    assert out == reference["B"]


def test_misconfiguration_fails_clearly_at_startup(connector_llm, store_dir):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvcodec.errors import KvcInputError
    from kvcodec.integrations.vllm.connector import KvcodecConnector

    vcfg = connector_llm.llm_engine.vllm_config
    extra = vcfg.kv_transfer_config.kv_connector_extra_config
    saved = dict(extra)
    try:
        for bad, word in [({"store_url": "ftp://host/x"}, "store"),
                          ({"store_url": "redis://127.0.0.1:1/0"}, "store"),
                          ({"store_url": str(store_dir), "preset": "no-such-preset"}, "preset"),
                          ({"store_url": str(store_dir), "chunk_tokens": 100}, "block size"),
                          ({"store_url": str(store_dir), "sotre": 1}, "unknown")]:
            extra.clear()
            extra.update(bad)
            with pytest.raises(KvcInputError, match=word):
                KvcodecConnector(vcfg, KVConnectorRole.SCHEDULER, None)
    finally:
        extra.clear()
        extra.update(saved)
