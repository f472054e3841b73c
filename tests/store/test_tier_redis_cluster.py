"""The Redis Cluster tier against the tier conformance suite, on a real 3-master cluster (kvcodec.testing.store.TierTests).

A master killed or a slot migration during a run: test_store_distributed.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import RedisClusterTier, StoreKey
from kvcodec.testing.store import TierBackend, TierTests
from store_fixtures import redis_cluster  # noqa: F401  (fixture)

pytestmark = pytest.mark.requires_redis


class TestRedisClusterTier(TierTests):
    tier_cls = RedisClusterTier

    @pytest.fixture
    def backend(self, redis_cluster):  # noqa: F811
        from redis.cluster import RedisCluster as Client

        rc = Client(host="127.0.0.1", port=redis_cluster.ports[0])

        def corrupt(k: StoreKey) -> None:
            n = "kvc:" + k.to_str()
            b = bytearray(rc.get(n))
            b[-1] ^= 1
            rc.set(n, bytes(b))

        yield TierBackend(redis_cluster.url + "&timeout=0.5", corrupt=corrupt, stop=redis_cluster.stop)
        rc.close()
