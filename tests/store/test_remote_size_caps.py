"""Remote tiers check an object's size before reading it (issue 35): Redis and Redis Cluster ask the value's
length on the server (one round trip; an oversized value never crosses the network), S3 reads the GET's
Content-Length before its body; the cap is the HTTP tier's (``max_bytes``, default 1G).  An object over 1 MiB
is read head first: another key's envelope planted under the asked name (which a reader must keep), or one
announcing another length, costs a reader its first 64 KiB, not its payload.  Real servers on loopback
(redis-server, a 3-master cluster, moto)."""

from __future__ import annotations

import random

import pytest

from kvcodec.errors import KvcInputError, KvcStoreError
from kvcodec.store import StoreKey
from kvcodec.store.tiers.base import DEFAULT_MAX_ENTRY, HEAD_READ, encode_envelope
from kvcodec.store.tiers.registry import open_tier
from store_fixtures import redis_cluster, redis_server, s3_server  # noqa: F401  (fixtures)

BIG = 2 << 20  # the planted object: 2 MiB, over a reader's max_bytes=1M
KEY = StoreKey.for_tokens(list(range(300)), model="m", codec="c")


def _payload() -> bytes:
    return random.Random(5).randbytes(BIG)


def _net_out(client) -> int:
    return int(client.info("stats")["total_net_output_bytes"])


@pytest.mark.requires_redis
def test_redis_reads_an_oversized_value_s_length_not_the_value(redis_server):  # noqa: F811
    import redis

    writer = open_tier(redis_server.url)
    writer.put(KEY, _payload())
    reader = open_tier(redis_server.url + "?max_bytes=1M")
    assert writer.max_entry == DEFAULT_MAX_ENTRY and reader.max_entry == 1 << 20
    raw = redis.Redis.from_url(redis_server.url)
    before = _net_out(raw)
    assert reader.get_entry(KEY) is None
    assert _net_out(raw) - before < 64 << 10, "the 2 MiB value was sent to a reader that refuses it"
    assert reader.counters.corrupt == 1 and reader.counters.misses == 1
    assert writer.get_entry(KEY).data == _payload(), "an oversized value is kept (someone else's cap may be larger)"
    with pytest.raises(KvcStoreError, match="max_bytes"):
        reader.put(KEY, _payload())
    small = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    reader.put(small, b"tiny")
    assert reader.get_entry(small).data == b"tiny" and reader.get_entry(StoreKey.for_tokens([9], model="m", codec="c")) is None
    reader._scripts = False  # a server that refuses EVAL: STRLEN, then GET only if it fits
    assert reader.get_entry(KEY) is None and reader.get_entry(small).data == b"tiny"
    with pytest.raises(KvcInputError):
        open_tier(redis_server.url + "?max_bytes=0")


@pytest.mark.requires_redis
def test_redis_cluster_checks_the_size_on_the_owning_master(redis_cluster):  # noqa: F811
    import redis

    writer = open_tier(redis_cluster.url)
    writer.put(KEY, _payload())
    reader = open_tier(redis_cluster.url + "&max_bytes=1M")
    nodes = [redis.Redis(host="127.0.0.1", port=p) for p in redis_cluster.ports]
    before = sum(_net_out(n) for n in nodes)
    assert reader.get_entry(KEY) is None
    assert sum(_net_out(n) for n in nodes) - before < 256 << 10
    assert reader.counters.corrupt == 1
    assert writer.get_entry(KEY).data == _payload()
    with pytest.raises(KvcStoreError, match="max_bytes"):
        reader.put(KEY, _payload())


def test_s3_checks_content_length_before_reading_the_body(s3_server, monkeypatch):  # noqa: F811
    writer = open_tier(s3_server.url("caps"))
    writer.put(KEY, _payload())
    reader = open_tier(s3_server.url("caps", max_bytes="1M"))

    def never(*a, **k):
        raise AssertionError("the body of an oversized object was read")

    monkeypatch.setattr(reader, "_read_body", never)
    assert reader.get_entry(KEY) is None
    assert reader.counters.corrupt == 1 and reader.counters.misses == 1
    monkeypatch.undo()
    assert writer.get_entry(KEY).data == _payload()
    with pytest.raises(KvcStoreError, match="max_bytes"):
        reader.put(KEY, _payload())
    small = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
    reader.put(small, b"tiny")
    assert reader.get_entry(small).data == b"tiny"


OTHER = StoreKey.for_tokens([7, 7, 7], model="m", codec="c")


def _planted() -> list[bytes]:
    """What a writer of the tier may put under KEY's name, each refused from its head: another key's intact
    envelope, and KEY's own envelope padded past the length it announces."""
    return [encode_envelope(OTHER, _payload(), {}), encode_envelope(KEY, b"x" * 1000, {}) + b"\0" * BIG]


@pytest.mark.requires_redis
def test_redis_reads_a_large_value_head_first(redis_server):  # noqa: F811
    import redis

    tier = open_tier(redis_server.url)
    tier.put(KEY, _payload())
    assert tier.get_entry(KEY).data == _payload(), "a sound large entry reads whole (head, then the rest)"
    raw = redis.Redis.from_url(redis_server.url)
    for value in _planted():
        raw.set(tier.rkey(KEY), value)
        for scripts in (True, False):
            tier._scripts = scripts
            before = _net_out(raw)
            assert tier.get_entry(KEY) is None
            assert _net_out(raw) - before < HEAD_READ + (16 << 10), "the planted payload crossed the network"
        assert raw.get(tier.rkey(KEY)) == value, "kept: it is not ours to delete"


def test_s3_reads_a_large_object_head_first(s3_server):  # noqa: F811
    tier = open_tier(s3_server.url("heads"))
    tier.put(KEY, _payload())
    assert tier.get_entry(KEY).data == _payload()
    read: list[int] = []
    inner = tier._read_body

    def counted(resp, op, limit=None, exact=False):
        out = inner(resp, op, limit, exact)
        read.append(len(out))
        return out

    tier._read_body = counted
    for value in _planted():
        tier.s3.put_object(Bucket=tier.bucket, Key=tier.name_of(KEY), Body=value)
        read.clear()
        assert tier.get_entry(KEY) is None
        assert sum(read) <= HEAD_READ, read


def _forgeries(tier, st, key) -> list[bytes]:
    """Envelopes of the asked (physical) key a writer of the tier can make: no seal; the honest seal copied
    onto a longer payload.  Only the reader's Store can tell; it does so from the header (its seal check)."""
    phys = st.physical(key)
    honest = tier.get_entry(phys)
    return [encode_envelope(phys, _payload(), {}), encode_envelope(phys, _payload() + b"x", honest.meta)]


@pytest.mark.requires_redis
def test_a_forgery_under_the_asked_name_is_refused_from_its_header(redis_server, monkeypatch):  # noqa: F811
    import redis

    from kvcodec.store import Store

    monkeypatch.setenv("KVC_STORE_KEY", "5a" * 32)
    st = Store.open(redis_server.url, memory_bytes=0)
    assert st.put(KEY, _payload()).ok and st.get(KEY) == _payload()
    tier = next(t for t in st.tiers if t.persistent)
    raw = redis.Redis.from_url(redis_server.url)
    for value in _forgeries(tier, st, KEY):
        raw.set(tier.rkey(st.physical(KEY)), value)
        before = _net_out(raw)
        assert st.get(KEY) is None
        assert _net_out(raw) - before < HEAD_READ + (16 << 10), "the forged payload crossed the network"


def test_s3_a_forgery_under_the_asked_name_is_refused_from_its_header(s3_server, monkeypatch):  # noqa: F811
    from kvcodec.store import Store

    monkeypatch.setenv("KVC_STORE_KEY", "5a" * 32)
    st = Store.open(s3_server.url("forged"), memory_bytes=0)
    assert st.put(KEY, _payload()).ok and st.get(KEY) == _payload()
    tier = next(t for t in st.tiers if t.persistent)
    read: list[int] = []
    inner = tier._read_body

    def counted(resp, op, limit=None, exact=False):
        out = inner(resp, op, limit, exact)
        read.append(len(out))
        return out

    for value in _forgeries(tier, st, KEY):
        tier.s3.put_object(Bucket=tier.bucket, Key=tier.name_of(st.physical(KEY)), Body=value)
        read.clear()
        tier._read_body = counted
        assert st.get(KEY) is None
        tier._read_body = inner
        assert sum(read) <= HEAD_READ, read


def test_s3_sends_a_planted_value_s_head_not_the_value(s3_server):  # noqa: F811
    """Reads are ranged: of a planted 2 MiB object the server sends at most HEAD_FIRST bytes (a streamed GET made it
    send the whole value even though the reader stopped after the head). A sound large entry reads whole in two GETs,
    the second pinned to the first's ETag: an object replaced between them is a miss, never a mix of two values.
    An empty object (no envelope; a ranged GET of it is a 416) is dropped like any corrupt one."""
    from kvcodec.store.tiers.base import HEAD_FIRST

    tier = open_tier(s3_server.url("ranged"))
    sent: list[int] = []
    real_get = tier.s3.get_object

    def get_object(**kw):
        assert "Range" in kw, kw  # every read asks for a range: the server never streams a whole object unasked
        resp = real_get(**kw)
        sent.append(int(resp["ContentLength"]))
        return resp

    tier.s3.get_object = get_object
    tier.put(KEY, _payload())
    assert tier.get_entry(KEY).data == _payload() and len(sent) == 2  # head range, then the rest
    for value in _planted():
        tier.s3.put_object(Bucket=tier.bucket, Key=tier.name_of(KEY), Body=value)
        sent.clear()
        assert tier.get_entry(KEY) is None
        assert sent and sum(sent) <= HEAD_FIRST, sent

    tier.s3.delete_object(Bucket=tier.bucket, Key=tier.name_of(KEY))
    tier.put(KEY, _payload())
    other = encode_envelope(KEY, random.Random(9).randbytes(BIG), {})

    def replaced_between(**kw):
        resp = get_object(**kw)
        if kw["Range"].startswith("bytes=0-"):  # after the head is read, someone replaces the object
            real_put(Bucket=tier.bucket, Key=tier.name_of(KEY), Body=other)
        return resp

    real_put = tier.s3.put_object
    tier.s3.get_object = replaced_between
    errors = tier.counters.errors
    assert tier.get_entry(KEY) is None and tier.counters.errors == errors + 1
    tier.s3.get_object = get_object
    assert tier.get_entry(KEY).data == random.Random(9).randbytes(BIG)  # the new value, whole, on the next read

    empty = StoreKey.for_tokens([4, 4], model="m", codec="c")
    real_put(Bucket=tier.bucket, Key=tier.name_of(empty), Body=b"")
    corrupt = tier.counters.corrupt
    assert tier.get_entry(empty) is None and tier.counters.corrupt == corrupt + 1
    tier.put(empty, b"fine")  # dropped, so the conditional put is not shadowed by the empty object
    assert tier.get_entry(empty).data == b"fine"


@pytest.mark.parametrize("cap", ["1M", None])
def test_s3_asks_for_a_refused_object_only_if_it_changed(s3_server, cap):  # noqa: F811
    """An object the tier refused from its head (another key's envelope, a malformed one, one over max_bytes) is
    remembered by its ETag: the next read asks If-None-Match and the server answers 304 with no body, until the
    object changes; a new version is read and judged afresh (a sound one is returned)."""
    # cap 1M: the 2 MiB planted values are refused by their size; default cap: by their heads
    tier = open_tier(s3_server.url("refused", **({"max_bytes": cap} if cap else {})))
    calls: list[dict] = []
    real_get = tier.s3.get_object

    def get_object(**kw):
        calls.append(kw)
        return real_get(**kw)

    tier.s3.get_object = get_object
    for value in [*_planted(), *([encode_envelope(KEY, b"y" * BIG, {})] if cap else [])]:  # a sound one, too large
        tier.s3.put_object(Bucket=tier.bucket, Key=tier.name_of(KEY), Body=value)
        calls.clear()
        assert tier.get_entry(KEY) is None
        assert "IfNoneMatch" not in calls[-1] or len(calls) == 1  # a new version: read (the old ETag does not match)
        misses, n = tier.counters.misses, len(calls)
        for _ in range(3):
            assert tier.get_entry(KEY) is None
        assert tier.counters.misses == misses + 3
        assert len(calls) == n + 3 and all(c.get("IfNoneMatch") for c in calls[n:])  # one 304 each, no range read
    tier.s3.delete_object(Bucket=tier.bucket, Key=tier.name_of(KEY))
    tier.put(KEY, b"sound")
    assert tier.get_entry(KEY).data == b"sound"  # the name's new object is read as usual


def test_s3_remembers_a_forgery_its_seal_refused_for_readers_that_check_seals(s3_server, monkeypatch):  # noqa: F811
    """A forgery under the asked name (the key's own envelope, no valid seal) is refused by the reader's seal from
    its head; the tier remembers that version by ETag for seal-checking readers, so the next reads are 304s with no
    body until the object changes. A read without a seal check (the tier alone) is not answered from that memo."""
    from kvcodec.store import Store

    monkeypatch.setenv("KVC_STORE_KEY", "5a" * 32)
    st = Store.open(s3_server.url("forged-memo"), memory_bytes=0)
    assert st.put(KEY, _payload()).ok
    tier = next(t for t in st.tiers if t.persistent)
    phys = st.physical(KEY)
    answers: list[int] = []  # per GET: 200/206, or the status it failed with (304: not modified, no body)
    real_get = tier.s3.get_object

    def get_object(**kw):
        try:
            resp = real_get(**kw)
        except Exception as e:
            answers.append(int(e.response["ResponseMetadata"]["HTTPStatusCode"]))
            raise
        answers.append(int(resp["ResponseMetadata"]["HTTPStatusCode"]))
        return resp

    tier.s3.get_object = get_object
    for value in _forgeries(tier, st, KEY):
        tier.s3.put_object(Bucket=tier.bucket, Key=tier.name_of(phys), Body=value)
        answers.clear()
        assert st.get(KEY) is None and answers == [206]  # a new version: its head is read and its seal refuses it
        for _ in range(3):
            assert st.get(KEY) is None
        assert answers == [206, 304, 304, 304]
        raw = tier.get_entry(phys)  # no seal check: the object is read, not taken for refused
        assert answers[4:] == [206, 206] and raw is not None and raw.key == phys
    tier.s3.delete_object(Bucket=tier.bucket, Key=tier.name_of(phys))
    assert st.put(KEY, _payload()).ok and st.get(KEY) == _payload()  # a sound new version is read as usual
