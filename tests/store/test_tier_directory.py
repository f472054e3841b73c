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
