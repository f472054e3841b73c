"""The read-only HTTP tier against the tier conformance suite: a directory store published by a real nginx.

Entries are written into the directory nginx serves (``TierBackend.writer_url``) and read over HTTP.
Range reads against nginx and misbehaving servers: test_store_http.py.
"""

from __future__ import annotations

import pytest

from kvcodec.store import DirectoryTier, HttpTier
from kvcodec.testing.store import TierBackend, TierTests, flip_last_byte
from store_fixtures import nginx_server  # noqa: F401  (fixture)

pytestmark = pytest.mark.requires_nginx


class TestHttpTier(TierTests):
    tier_cls = HttpTier

    @pytest.fixture
    def backend(self, nginx_server):  # noqa: F811
        published = nginx_server.root / "store"
        return TierBackend(nginx_server.base + "store/?timeout=2&connect_timeout=1&deadline=10",
                           corrupt=lambda k: flip_last_byte(DirectoryTier(published).path_for(k)),
                           stop=nginx_server.stop, writer_url=f"file://{published}?fsync=0")


@pytest.mark.parametrize("url", ["http://user:s3cret@127.0.0.1:1/x", "https://s3cret@h/x", "http://user:s3cret@h"])
def test_credentials_in_an_http_store_url_are_refused_unshown(url):
    """http://user:pass@host/ was never authenticated (no Authorization header is sent) and its password appeared in
    every warning and in the store's stats."""
    from kvcodec.errors import KvcInputError
    from kvcodec.store import Store

    with pytest.raises(KvcInputError, match="no credentials") as exc:
        Store.open(url)
    assert "s3cret" not in str(exc.value)
