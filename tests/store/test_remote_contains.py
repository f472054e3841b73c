"""Redis and S3 ``contains`` agree with ``get`` (as the directory tier's does): they answered from the name alone,
so a truncated value, one with a damaged head, or another key's envelope at the name was present while every get
missed (longest_prefix chose it over an intact shorter prefix; PUT If-None-Match: * refused to replace it). The
probe reads a value's head only; damage inside a payload is found by the first get, and contains agrees after."""

from __future__ import annotations

import os

import pytest

from kvcodec.store import RedisTier, S3Tier, StoreKey
from kvcodec.store.tiers.probe import PROBE_READ
from store_fixtures import redis_server, s3_server  # noqa: F401  (fixtures)


def _keys(n: int) -> list[StoreKey]:
    return [StoreKey.for_tokens(list(range(i, i + 16)), model="m", codec="c") for i in range(n)]


class _Raw:
    """Read and write a tier's raw values by key, behind its back."""

    def __init__(self, kind: str, request: pytest.FixtureRequest) -> None:
        self.kind = kind
        if kind == "redis":
            import redis

            srv = request.getfixturevalue("redis_server")
            self.r = redis.Redis(port=srv.port)
            self.tier = RedisTier(srv.url + "?timeout=2")
        else:
            srv = request.getfixturevalue("s3_server")
            self.cl, self.bucket = srv.client(), srv.bucket
            self.tier = S3Tier(srv.url(timeout="2"))
        self.requests: list[str] = []

    def name(self, k: StoreKey) -> str:
        return ("kvc:" if self.kind == "redis" else "store/") + k.to_str()

    def get(self, k: StoreKey) -> bytes:
        if self.kind == "redis":
            return bytes(self.r.get(self.name(k)))
        return self.cl.get_object(Bucket=self.bucket, Key=self.name(k))["Body"].read()

    def set(self, k: StoreKey, b: bytes) -> None:
        if self.kind == "redis":
            self.r.set(self.name(k), b)
        else:
            self.cl.put_object(Bucket=self.bucket, Key=self.name(k), Body=b)


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_contains_agrees_with_get_on_damaged_and_foreign_values(kind, request):
    raw = _Raw(kind, request)
    t = raw.tier
    ks = _keys(6)
    for k in ks:
        t.put(k, os.urandom(3000))
    raw.set(ks[1], raw.get(ks[1])[:-10])                       # truncated
    b = bytearray(raw.get(ks[4]))
    b[30:32] = b"\xff\xfe"                                     # the header's JSON broken
    raw.set(ks[4], bytes(b))
    raw.set(ks[2], raw.get(ks[3]))                             # another key's intact envelope at the name
    raw.set(ks[5], b"")                                        # an empty value
    want = [True, False, False, True, False, False]
    assert [t.contains(k) for k in ks] == want
    assert t.contains_many(ks) == want and t.contains_many(ks[::-1]) == want[::-1]
    assert [t.get(k) is not None for k in ks] == want
    b = bytearray(raw.get(ks[0]))
    b[-1] ^= 1                                                 # inside the payload: seen by the first get
    raw.set(ks[0], bytes(b))
    assert t.contains(ks[0])
    assert t.get(ks[0]) is None and not t.contains(ks[0]) and t.contains_many(ks[:1]) == [False]
    if kind == "redis":
        raw.r.delete(raw.name(ks[3]))
        raw.r.hset(raw.name(ks[3]), "f", "v")  # another type at the name: a miss, not the round's failure
        assert t.contains_many(ks[2:4] + _keys(8)[7:]) == [False, False, False]


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_contains_reads_a_values_head_only(kind, request, monkeypatch):
    """A /v1/contains names up to 4,096 keys: a probe must not read whole values (4 MiB here)."""
    raw = _Raw(kind, request)
    t = raw.tier
    k = _keys(1)[0]
    t.put(k, os.urandom(4 << 20))
    sizes: list[int] = []
    if kind == "redis":
        orig_pipe = t.r.pipeline

        def pipeline(*a, **kw):
            p = orig_pipe(*a, **kw)
            ex = p.execute
            p.execute = lambda *a2, **kw2: [sizes.append(len(x)) or x if isinstance(x, bytes) else x
                                           for x in ex(*a2, **kw2)]
            return p

        monkeypatch.setattr(t.r, "pipeline", pipeline)
        monkeypatch.setattr(t.r, "get", lambda *a: pytest.fail("contains read the whole value"))
    else:
        orig_get = t.s3.get_object

        def get_object(**kw):
            assert "Range" in kw, "contains read the whole object"
            resp = orig_get(**kw)
            sizes.append(int(resp["ContentLength"]))
            return resp

        monkeypatch.setattr(t.s3, "get_object", get_object)
    assert t.contains(k)
    assert 0 < sum(sizes) <= PROBE_READ
