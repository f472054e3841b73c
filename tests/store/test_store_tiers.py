"""LRU, directory tier, Store API, envelope and file range reader (no servers needed)."""

from __future__ import annotations

import logging
import os
import time

import pytest

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store import FileRangeReader, MemoryTier, Store, StoreKey, TenantKey, open_range_reader, parse_size
from kvcodec.store.tiers.directory import DirectoryTier
from kvcodec.store.tenant import AuthRangeReader
from kvcodec.store.tiers.base import FIXED_SIZE, decode_envelope, encode_envelope


def key(i: int, ns: str = "default") -> StoreKey:
    return StoreKey.for_tokens([i, i + 1, i + 2], model="m", codec="c", namespace=ns)


def blob(i: int, n: int = 1000) -> bytes:
    return bytes((i * 31 + j) & 0xFF for j in range(n))


# -- envelope --------------------------------------------------------------------------

def test_envelope_roundtrip_and_damage():
    k = key(1)
    env = encode_envelope(k, b"payload", {"a": [1, 2]})
    e = decode_envelope(env, k)
    assert (e.data, e.meta, e.key) == (b"payload", {"a": [1, 2]}, k)
    with pytest.raises(KvcFormatError, match="expected"):
        decode_envelope(env, key(2))
    with pytest.raises(KvcFormatError, match="truncated"):
        decode_envelope(env[:-1], k)
    with pytest.raises(KvcFormatError):
        decode_envelope(env + b"\0", k)
    with pytest.raises(KvcFormatError, match="magic"):
        decode_envelope(b"XXXX" + env[4:], k)
    for pos in (5, 8, 20, FIXED_SIZE + 3, len(env) - 1):
        bad = bytearray(env)
        bad[pos] ^= 0x40
        with pytest.raises(KvcFormatError):
            decode_envelope(bytes(bad), k)


def test_meta_validation():
    st = Store.open("mem://")
    with pytest.raises(KvcInputError):
        st.put(key(1), b"x", {"bad": object()})
    with pytest.raises(KvcInputError):
        st.put(key(1), b"x", {"nan": float("nan")})
    with pytest.raises(KvcInputError):
        st.put(key(1), "not bytes")  # type: ignore[arg-type]
    with pytest.raises(KvcInputError):
        st.get("kvc1:...")  # type: ignore[arg-type]
    st.put(key(1), bytearray(b"ok"), None)
    assert st.get(key(1)) == b"ok" and st.get_meta(key(1)) == {}


# -- memory ------------------------------------------------------------------------------

def test_memory_lru_cap():
    m = MemoryTier(max_bytes=2500)
    for i in range(3):
        m.put(key(i), blob(i))
    assert m.usage() == (2, 2000)
    assert m.get(key(0)) is None and m.get(key(1)) == blob(1)
    m.put(key(3), blob(3))  # evicts key(2): key(1) was used more recently
    assert m.contains(key(1)) and not m.contains(key(2)) and m.contains(key(3))
    m.put(key(9), blob(9, 5000))  # larger than the cap: not kept
    assert not m.contains(key(9))
    assert m.stats()["evictions"] == 2


# -- directory -------------------------------------------------------------------------------

def test_directory_roundtrip_restart_and_ls(tmp_path):
    d = tmp_path / "store"
    st = Store.open(str(d))
    res = st.put(key(1), blob(1), {"n_layers": 30})
    assert res.ok and res.stored_in == ["memory", "directory"]
    st.put(key(2, "other"), blob(2))
    st.close()
    st2 = Store.open(f"file://{d}")  # a new process would see the same
    assert st2.get(key(1)) == blob(1) and st2.get_meta(key(1)) == {"n_layers": 30}
    rows = st2.ls(with_meta=True)
    assert [r.key for r in rows] == sorted([key(1), key(2, "other")])
    assert st2.ls(namespace="other")[0].key == key(2, "other")
    assert st2.ls(namespace="other")[0].size == len(blob(2))
    s = st2.stats()
    dstat = s["tiers"][1]
    assert dstat["entries"] == 2 and dstat["hits"] == 1 and s["hits"] == 2  # get + get_meta
    assert st2.rm(key(1)) is True and st2.get(key(1)) is None and st2.rm(key(1)) is False
    assert st2.stats()["misses"] == 1


def test_directory_backfills_memory(tmp_path):
    st = Store.open(str(tmp_path / "s"))
    st.put(key(1), blob(1))
    st.memory.clear()
    assert st.get(key(1)) == blob(1)
    assert st.memory.contains(st.physical(key(1)))
    assert st.get(key(1)) == blob(1)
    tiers = {t["name"]: t for t in st.stats()["tiers"]}
    assert tiers["directory"]["hits"] == 1 and tiers["memory"]["hits"] == 1


def test_corrupt_file_is_a_miss_and_quarantined(tmp_path, caplog):
    st = Store.open(str(tmp_path / "s"))
    st.put(key(1), blob(1, 10000))
    st.put(key(2), blob(2))
    st.memory.clear()
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    p = tier.path_for(st.physical(key(1)))
    with open(p, "r+b") as f:
        f.seek(5000)
        b = f.read(1)
        f.seek(5000)
        f.write(bytes([b[0] ^ 1]))
    with caplog.at_level(logging.WARNING, logger="kvcodec.store"):
        assert st.get(key(1)) is None
    assert "corrupt" in caplog.text and "checksum" in caplog.text
    assert not os.path.exists(p)
    assert len(os.listdir(tmp_path / "s" / "quarantine")) == 1
    # a truncated file, and a file copied under the wrong name
    p2 = tier.path_for(st.physical(key(2)))
    os.truncate(p2, os.path.getsize(p2) - 10)
    assert st.get(key(2)) is None
    st.put(key(3), blob(3))
    os.makedirs(os.path.dirname(tier.path_for(st.physical(key(4)))), exist_ok=True)
    with open(tier.path_for(st.physical(key(3))), "rb") as src, open(tier.path_for(st.physical(key(4))), "wb") as dst:
        dst.write(src.read())
    st.memory.clear()
    assert st.get(key(4)) is None and st.get(key(3)) == blob(3)
    # the intact file under the wrong name is a plain miss: counted as neither damage nor moved
    assert tier.stats()["corrupt"] == 2 and os.path.exists(tier.path_for(st.physical(key(4))))
    assert len(os.listdir(tmp_path / "s" / "quarantine")) == 2


def test_size_cap_evicts_least_recently_used(tmp_path):
    st = Store.open(f"file://{tmp_path}/s?max_bytes=1G&fsync=0", memory_bytes=0)
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    st.put(key(99), blob(99, 2000))
    one = os.path.getsize(tier.path_for(st.physical(key(99))))  # envelope + seal of a 2000-byte entry
    st.rm(key(99))
    tier.max_bytes = 6 * one
    for i in range(5):
        st.put(key(i), blob(i, 2000))
        os.utime(tier.path_for(st.physical(key(i))), (1000 + i, 1000 + i))
    assert st.get(key(0)) == blob(0, 2000)  # touches key(0): now the most recent
    for i in range(5, 8):
        st.put(key(i), blob(i, 2000))
    n, b = tier.usage()
    assert b <= 6 * one
    assert st.contains(key(0)), "recently read entry must survive"
    assert not st.contains(key(1)), "least recently used entry must go first"
    assert tier.stats()["evictions"] >= 2


def test_gc_temp_files_grace(tmp_path):
    tier = DirectoryTier(tmp_path / "s", fsync=False)
    tier.put(key(1), blob(1))
    sub = os.path.dirname(tier.path_for(key(1)))
    fresh = os.path.join(sub, f".{key(1).digest}.99999.abc.tmp")
    old = os.path.join(sub, f".{key(2).digest}.99999.def.tmp")
    for p in (fresh, old):
        with open(p, "wb") as f:
            f.write(b"partial")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    r = tier.gc(grace_s=3600)
    assert r["tmp_removed"] == 1 and os.path.exists(fresh) and not os.path.exists(old)
    assert r["checked"] == 1 and r["corrupt_removed"] == 0
    assert tier.get(key(1)) == blob(1)
    assert tier.gc(grace_s=0)["tmp_removed"] == 1
    # temp files never show up as entries
    assert [i.key for i in tier.ls()] == [key(1)]


def test_refuses_foreign_directory(tmp_path):
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "thesis.tex").write_text("precious")
    with pytest.raises(KvcStoreError, match="not a kvcodec store"):
        Store.open(str(tmp_path / "home"))
    with pytest.raises(KvcStoreError):
        DirectoryTier(tmp_path / "nothing", create=False)


def test_put_reports_unwritable_directory(tmp_path):
    st = Store.open(str(tmp_path / "s"))
    tier: DirectoryTier = st.tier("directory")  # type: ignore[assignment]
    os.makedirs(os.path.dirname(tier.path_for(st.physical(key(1)))), exist_ok=True)
    # make the target a directory so the rename fails (works even as root)
    os.makedirs(tier.path_for(st.physical(key(1))))
    with pytest.raises(KvcStoreError, match="every persistent tier"):
        st.put(key(1), blob(1))
    assert not st.memory.contains(key(1))
    assert not [n for n in os.listdir(os.path.dirname(tier.path_for(st.physical(key(1))))) if n.endswith(".tmp")]


def test_store_url_parsing(tmp_path):
    st = Store.open("mem://?max_bytes=1M")
    assert [t.name for t in st.tiers] == ["memory"] and st.memory.max_bytes == 1 << 20
    st = Store.open(f"{tmp_path}/a, {tmp_path}/b", memory_bytes="2M")
    assert [t.name for t in st.tiers] == ["memory", "directory", "directory2"]
    st.put(key(1), blob(1))
    assert Store.open(f"{tmp_path}/b").get(key(1)) == blob(1)
    for bad in ["", "ftp://x", f"{tmp_path}/a,", "mem://?foo=1", f"file://{tmp_path}/a?bogus=1",
                "file://otherhost/x"]:
        with pytest.raises(KvcInputError):
            Store.open(bad)
    assert parse_size("10G") == 10 << 30 and parse_size("512MiB") == 512 << 20 and parse_size("1000") == 1000
    with pytest.raises(KvcInputError):
        parse_size("lots")


def test_store_reader(tmp_path):
    st = Store.open(str(tmp_path / "s"))
    data = os.urandom(100_000)
    st.put(key(1), data, {"x": 1})
    st.memory.clear()
    with st.reader(key(1)) as r:
        assert isinstance(r, AuthRangeReader) and isinstance(r.inner, FileRangeReader) and r.size == len(data)
        assert r.read(0, 10) == data[:10] and r.read(99_990, 10) == data[-10:]
        with pytest.raises(KvcFormatError):
            r.read(99_995, 10)
    assert st.reader(key(2)) is None


# -- FileRangeReader ---------------------------------------------------------------------------

def test_file_range_reader(tmp_path):
    p = tmp_path / "f.bin"
    data = os.urandom(50_000)
    p.write_bytes(data)
    with open_range_reader(str(p)) as r:
        assert r.size == len(data)
        assert r.read(123, 4567) == data[123:123 + 4567]
        assert r.read(len(data), 0) == b""
        with pytest.raises(KvcFormatError, match="short read"):
            r.read(49_999, 2)
        with pytest.raises(KvcInputError):
            r.read(-1, 2)
        # the file shrinks under an open reader: a short read, not silent garbage
        os.truncate(p, 1000)
        with pytest.raises(KvcFormatError, match="short read"):
            r.read(900, 200)
    assert open_range_reader(f"file://{p}").size == 1000
    w = FileRangeReader(p, base=100, length=50)
    assert w.read(0, 50) == data[100:150]
    with pytest.raises(KvcFormatError):
        w.read(10, 41)
    with pytest.raises(KvcFormatError):
        FileRangeReader(p, base=900, length=200)
    with pytest.raises(KvcStoreError, match="no such file"):
        FileRangeReader(tmp_path / "missing")
    with pytest.raises(KvcInputError):
        open_range_reader("s3://bucket/x")


def test_file_range_reader_refuses_what_is_not_a_regular_file(tmp_path):
    """A FIFO at the path held the open until a writer appeared (for ever: kvcodec.store.open_range_reader hung), a
    device read as an empty file; a store's entry reopened for a ranged read may not have become a symlink."""
    fifo = tmp_path / "entry.kve"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # a writer is there, so a blocking open returns (no hang here)
    try:
        with pytest.raises(KvcStoreError, match="not a regular file"):
            open_range_reader(str(fifo))
    finally:
        os.close(writer)
    with pytest.raises(KvcStoreError, match="not a regular file"):
        open_range_reader("/dev/null")
    real = tmp_path / "real.bin"
    real.write_bytes(b"x" * 100)
    link = tmp_path / "link.bin"
    link.symlink_to(real)
    assert FileRangeReader(link).size == 100  # a caller's own symlink is followed
    with pytest.raises(KvcStoreError, match="cannot open"):
        FileRangeReader(link, follow_symlinks=False)


@pytest.mark.parametrize("marker", ["[1]", "null", '"kvcodec-store"', "{", '{"format": "kvcodec-store", "layout": 9}'])
def test_odd_store_marker_is_a_store_error(tmp_path, marker):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "kvstore.json").write_text(marker)
    with pytest.raises(KvcStoreError):
        DirectoryTier(tmp_path / "s")


@pytest.mark.parametrize("url", [
    "s3://b/p?timeout=nan", "s3://b/p?timeout=inf", "s3://b/p?timeout=-1", "s3://b/p?timeout=\u0662",
    "s3://b/p?retry_interval=nan", "s3://b/p?retry_interval=-5",
    "kvc+http://h:1?timeout=nan", "kvc+http://h:1?timeout=-1", "kvc+http://h:1?put_timeout=inf",
    "kvc+http://h:1?retry_interval=nan",
])
def test_a_remote_tiers_seconds_are_finite_ascii_numbers(url):
    """float() took nan, inf, -1 and Arabic-Indic digits: the store opened and its every call then failed (S3's
    timeout=nan / inf) or a retry interval of nan / -5 was taken; now one line at open, as the Redis tier's already was."""
    if url.startswith("s3"):
        pytest.importorskip("boto3")
    with pytest.raises(KvcInputError, match="is not a number in ASCII digits"):
        Store.open(url, key=TenantKey.ephemeral())
    assert Store.open(url.split("?")[0] + "?timeout=2.5", key=TenantKey.ephemeral())


def test_an_http_range_source_with_credentials_in_its_url_is_refused_unshown():
    """open_range_reader('http://u:pw@host/x') connected without them (http.client sends no Authorization from a
    URL) and named the password in every error line."""
    with pytest.raises(KvcInputError, match="credentials") as exc:
        open_range_reader("http://u:s3cret@127.0.0.1:1/x.kvc")
    assert "s3cret" not in str(exc.value)


@pytest.mark.parametrize("url, msg", [
    ("http://h:0/", "port 0"), ("kvc+http://h:0", "port 0"), ("redis://h:0", "port 0"),
    ("redis+cluster://h:0", "port 0"), ("redis+cluster://h?nodes=a:0", "bad port '0'"),
    ("redis+cluster://h?nodes=a:\u0663", "bad port"), ("redis+cluster://h?nodes=a:99999", "bad port"),
    ("s3://b?endpoint_url=http://h:0", "port 0"), ("s3://b?endpoint_url=ftp://h", "must be http"),
    ("s3://b?endpoint_url=http://[::1", "bad s3 endpoint_url"),
    ("http://h/?max_bytes=0", "must be positive"), ("kvc+http://h:1?max_entry=0", "must be positive"),
    ("unix://", "names its socket's path"), ("unix:///", "names its socket's path"),
])
def test_store_urls_that_name_no_server_or_hold_nothing_are_refused(url, msg):
    """Each was accepted and read its own way: kvc+http://h:0 went to port 80 and redis+cluster://h:0 to 6379,
    http://h:0 and an ftp:// or port-0 S3 endpoint opened a store whose every read missed, a cluster node port
    '\\u0663' was taken as 3, and max_bytes=0 stored a source whose every entry was over its cap."""
    if url.startswith(("s3", "redis", "unix")):
        pytest.importorskip("boto3" if url.startswith("s3") else "redis")
    with pytest.raises(KvcInputError, match=msg):
        Store.open(url, key=TenantKey.ephemeral())


@pytest.mark.parametrize("meta", [{1: "a"}, {None: "a"}, {"a": [{"b": {2: 3}}]}])
def test_metadata_keys_must_be_strings(tmp_path, meta):
    """{1: 'a'} was stored as {'1': 'a'} and {None: 'a'} as {'null': 'a'}: a get gave back other metadata than
    the put's, silently."""
    st = Store.open(str(tmp_path / "s"), key=TenantKey.ephemeral())
    k = StoreKey.for_tokens(list(range(16)), model="m", codec="c")
    with pytest.raises(KvcInputError, match="metadata keys must be strings"):
        st.put(k, b"x" * 10, meta=meta)
    assert st.get(k) is None
