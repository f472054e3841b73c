"""The directory tier against the tier conformance suite (kvcodec.testing.store.TierTests).

Its own guarantees (crash safety, quarantine, per-partition caps, gc, layout upgrade) are in
test_store_tiers.py, test_store_crash.py and test_store_tenancy.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import DirectoryTier
from kvcodec.testing.store import TierBackend, TierTests, flip_last_byte


class TestDirectoryTier(TierTests):
    tier_cls = DirectoryTier

    @pytest.fixture
    def backend(self, tmp_path):
        d = tmp_path / "dir"
        return TierBackend(str(d), corrupt=lambda k: flip_last_byte(DirectoryTier(d).path_for(k)))


class TestDirectoryTierFileUrl(TestDirectoryTier):
    """The same tier opened by a ``file://`` URL with options."""

    @pytest.fixture
    def backend(self, tmp_path):
        d = tmp_path / "dir"
        return TierBackend(f"file://{d}?fsync=0&max_bytes=1G",
                           corrupt=lambda k: flip_last_byte(DirectoryTier(d).path_for(k)))


def test_a_plain_path_takes_the_same_options_as_a_file_url(tmp_path):
    """`--store st?max_bytes=1G` made a directory named "st?max_bytes=1G", uncapped; `st?bogus=1` was accepted."""
    from kvcodec.errors import KvcInputError
    from kvcodec.store.options import TierDefaults

    t = DirectoryTier.from_url(f"{tmp_path / 'st'}?max_bytes=1G&fsync=0", TierDefaults())
    assert t.root == str(tmp_path / "st") and t.max_bytes == 1 << 30 and t.fsync is False
    assert [p.name for p in tmp_path.iterdir()] == ["st"]
    for bad in ("?bogus=1", "?max_bytes=abc", "?fsync=maybe"):
        with pytest.raises(KvcInputError):
            DirectoryTier.from_url(f"{tmp_path / 'st2'}{bad}", TierDefaults())


def _keys(n: int, ns: str = "default") -> list:
    from kvcodec.store import StoreKey

    return [StoreKey.for_tokens(list(range(i, i + 16)), model="m", codec="c", namespace=ns) for i in range(n)]


def test_contains_agrees_with_get_on_damaged_and_foreign_entries(tmp_path):
    """contains said True for a truncated entry or one with a damaged head (os.path.isfile) while every get
    missed: longest_prefix chose it over an intact shorter prefix, and PUT If-None-Match: * refused to replace
    it. Damage inside a payload is found by the first get, which quarantines it; contains agrees from then on."""
    import os
    import shutil

    t = DirectoryTier(tmp_path / "s")
    ks = _keys(5)
    for k in ks:
        t.put(k, os.urandom(3000))
    p1 = t.path_for(ks[1])
    os.truncate(p1, os.path.getsize(p1) - 10)
    with open(t.path_for(ks[4]), "r+b") as f:  # the header's JSON broken
        f.seek(30)
        f.write(b"\xff\xfe")
    os.replace(t.path_for(ks[3]), t.path_for(ks[2]))  # ks[3]'s intact entry at ks[2]'s name: another key's
    assert [t.contains(k) for k in ks] == [True, False, False, False, False]
    assert t.counters.corrupt == 2 and os.path.exists(t.path_for(ks[2]))  # damage moved aside, foreign entry kept
    assert [t.get(k) is not None for k in ks] == [True, False, False, False, False]
    flip_last_byte(t.path_for(ks[0]))  # inside the payload
    assert t.get(ks[0]) is None and not t.contains(ks[0])
    shutil.copyfile(t.path_for(ks[2]), t.path_for(ks[3]))
    assert t.contains(ks[3]) and t.get(ks[3]) is not None


def test_contains_reads_an_entrys_head_only(tmp_path, monkeypatch):
    """A /v1/contains names up to 4,096 keys: a probe must not read whole entries (8 MiB each here)."""
    import os

    from kvcodec.store.tiers import directory

    t = DirectoryTier(tmp_path / "s")
    k = _keys(1)[0]
    t.put(k, os.urandom(8 << 20))
    got = []
    orig = directory.open_regular

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            b = self.f.read(n)
            got.append(len(b))
            return b

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(directory, "open_regular", lambda *a, **kw: Counting(orig(*a, **kw)))
    assert DirectoryTier(tmp_path / "s").contains(k) and 0 < sum(got) < 64 << 10  # a fresh process's probe


def test_a_planted_directory_or_symlink_is_one_line_and_never_followed(tmp_path):
    """A directory planted at an entry's name failed its put with "Is a directory"; a symlink planted at a
    partition or shard directory made puts write (and deletes unlink) outside the store, unseen by ls and gc."""
    import os

    from kvcodec.errors import KvcStoreError

    t = DirectoryTier(tmp_path / "s")
    k_dir, k_shard, k_part = _keys(2) + _keys(1, "other")
    os.makedirs(t.path_for(k_dir))
    with pytest.raises(KvcStoreError, match="a directory sits at the entry's name"):
        t.put(k_dir, b"x" * 100)
    assert not t.contains(k_dir) and t.get(k_dir) is None and t.delete(k_dir) is False
    outside = tmp_path / "outside"
    (outside / "part").mkdir(parents=True)
    (outside / "shard").mkdir()
    planted = outside / "shard" / os.path.basename(t.path_for(k_shard))
    planted.write_bytes(b"not the store's")
    os.makedirs(os.path.dirname(os.path.dirname(t.path_for(k_shard))), exist_ok=True)
    os.symlink(outside / "shard", os.path.dirname(t.path_for(k_shard)))
    os.symlink(outside / "part", os.path.dirname(os.path.dirname(t.path_for(k_part))))
    for k in (k_shard, k_part):
        with pytest.raises(KvcStoreError, match="never followed"):
            t.put(k, b"y" * 100)
        assert t.get(k) is None and not t.contains(k)
        for op in (t.range_entry, t.delete):
            with pytest.raises(KvcStoreError, match="never followed"):
                op(k)
    assert planted.read_bytes() == b"not the store's" and os.listdir(outside / "part") == []


def test_eviction_never_follows_a_symlink_planted_at_a_partition(tmp_path):
    """evict(partition) scanned objects/<partition> through a symlink planted there and unlinked the files of the
    directory it pointed to (four of five 600-byte files outside the store, under a 1,000-byte cap)."""
    import os

    t = DirectoryTier(tmp_path / "s", max_bytes=1000)
    outside = tmp_path / "outside" / "ab"
    outside.mkdir(parents=True)
    for i in range(5):
        (outside / f"{i:064x}.kve").write_bytes(b"z" * 600)
    os.symlink(tmp_path / "outside", os.path.join(t.objects, "victim"))
    assert t.evict("victim") == 0 and len(os.listdir(outside)) == 5


def test_quarantine_is_never_followed_through_a_symlink(tmp_path):
    """gc's purge of quarantine/ listed and unlinked every file over the grace period in whatever directory a
    symlink planted at quarantine/ pointed to, and a damaged entry was moved there, out of the store."""
    import os
    import time

    t = DirectoryTier(tmp_path / "s")
    precious = tmp_path / "precious"
    precious.mkdir()
    for i in range(3):
        (precious / f"doc{i}.txt").write_text("keep me")
        os.utime(precious / f"doc{i}.txt", (time.time() - 7200,) * 2)
    os.rmdir(t.quarantine)
    os.symlink(precious, t.quarantine)
    k = _keys(1)[0]
    t.put(k, b"x" * 500)
    flip_last_byte(t.path_for(k))
    assert t.get(k) is None  # damaged: a miss, and not moved through the symlink
    assert t.gc(grace_s=3600)["quarantine_purged"] == 0
    assert sorted(os.listdir(precious)) == ["doc0.txt", "doc1.txt", "doc2.txt"]


def test_a_put_makes_its_directories_as_the_umask_says(tmp_path):
    """A group-shared store (umask 002) needs group-writable partition and shard directories, as os.makedirs made
    them before puts made them level by level (0o755 then: another member of the group could not write)."""
    import os
    import stat

    old = os.umask(0o002)
    try:
        t = DirectoryTier(tmp_path / "s")
        k = _keys(1)[0]
        t.put(k, b"x" * 10)
    finally:
        os.umask(old)
    shard = os.path.dirname(t.path_for(k))
    assert stat.S_IMODE(os.stat(shard).st_mode) == 0o775 == stat.S_IMODE(os.stat(os.path.dirname(shard)).st_mode)


def test_gc_removes_only_the_stores_own_temp_files(tmp_path):
    """gc walked the whole root and deleted every old *.tmp in it: a root that also held other (hidden)
    directories, which the store accepts, lost their temp files too. Its own (an entry's, a marker's) still go."""
    import os
    import time

    root = tmp_path / "home"
    (root / ".cache").mkdir(parents=True)
    foreign = root / ".cache" / "download.tmp"
    foreign.write_text("someone else's")
    t = DirectoryTier(root)
    k = _keys(1)[0]
    t.put(k, b"x" * 10)
    shard = os.path.dirname(t.path_for(k))
    own = [os.path.join(shard, f".{k.digest}.123.abcdef.tmp"), str(root / "kvstore.json.123.abcd.tmp")]
    for p in own:
        open(p, "w").close()
    for p in own + [str(foreign)]:
        os.utime(p, (time.time() - 7200,) * 2)
    assert t.gc(grace_s=3600)["tmp_removed"] == 2
    assert foreign.exists() and not any(os.path.exists(p) for p in own)


def test_one_partitions_eviction_never_holds_up_anothers_put(tmp_path, monkeypatch):
    """Eviction scanned a partition (one tenant's: 100,000 files take seconds) under the tier's one lock, which
    every put takes: each other tenant's put waited for the scan to end."""
    import threading
    import time

    t = DirectoryTier(tmp_path / "s", max_bytes=10_000)
    entered, release = threading.Event(), threading.Event()
    orig = DirectoryTier._entry_files

    def slow(self, partition=None):
        if partition == "a":
            entered.set()
            release.wait(10)
        yield from orig(self, partition)

    monkeypatch.setattr(DirectoryTier, "_entry_files", slow)
    th = threading.Thread(target=t.evict, args=("a",))
    th.start()
    try:
        assert entered.wait(5)
        t0 = time.monotonic()
        t.put(_keys(1, "b")[0], b"x" * 100)  # a first put in "b" scans "b" for its size: never waits for "a"
        elapsed = time.monotonic() - t0
    finally:
        release.set()
        th.join()
    assert elapsed < 2, f"a put in another partition waited {elapsed:.1f} s for an eviction"
