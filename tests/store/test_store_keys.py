"""Store keys: deterministic, domain-separated, prefix-chained."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import KvcInputError
from kvcodec.store import Store, StoreKey, chunk_hashes, prefix_keys, root_digest
from store_fixtures import PY, subprocess_env

IDS = [(i * 7919 + 13) % 50000 for i in range(1000)]


def test_spec_worked_example():
    """The worked example in spec/store-keys.md, recomputed from the definition."""
    ids = list(range(300))
    h0 = hashlib.blake2b(
        b"kvcodec.store.key.v1\x00" + struct.pack("<I", 7) + b"smol-fp" + struct.pack("<I", 6)
        + b"cg-q4a" + struct.pack("<I", 8) + b"tenant-a", digest_size=32).digest()
    assert root_digest("smol-fp", "cg-q4a", "tenant-a") == h0
    h1 = hashlib.blake2b(h0 + struct.pack("<I", 256) + struct.pack("<256i", *ids[:256]), digest_size=32).digest()
    h2 = hashlib.blake2b(h1 + struct.pack("<I", 44) + struct.pack("<44i", *ids[256:]), digest_size=32).digest()
    hs = chunk_hashes(ids, model="smol-fp", codec="cg-q4a", namespace="tenant-a")
    assert hs == [h1, h2]
    k = StoreKey.for_tokens(ids, model="smol-fp", codec="cg-q4a", namespace="tenant-a")
    assert k.to_str() == f"kvc1:smol-fp:cg-q4a:tenant-a:300:{h2.hex()}"
    with open(__import__("pathlib").Path(__file__).parents[2] / "spec" / "store-keys.md") as f:
        spec = f.read()
    assert h1.hex() in spec and h2.hex() in spec and h0.hex() in spec


def test_deterministic_across_processes_and_hash_seeds():
    code = (
        "import json,sys\n"
        "from kvcodec.store import StoreKey, chunk_hashes\n"
        "ids=json.loads(sys.argv[1])\n"
        "print(json.dumps([h.hex() for h in chunk_hashes(ids, model='m', codec='c', namespace='t')]"
        " + [StoreKey.for_tokens(ids, model='m', codec='c', namespace='t').to_str(), str(hash('salted'))]))\n"
    )
    outs = []
    for seed in ("0", "12345", "random"):
        r = subprocess.run([PY, "-c", code, json.dumps(IDS)], capture_output=True, text=True,
                           env=subprocess_env(PYTHONHASHSEED=seed), timeout=60, check=True)
        outs.append(json.loads(r.stdout))
    here = [h.hex() for h in chunk_hashes(IDS, model="m", codec="c", namespace="t")]
    here.append(StoreKey.for_tokens(IDS, model="m", codec="c", namespace="t").to_str())
    for o in outs:
        assert o[:-1] == here
    # ...while Python's own hash really did differ between the processes
    assert len({o[-1] for o in outs}) > 1


def test_input_types_agree():
    ref = chunk_hashes(IDS)
    assert chunk_hashes(tuple(IDS)) == ref
    assert chunk_hashes(np.array(IDS, dtype=np.int64)) == ref
    assert chunk_hashes(np.array(IDS, dtype=np.int32)) == ref
    assert chunk_hashes(np.array(IDS, dtype=">i4")) == ref
    assert chunk_hashes(np.array([IDS])) == ref  # (1, N) batch of one
    torch = pytest.importorskip("torch")
    assert chunk_hashes(torch.tensor(IDS)) == ref


@pytest.mark.parametrize("bad", [[-1], [2**31], [1.5], ["a"], np.array([0.5]), np.zeros((2, 2), int)])
def test_bad_token_ids(bad):
    with pytest.raises(KvcInputError):
        chunk_hashes(bad)


def test_domain_separation():
    base = dict(model="m", codec="c", namespace="t")
    k = StoreKey.for_tokens(IDS, **base)
    others = [
        StoreKey.for_tokens(IDS, **{**base, "model": "m2"}),
        StoreKey.for_tokens(IDS, **{**base, "codec": "c2"}),
        StoreKey.for_tokens(IDS, **{**base, "namespace": "t2"}),
        StoreKey.for_tokens(IDS[:-1], **base),
        StoreKey.for_tokens(IDS[:-1] + [IDS[-1] + 1], **base),
    ]
    assert len({o.digest for o in others} | {k.digest}) == 6
    # length-prefixed fields: moving a character between fields changes the key
    assert root_digest("ab", "c", "t") != root_digest("a", "bc", "t")
    # a partial chunk never equals a full chunk with the same leading ids
    assert chunk_hashes([1, 2, 3], chunk=4)[0] != chunk_hashes([1, 2, 3, 0], chunk=4)[0]


def test_other_model_codec_tenant_miss():
    st = Store.open("mem://")
    k = StoreKey.for_tokens(IDS, model="m", codec="c", namespace="tenant-a")
    st.put(k, b"x")
    assert st.longest_prefix(IDS, model="m", codec="c", namespace="tenant-a") == (k, 1000)
    assert st.longest_prefix(IDS, model="m", codec="c", namespace="tenant-b") == (None, 0)
    assert st.longest_prefix(IDS, model="m", codec="c2", namespace="tenant-a") == (None, 0)
    assert st.longest_prefix(IDS, model="m2", codec="c", namespace="tenant-a") == (None, 0)


def test_prefix_keys_and_longest_prefix():
    ks = prefix_keys(IDS, model="m", codec="c")
    assert [k.n_tokens for k in ks] == [1000, 768, 512, 256]
    st = Store.open("mem://")
    assert st.longest_prefix(IDS, model="m", codec="c") == (None, 0)
    st.put(ks[3], b"256")
    st.put(ks[1], b"768")
    k, n = st.longest_prefix(IDS, model="m", codec="c")
    assert n == 768 and st.get(k) == b"768"
    # a longer prompt sharing the first 800 tokens finds the 768-token entry
    longer = IDS[:800] + [1] * 500
    assert st.longest_prefix(longer, model="m", codec="c")[1] == 768
    # a prompt diverging at token 300 only finds 256
    div = IDS[:300] + [7] * 700
    assert st.longest_prefix(div, model="m", codec="c")[1] == 256
    # the full-length (partial last chunk) entry is found by the same token list
    st.put(ks[0], b"all")
    assert st.longest_prefix(IDS, model="m", codec="c")[1] == 1000


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), min_size=1, max_size=700), st.integers(1, 300))
def test_chain_is_prefix_closed(ids, chunk):
    hs = chunk_hashes(ids, chunk)
    for i in range(len(hs)):
        n = min((i + 1) * chunk, len(ids))
        assert chunk_hashes(ids[:n], chunk)[-1] == hs[i]
    assert len(hs) == -(-len(ids) // chunk)


def test_key_string_roundtrip_and_validation():
    k = StoreKey.for_tokens(IDS, model="SmolLM2-135M.fp_1a2b", codec="q4+ans=1", namespace="default")
    assert StoreKey.from_str(k.to_str()) == k
    assert str(k) == k.to_str()
    for bad in ["", "kvc1:a:b:c:1", "kvc2:a:b:c:1:" + "0" * 64, "kvc1:a:b:c:x:" + "0" * 64,
                "kvc1:a:b:c:1:" + "0" * 63, "kvc1:a:b:c:1:" + "A" * 64, "kvc1:a b:b:c:1:" + "0" * 64,
                "kvc1::b:c:1:" + "0" * 64]:
        with pytest.raises(KvcInputError):
            StoreKey.from_str(bad)
    with pytest.raises(KvcInputError):
        StoreKey.for_tokens([], model="m", codec="c")
    with pytest.raises(KvcInputError):
        StoreKey.for_tokens(IDS, model="has:colon", codec="c")
    with pytest.raises(KvcInputError):
        chunk_hashes(IDS, chunk=0)


def test_spec_tenant_example():
    """The physical-key example of spec/store-keys.md §8.2, recomputed with hmac from the definition."""
    import hmac

    from kvcodec.store import TenantKey

    def h(k: bytes, m: bytes) -> bytes:
        return hmac.new(k, m, hashlib.sha256).digest()

    s = bytes(range(32))
    r = h(s, b"kvcodec.store.namespace.v2\x00" + struct.pack("<I", 8) + b"tenant-a")
    tag = h(r, b"tag")[:16].hex()
    ks = StoreKey.for_tokens(list(range(300)), model="smol-fp", codec="cg-q4a", namespace="tenant-a").to_str()
    phys = f"kvc1:kvs2:hmac-sha256:{tag}:0:{h(h(r, b'name'), ks.encode()).hex()}"
    assert TenantKey(s).namespace("tenant-a").physical(StoreKey.from_str(ks)).to_str() == phys
    # another secret, or another namespace under the same secret, names another object
    assert TenantKey(bytes(32)).namespace("tenant-a").physical(StoreKey.from_str(ks)).to_str() != phys
    with open(__import__("pathlib").Path(__file__).parents[2] / "spec" / "store-keys.md") as f:
        spec = f.read()
    assert r.hex() in spec and phys in spec


@pytest.mark.parametrize("bad", ["t\u0663", "\u0663", "tenant\n", "ten ant", "a" * 129, "ｔ", "t\udcff", ""])
def test_non_ascii_and_odd_ids_are_input_errors(bad):
    with pytest.raises(KvcInputError):
        StoreKey.for_tokens(IDS, model="m", codec="c", namespace=bad)
    with pytest.raises(KvcInputError):
        StoreKey.for_tokens(IDS, model=bad, codec="c")


@pytest.mark.parametrize("bad", [[True, False], {3: 4, 1: 2}, {3, 1, 2}, iter([1, 2, 3]), (x for x in [1, 2])])
def test_ids_that_only_iterate_or_are_booleans_are_refused(bad):
    """array('i', ...) took any iterable: a dict was keyed by its keys, a set in its arbitrary order, [True, False]
    as [1, 0] (entries stored under a key that names other tokens), and an iterator was consumed by the hashes
    before the key counted it (a TypeError traceback)."""
    with pytest.raises(KvcInputError, match="list, tuple or array of integers"):
        StoreKey.for_tokens(bad, model="m", codec="c")
    assert StoreKey.for_tokens(range(1, 4), model="m", codec="c") == StoreKey.for_tokens([1, 2, 3], model="m", codec="c")


@pytest.mark.parametrize("kw", [{"chunk": True}, {"chunk": 2.0}, {"min_tokens": "x"}, {"min_tokens": None},
                                {"min_tokens": 1.5}])
def test_chunk_and_min_tokens_are_integers(kw):
    """chunk=True keyed with chunks of one token (every probe of a default-chunked store missed), min_tokens="x"
    escaped as TypeError."""
    from kvcodec.store.keys import prefix_keys

    with pytest.raises(KvcInputError, match="must be"):
        prefix_keys(IDS, model="m", codec="c", **kw)
