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
