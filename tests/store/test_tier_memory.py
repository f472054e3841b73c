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
