"""The KDN client tier (``kvc+http://``) against the tier conformance suite, on a real ``kvc serve`` process.

The service stores only sound ``.kvc`` files whose token ids hash to their key, for the namespaces of
the caller's token, so the entries here are real (tiny) ``.kvc`` files of a synthetic model, and the
test keys name that model and the token's namespaces. No embedded model is needed; the protocol itself,
auth and real model entries are in tests/service/test_kdn_service.py.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import pytest

from kvcodec.store import DirectoryTier, KdnTier, Store, StoreKey
from kvcodec.testing.store import TierBackend, TierTests, flip_last_byte
from store_fixtures import kdn_server  # noqa: F401  (fixture)


@lru_cache(maxsize=1)
def _fingerprint():
    from kvcodec.core.fingerprint import ModelFingerprint

    return ModelFingerprint("synthetic", 2, 2, (4, 4), '{"rope_theta": 10000.0}', "a" * 64, "b" * 64, "float32",
                            config_sha256="c" * 64)


@lru_cache(maxsize=64)
def kvc_of(first: int, n_tokens: int, variant: int) -> bytes:
    """A lossless ``.kvc`` of a synthetic 2-layer cache holding token ids ``first .. first+n_tokens-1``."""
    import torch

    from kvcodec.api import encode
    from kvcodec.core.kvcache import KVCache

    g = np.random.default_rng(first * 1000 + variant)
    ks = [torch.from_numpy(g.standard_normal((2, n_tokens, 4)).astype(np.float32)) for _ in range(2)]
    vs = [torch.from_numpy(g.standard_normal((2, n_tokens, 4)).astype(np.float32)) for _ in range(2)]
    data = encode(KVCache(ks, vs, np.arange(first, first + n_tokens), _fingerprint()), preset="raw").data
    assert data is not None
    return data


class TestKdnTier(TierTests):
    tier_cls = KdnTier
    model = _fingerprint().id       # the service checks that an entry's model is the key's
    namespaces = ("a", "b")         # the namespaces of the test token
    free_fields = ("codec",)        # model and namespace are fixed by the above
    opaque_payloads = False         # only .kvc files are accepted (so no empty payload)
    large_tokens = 49_152           # a 6.3 MB .kvc

    def payload(self, i: int, size: int = 30_000, *, variant: int = 0, n_tokens: int = 256) -> bytes:
        return kvc_of(i, n_tokens, variant)

    @pytest.fixture
    def backend(self, kdn_server):  # noqa: F811
        def corrupt(k: StoreKey) -> None:
            # the service's own directory tier holds the entry under its name for the tenant;
            # its seal names the key the client sent
            rows = [r for r in DirectoryTier(kdn_server.store_dir).ls(with_meta=True)
                    if (r.meta or {}).get("key") == k.to_str()]
            assert len(rows) == 1, rows
            flip_last_byte(DirectoryTier(kdn_server.store_dir).path_for(rows[0].key))

        self.server = kdn_server
        return TierBackend(kdn_server.url(timeout="2", retry_interval="0.2"), corrupt=corrupt, stop=kdn_server.stop)

    def assert_damage_handled(self, store: Store, tier_name: str) -> None:
        """The service reads the damage (and quarantines the entry); the client sees a plain miss."""
        assert len(os.listdir(self.server.store_dir / "quarantine")) == 1
        assert self._tier_stats(store, tier_name)["misses"] >= 1


def test_a_hostile_servers_deeply_nested_json_is_one_store_error_line():
    """JSON nested 30,000 deep in an entry's meta header, a listing, a contains answer or whoami escaped from the
    client as RecursionError (a malformed whoami as JSONDecodeError): a hostile KDN server crashed its client. Now
    the entry is a miss (its seal is gone with its meta), and the rest are one KvcStoreError line."""
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvcodec.errors import KvcStoreError
    from kvcodec.store import TenantKey
    from kvcodec.store.tiers.base import crc32c

    deep = "[" * 30000 + "]" * 30000

    class Hostile(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def _send(self, body: bytes, headers=()):
            self.send_response(200)
            for k, v in headers:
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if "whoami" in self.path or "/v1/entries?" in self.path:
                return self._send(deep.encode())
            self._send(b"abc", [("X-Kvc-Meta", deep[:20000]), ("X-Kvc-Crc32c", f"{crc32c(b'abc'):08x}")])

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self._send(('{"found": ' + deep + "}").encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Hostile)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        url = f"kvc+http://127.0.0.1:{srv.server_port}?timeout=5"
        t = KdnTier(url)
        k = StoreKey.for_tokens([1, 2, 3], model="m", codec="c")
        assert t.get_entry(k).meta == {}
        with pytest.raises(KvcStoreError, match="not JSON"):
            list(t.ls())
        with pytest.raises(KvcStoreError, match="not JSON"):
            t.whoami()
        logging.disable(logging.WARNING)
        try:
            assert t.contains_many([k]) == [False]
            st = Store.open(url, key=TenantKey.ephemeral())
            assert st.get(k) is None  # no seal: refused, not a traceback
        finally:
            logging.disable(logging.NOTSET)
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_server_trickling_its_answer_is_cut_off_at_the_deadline():
    """ls, contains, put and delete went through urllib, whose timeout bounds each read only: a server sending its
    listing a byte every half second held ls for as long as it liked (timeout=1 took 20 s for 40 bytes). Now the
    tier's total deadline (max of timeout and put_timeout) ends it, as it already ended entry reads."""
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvcodec.errors import KvcStoreError

    class Trickle(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "400")
            self.end_headers()
            try:
                for _ in range(400):
                    self.wfile.write(b" ")
                    self.wfile.flush()
                    time.sleep(0.5)
            except OSError:
                pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = KdnTier(f"kvc+http://127.0.0.1:{srv.server_port}?timeout=1&put_timeout=1.5")
        t0 = time.monotonic()
        with pytest.raises(KvcStoreError, match="1.5 s deadline"):
            list(t.ls())
        assert time.monotonic() - t0 < 60  # 200 s without the deadline; generous for a loaded box
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.mark.parametrize("row", [
    '{"key": "%s", "size": 1e999}',  # int(inf): OverflowError escaped from ls
    '{"key": "%s", "size": -5}', '{"key": "%s", "size": true}', '{"key": "%s", "size": 1.5}',
    '{"key": "%s", "size": 1, "mtime": NaN}', '{"key": "%s", "size": 1, "mtime": "yesterday"}',
    '{"key": "%s", "size": 1, "meta": [1]}',
])
def test_a_hostile_listing_row_is_one_store_error_line(row):
    """A server's listing row was taken as it came: a size of 1e999 escaped as OverflowError (a traceback from
    Store.ls), -5, true and 1.5 became sizes, a NaN or a string became an mtime, a list a meta."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from kvcodec.errors import KvcStoreError

    key = StoreKey.for_tokens(list(range(16)), model="m", codec="c").to_str()
    body = ('{"entries": [' + row % key + "]}").encode()

    class Lister(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Lister)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = KdnTier(f"kvc+http://127.0.0.1:{srv.server_port}?timeout=5")
        with pytest.raises(KvcStoreError, match="malformed listing"):
            list(t.ls(with_meta=True))
    finally:
        srv.shutdown()
        srv.server_close()


def test_a_contains_answer_of_anything_but_json_booleans_is_a_miss_and_one_line(caplog):
    """The client read a server's "found" values with bool(), so "false" (a non-empty string), 1 or {} said the
    entry was there: longest_prefix chose it and the load missed. Now anything but true/false is a malformed
    answer: one warning line, every key of it a miss."""
    import json
    import logging
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    answers: list = []

    class Odd(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps({"found": answers[0]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Odd)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        t = KdnTier(f"kvc+http://127.0.0.1:{srv.server_port}?timeout=5")
        ks = [StoreKey.for_tokens([1, 2, i], model="m", codec="c") for i in range(2)]
        for odd in (["false", "false"], [1, 0], [{}, None], [True, "true"]):
            answers[:] = [odd]
            caplog.clear()
            with caplog.at_level(logging.WARNING, logger="kvcodec"):
                assert t.contains_many(ks) == [False, False], odd
            lines = [r.getMessage() for r in caplog.records if "malformed contains answer" in r.getMessage()]
            assert len(lines) == 1 and "\n" not in lines[0], caplog.text
        answers[:] = [[True, False]]
        assert t.contains_many(ks) == [True, False]
    finally:
        srv.shutdown()
        srv.server_close()
