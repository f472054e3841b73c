"""The in-process LRU against the tier conformance suite (kvcodec.testing.store.TierTests).

It does not outlive its Store, so only the tier-level tests apply; its Store-level behaviour (back-fill,
size cap, tenant views) is in test_store_tiers.py and test_store_tenancy.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import MemoryTier
from kvcodec.testing.store import TierBackend, TierTests


class TestMemoryTier(TierTests):
    tier_cls = MemoryTier

    @pytest.fixture
    def backend(self):
        return TierBackend("mem://?max_bytes=64M")


@pytest.mark.parametrize("url", ["mem://512M", "mem:///x", "mem://host?max_bytes=1M"])
def test_a_memory_url_with_a_host_or_path_is_refused(url):
    """mem://512M opened an LRU of the default 256 MiB, silently: the size goes in ?max_bytes=."""
    from kvcodec.errors import KvcInputError
    from kvcodec.store import Store

    with pytest.raises(KvcInputError, match="takes no host or path"):
        Store.open(url)
    assert Store.open("mem://?max_bytes=1M").memory.max_bytes == 1 << 20 and Store.open("mem://").memory
