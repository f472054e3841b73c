"""``kvc serve`` end to end: a real service process, real .kvc entries of the embedded model.

Covers the protocol (put / get / ranges / ETags / conditional requests /
lookup / ls / delete), bearer-token auth and namespace isolation, clean 4xx on
malformed requests with nothing stored, metrics and health, the
``kvc+http://`` client tier (layer-by-layer ranged loads, outage = clean
miss), and the issue's done-when: a put from one process and an ``ask`` from
another process hit the same service.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import numpy as np
import pytest

from kvcodec.errors import KvcStoreError
from kvcodec.store import Store, StoreKey
from kdn_service import TOK_A, TOK_A_RO, TOK_B, Service, path_of
from store_fixtures import subprocess_env

pytestmark = pytest.mark.model

@pytest.fixture(scope="module")
def service(tmp_path_factory):
    s = Service(tmp_path_factory.mktemp("kdn"))
    yield s
    s.stop()


@pytest.fixture(scope="module")
def entry(lm, real_cache):
    """A real 300-token .kvc (preset balanced) of the GPL-3 text and its key in namespace a."""
    from kvcodec.format import encode_kvc_bytes
    from kvcodec.api import make_plan

    cache = real_cache(300)
    plan = make_plan(cache, "balanced", model=lm)
    data = encode_kvc_bytes(cache, plan)
    key = StoreKey.for_tokens(cache.token_ids, model=lm.fingerprint.id, codec="balanced-test", namespace="a")
    return key, data, cache


def test_put_get_range_etag(service, entry):
    key, data, _ = entry
    assert service.put_raw(key, data, **{"X-Kvc-Meta": '{"doc":"gpl3"}'}) == 201
    s, h, body = service.request("GET", path_of(key))
    assert s == 200 and body == data and h["Accept-Ranges"] == "bytes"
    etag = h["ETag"]
    assert json.loads(h["X-Kvc-Meta"]) == {"doc": "gpl3"}
    s, h2, body = service.request("GET", path_of(key), headers={"If-None-Match": etag})
    assert s == 304 and body == b"" and h2["ETag"] == etag
    s, h, body = service.request("GET", path_of(key), headers={"Range": "bytes=100-1099"})
    assert s == 206 and body == data[100:1100] and h["Content-Range"] == f"bytes 100-1099/{len(data)}"
    s, _, body = service.request("GET", path_of(key), headers={"Range": "bytes=-10"})
    assert s == 206 and body == data[-10:]
    s, _, body = service.request("GET", path_of(key), headers={"Range": "bytes=5-9", "If-Range": etag})
    assert s == 206 and body == data[5:10]
    s, _, body = service.request("GET", path_of(key), headers={"Range": "bytes=5-9", "If-Range": '"stale"'})
    assert s == 200 and body == data, "a stale If-Range must send the whole current entry"
    s, h, _ = service.request("GET", path_of(key), headers={"Range": f"bytes={len(data)}-"})
    assert s == 416 and h["Content-Range"] == f"bytes */{len(data)}"
    s, h, body = service.request("HEAD", path_of(key))
    assert s == 200 and body == b"" and int(h["Content-Length"]) == len(data)
    # the client tier (a Store: sealed entries under physical names): whole entry, then a
    # layer-by-layer load over Range requests
    st = Store.open(service.url(TOK_A), memory_bytes=0)
    assert st.put(key, data, {"doc": "gpl3"}).stored_in == ["kdn"]
    fresh = Store.open(service.url(TOK_A), memory_bytes=0)
    assert fresh.get(key) == data and fresh.get_meta(key) == {"doc": "gpl3"}
    from kvcodec.format import KvcReader

    rd = fresh.reader(key)
    with KvcReader(rd) as r:
        k3, v3 = r.read_layer(3)
    http = rd.inner  # the sealed reader verifies whole (>= 1 MiB) blocks, fetched by Range requests
    assert type(http).__name__ == "HttpRangeReader" and 1 <= http.requests < 20
    assert http.bytes_fetched <= len(data) + 1
    with KvcReader(data) as r:
        k3w, v3w = r.read_layer(3)
    assert np.array_equal(k3.numpy(), k3w.numpy()) and np.array_equal(v3.numpy(), v3w.numpy())


def test_lookup_contains_ls_delete(service, entry, lm):
    key, data, cache = entry
    assert service.put_raw(key, data) == 201  # lookups by token ids find entries stored under clear keys
    st = Store.open(service.url(TOK_A), memory_bytes=0)
    st.put(key, data)
    ids = [int(x) for x in cache.token_ids]
    q = {"model": lm.fingerprint.id, "codec": "balanced-test", "token_ids": ids + [11, 12, 13]}
    # 300 tokens is not a chunk boundary of 303: the longest cached chunk-boundary prefix is absent
    s, _, b = service.request("POST", "/v1/lookup", body=json.dumps(q).encode())
    assert s == 200 and json.loads(b)["n_tokens"] == 0
    q["token_ids"] = ids
    s, _, b = service.request("POST", "/v1/lookup", body=json.dumps(q).encode())
    ans = json.loads(b)
    assert s == 200 and ans["n_tokens"] == 300 and ans["key"] == key.to_str()
    assert [e["n_tokens"] for e in ans["entries"]] == [300]
    s, _, b = service.request("POST", "/v1/lookup", body=json.dumps({**q, "text": "hello", "token_ids": None}).encode())
    assert s == 400
    del q["token_ids"]
    s, _, b = service.request("POST", "/v1/lookup", body=json.dumps({**q, "text": "hello"}).encode())
    assert s == 422 and "tokenizer" in json.loads(b)["error"]
    assert st.contains_many([key, StoreKey.for_tokens([1, 2], model=key.model, codec="x", namespace="a")]) == [True, False]
    assert st.longest_prefix(ids, model=lm.fingerprint.id, codec="balanced-test", namespace="a") == (key, 300)
    assert [r.key for r in st.ls()] == [key]
    assert st.rm(key) and not st.contains(key) and not st.rm(key)
    assert service.request("DELETE", path_of(key))[0] == 204 and service.request("DELETE", path_of(key))[0] == 404
    # the vLLM connector chains keys with its own chunk_tokens (a divisor of the entry's token count)
    from kvcodec.integrations.vllm.config import chunk_keys

    vkey = chunk_keys(ids, 300, model=key.model, codec=key.codec, namespace="a", chunk_tokens=100)[-1]
    assert vkey != key and st.put(vkey, data).ok and st.get(vkey) == data
    assert st.rm(vkey)


def test_auth_and_isolation(service, entry):
    key, data, cache = entry
    assert service.put_raw(key, data) == 201
    s, h, out = service.request("GET", path_of(key), token=None)
    assert s == 401 and "Bearer" in h["WWW-Authenticate"] and "missing bearer token" in out.decode()
    s, h, out = service.request("GET", path_of(key), token="not-a-valid-token")
    assert s == 401 and 'error="invalid_token"' in h["WWW-Authenticate"] and "invalid token" in out.decode()
    assert service.request("GET", path_of(key), token=TOK_B)[0] == 403, "tenant b must not read a's namespace"
    assert service.request("DELETE", path_of(key), token=TOK_B)[0] == 403
    assert service.put_raw(key, data, token=TOK_B) == 403
    assert service.put_raw(key, data, token=TOK_A_RO) == 403, "read-only token"
    assert service.request("GET", path_of(key), token=TOK_A_RO)[0] == 200
    # Store clients: each token is its own tenant view on the server, even for the same client key
    a = Store.open(service.url(TOK_A), memory_bytes=0)
    b = Store.open(service.url(TOK_B), memory_bytes=0)
    assert a.put(key, data).ok
    before = {r.key for r in service.stored()}
    assert b.ls() == [] and b.get(key) is None and not b.contains(key), "b sees nothing of a's"
    assert b.rm(key) is False and a.get(key) == data, "b cannot delete a's entry"
    kb = StoreKey.for_tokens(cache.token_ids, model=key.model, codec=key.codec, namespace="b")
    assert b.put(kb, data).ok and b.get(kb) == data
    assert [r.key for r in a.ls()] == [key], "a's listing does not show b's entry"
    with pytest.raises(KvcStoreError, match="401"):
        Store.open(service.url("wrong-token-123"), memory_bytes=0).put(key, data)
    with pytest.raises(KvcStoreError, match="403"):
        Store.open(service.url(TOK_A_RO), memory_bytes=0).put(kb, data)
    assert len({r.key for r in service.stored()} - before) == 1, "only b's own put added an entry"
    assert b.rm(kb) and a.rm(key)


def test_malformed_requests_are_clean_4xx_and_store_nothing(service, entry):
    key, data, cache = entry
    service.request("DELETE", path_of(key))
    before = [r.key for r in service.stored()]

    def put(k: str, body: bytes, **h: str) -> tuple[int, str]:
        s, _, b = service.request("PUT", f"/v1/entries/{k}", body=body, headers=h)
        return s, json.loads(b).get("error", "") if b else ""

    ks = key.to_str()
    assert put(ks, b"not a kvc file at all")[0] == 422
    assert put(ks, data[: len(data) // 2])[0] == 422                               # truncated
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 1
    assert put(ks, bytes(flipped))[0] == 422                                       # damaged chunk
    wrong = StoreKey.for_tokens(list(cache.token_ids[:299]) + [5], model=key.model, codec=key.codec, namespace="a")
    s, msg = put(wrong.to_str(), data)
    assert s == 422 and "token" in msg                                             # tokens do not hash to the key
    other_model = StoreKey.for_tokens(cache.token_ids, model="0" * 32, codec=key.codec, namespace="a")
    assert put(other_model.to_str(), data)[0] == 422                               # fingerprint is not the key's
    assert put("kvc1:bad:key", data)[0] == 400
    assert put(ks, data, **{"X-Kvc-Crc32c": "00000000"})[0] == 400                 # damaged in transit
    assert put(ks, data, **{"X-Kvc-Meta": "{not json"})[0] == 400
    assert put(ks, b"")[0] == 400
    assert put(ks, b"x" * (9 << 20))[0] == 413                                     # over --max-body 8M
    s, _, b = service.request("POST", "/v1/contains", body=b"{oops")
    assert s == 400 and "JSON" in json.loads(b)["error"]
    assert service.request("POST", "/v1/contains", body=b'{"keys": "nope"}')[0] == 400
    assert service.request("GET", "/v1/nothing-here")[0] == 404
    assert service.request("POST", path_of(key), body=b"x")[0] == 405
    assert {r.key for r in service.stored()} == set(before), "no malformed request may store anything"
    assert service.proc.poll() is None


def test_health_and_metrics(service, entry):
    key, data, _ = entry
    st = Store.open(service.url(TOK_A), memory_bytes=0)
    st.put(key, data)
    st.get(key)
    st.get(StoreKey.for_tokens([9, 9, 9], model=key.model, codec=key.codec, namespace="a"))
    s, _, b = service.request("GET", "/healthz", token=None)
    assert s == 200 and json.loads(b)["status"] == "ok"
    s, h, b = service.request("GET", "/metrics", token=None)
    text = b.decode()
    assert s == 200 and h["Content-Type"].startswith("text/plain")
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, v = line.rpartition(" ")
            vals[name] = float(v)
    assert vals['kvc_get_total{result="hit"}'] >= 1 and vals['kvc_get_total{result="miss"}'] >= 1
    assert vals["kvc_bytes_served_total"] >= len(data)
    assert vals["kvc_bytes_stored_total"] >= len(data)
    assert 0 < vals["kvc_hit_ratio"] < 1
    assert any(k.startswith("kvc_request_seconds_bucket") for k in vals)


def test_client_outage_is_a_clean_miss(tmp_path, entry):
    key, data, _ = entry
    svc = Service(tmp_path)
    try:
        st = Store.open(f"{tmp_path}/local,{svc.url(TOK_A)}?retry_interval=0.2")
        assert st.put(key, data).ok
    finally:
        svc.stop()
    st.memory.clear()
    assert st.get(key) == data                          # the local tier still has it
    remote_only = Store.open(svc.url(TOK_A) + "?timeout=1", memory_bytes=0)
    assert remote_only.get(key) is None                 # service down: a miss
    with pytest.raises(KvcStoreError, match="every persistent tier"):
        remote_only.put(key, data)


def test_a_quota_refusal_is_507_and_a_quota_error_at_the_client(tmp_path, entry):
    """A put past the tenant's bound (here one namespace more than tenant_namespaces) was a 503, which says
    "unavailable, retry later" of a refusal that no retry changes; it is 507 now, and KvcQuotaError at the
    kvc+http client. Another tenant's puts go on."""
    from kvcodec.errors import KvcQuotaError

    key, data, cache = entry
    svc = Service(tmp_path, extra=["--store", f"{tmp_path / 'capped'}?tenant_namespaces=1"])
    try:
        assert svc.put_raw(key, data) == 201          # tenant a's first namespace (its clear key's)
        with pytest.raises(KvcQuotaError, match="507.*tenant_namespaces=1"):
            Store.open(svc.url(TOK_A), memory_bytes=0).put(key, data)  # the client's key: a second partition
        kb = StoreKey.for_tokens(cache.token_ids, model=key.model, codec=key.codec, namespace="b")
        assert svc.put_raw(kb, data, token=TOK_B) == 201, "a's bound is a's alone"
    finally:
        svc.stop()


@pytest.mark.slow
def test_put_from_one_process_ask_from_another(tmp_path):
    """The done-when: one process stores (kvc ask prefills and puts), another process's ask hits."""
    from kvcodec.texts import load_text

    svc = Service(tmp_path, max_body="64M")
    try:
        doc = tmp_path / "doc.txt"
        doc.write_text(load_text("gpl3")[:1500])
        env = subprocess_env(KVC_TOKEN=TOK_A)

        def ask(question: str) -> dict:
            out = subprocess.run([sys.executable, "-m", "kvcodec", "ask", "--doc", str(doc), "--store",
                                  svc.url(), "--namespace", "a", "--max-new-tokens", "4", "--json", question],
                                 env=env, capture_output=True, text=True, timeout=600)
            assert out.returncode == 0, out.stderr[-2000:]
            return json.loads(out.stdout)

        first = ask("What is this license?")
        assert first["source"] == "prefill" and first["stored"]["stored_in"] == ["memory", "kdn"]
        second = ask("Who may copy it?")
        assert second["source"] == "store" and second["cached_tokens"] == second["context_tokens"] > 100
        assert len(svc.stored()) == 1
        with urllib.request.urlopen(svc.base + "/metrics") as r:
            assert 'kvc_get_total{result="hit"} 1.0' in r.read().decode()
    finally:
        svc.stop()
    assert os.path.isdir(svc.store_dir)
