"""One codec id for the store key (spec/store-keys.md §1): ``kvc ask``, ``kvc store put``, a client of the
KDN service and the vLLM connector name the same encoding of the same tokens under the same model by the
same key, so each finds the others' entry."""

from __future__ import annotations

import hashlib
import json

import pytest

import kvcodec
from cliutil import run_kvc
from kdn_service import TOK_A, Service
from kvcodec.integrations.vllm.config import ConnectorConfig, chunk_keys
from kvcodec.runtime.knowledge import KnowledgeBase, key_for_file
from kvcodec.store import Store
from kvcodec.store.keys import codec_key

pytestmark = pytest.mark.model


def test_codec_key_is_the_specs_digest():
    """The derivation spec/store-keys.md §1 states, and its worked example."""
    for preset, options in (("lossless", None), ("balanced", {"step0": 0.25}), ("small", {})):
        blob = json.dumps({"preset": preset, "options": options or {}}, sort_keys=True).encode()
        assert codec_key(preset, options) == hashlib.sha256(blob).hexdigest()[:16]
    assert codec_key("lossless") == "a549b1742ae6b4b0"
    assert codec_key("balanced") != codec_key("balanced", {"step0": 0.25}) != codec_key("small")


def test_ask_store_put_service_and_connector_name_one_entry(lm, real_cache, tmp_path, capsys):
    cache = real_cache(256)  # exactly one vLLM chunk: the connector's entry is then a whole prefix too
    ids = cache.token_ids
    ns = "a"
    kb = KnowledgeBase(lm, str(tmp_path / "local"), preset="lossless", namespace=ns)
    ask_key = kb.key(ids)

    path = tmp_path / "doc.kvc"
    kvcodec.encode(cache, path, preset="lossless")
    with kvcodec.open(path, model=lm) as r:
        put_key = key_for_file(r, namespace=ns)

    cfg = ConnectorConfig.from_extra({"store_url": str(tmp_path / "vllm"), "preset": "lossless", "namespace": ns,
                                      "chunk_tokens": 256})
    vllm_key = chunk_keys(ids, 256, model=lm.fingerprint.id, codec=cfg.codec_id, namespace=ns, chunk_tokens=256)[-1]
    assert ask_key == put_key == vllm_key
    assert ask_key.codec == codec_key("lossless")

    # through the KDN service: `kvc store put` deposits the file; kvc ask's lookup and the connector's probe hit it
    (tmp_path / "svc").mkdir()
    svc = Service(tmp_path / "svc", max_body="64M")
    try:
        code, out, err = run_kvc(["store", "put", str(path), "--store", svc.url(TOK_A), "--namespace", ns, "--json"],
                                 capsys)
        assert code == 0, err
        assert json.loads(out)["key"] == put_key.to_str()
        remote = KnowledgeBase(lm, svc.url(TOK_A), preset="lossless", namespace=ns)
        assert remote.lookup(ids, [len(ids)]) == (ask_key, len(ids))
        st = Store.open(svc.url(TOK_A), memory_bytes=0)
        assert st.contains_many([vllm_key]) == [True]
    finally:
        svc.stop()


def test_a_connector_chunk_is_a_miss_for_ask_and_is_kept(lm, real_cache, tmp_path):
    """Shared keys mean kvc ask can meet the connector's chunk entries: the KV of a prefix's last chunk only.
    Loading one as the whole context would answer from half a context; it is a miss, and it stays stored."""
    from kvcodec.errors import KvcError
    from kvcodec.integrations.vllm.entries import encode_chunk

    cache = real_cache(512)
    ids = [int(t) for t in cache.token_ids]
    kb = KnowledgeBase(lm, str(tmp_path / "local"), preset="lossless", namespace="a")
    key = kb.key(cache.token_ids)
    data = encode_chunk(lm.fingerprint, "lossless", ids, 256, 512, [k[:, 256:] for k in cache.keys],
                        [v[:, 256:] for v in cache.values])
    assert kb.store.put(key, data).ok
    with pytest.raises(KvcError, match="stores 256 of the prefix's 512 tokens") as exc:
        kb._open_entry(key, cache.token_ids)
    kb.drop_unreadable(key, exc.value)
    assert kb.store.contains(key)  # not evicted: the connector still uses it
