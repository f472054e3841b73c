"""The Redis tier against the tier conformance suite, on a real redis-server (kvcodec.testing.store.TierTests).

Its outage recovery, password redaction and URL validation are in test_store_redis.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import RedisTier, StoreKey
from kvcodec.testing.store import TierBackend, TierTests
from store_fixtures import redis_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.requires_redis


class TestRedisTier(TierTests):
    tier_cls = RedisTier

    @pytest.fixture
    def backend(self, redis_server):  # noqa: F811
        import redis

        r = redis.Redis(port=redis_server.port)

        def corrupt(k: StoreKey) -> None:
            n = "kvc:" + k.to_str()
            b = bytearray(r.get(n))
            b[-1] ^= 1
            r.set(n, bytes(b))

        yield TierBackend(redis_server.url + "?timeout=0.5&retry_interval=0.2", corrupt=corrupt, stop=redis_server.stop)
        r.close()
