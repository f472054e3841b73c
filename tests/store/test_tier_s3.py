"""The S3 tier against the tier conformance suite, on moto's S3 server (kvcodec.testing.store.TierTests).

Multipart uploads and first-writer-wins conditional puts: test_store_distributed.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import S3Tier, StoreKey
from kvcodec.testing.store import TierBackend, TierTests
from store_fixtures import s3_server  # noqa: F401  (fixture)


class TestS3Tier(TierTests):
    tier_cls = S3Tier

    @pytest.fixture
    def backend(self, s3_server):  # noqa: F811
        cl = s3_server.client()

        def corrupt(k: StoreKey) -> None:
            n = "store/" + k.to_str()
            b = bytearray(cl.get_object(Bucket=s3_server.bucket, Key=n)["Body"].read())
            b[-1] ^= 1
            cl.put_object(Bucket=s3_server.bucket, Key=n, Body=bytes(b))

        return TierBackend(s3_server.url(timeout="2", retry_interval="0.2", multipart="5M"),
                           corrupt=corrupt, stop=s3_server.stop)
