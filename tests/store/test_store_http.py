"""HTTP range reads against a real nginx on loopback, plus misbehaving servers."""

from __future__ import annotations

import http.server
import os
import random
import shutil
import socket
import threading
import time

import pytest

from kvcodec.errors import KvcFormatError, KvcInputError, KvcStoreError
from kvcodec.store import HttpRangeReader, Store, StoreKey, open_range_reader
from kvcodec.store.tiers.directory import DirectoryTier
from store_fixtures import free_port, nginx_server  # noqa: F401  (fixture)


def key(i: int) -> StoreKey:
    return StoreKey.for_tokens(list(range(i, i + 512)), model="m", codec="c", namespace="pub")


@pytest.mark.requires_nginx
def test_range_reads_from_nginx(nginx_server):  # noqa: F811
    data = random.Random(5).randbytes(1_000_003)
    (nginx_server.root / "blob.kvc").write_bytes(data)
    url = nginx_server.base + "blob.kvc"
    with open_range_reader(url) as r:
        assert isinstance(r, HttpRangeReader) and r.size == len(data)
        rng = random.Random(1)
        for _ in range(20):
            off = rng.randrange(len(data))
            n = rng.randrange(1, min(70_000, len(data) - off) + 1)
            assert r.read(off, n) == data[off:off + n]
        assert r.read(0, 1) == data[:1] and r.read(len(data) - 1, 1) == data[-1:]
        assert r.read_all() == data
        fetched = r.bytes_fetched
        assert r.read(len(data), 0) == b"" and r.bytes_fetched == fetched
        with pytest.raises(KvcFormatError, match="short read"):
            r.read(len(data) - 10, 100)       # past the end: a short read
        with pytest.raises(KvcInputError):
            r.read(-5, 10)
    # a window (how the store reads an entry's payload)
    w = HttpRangeReader(url, base=1000, length=5000)
    assert w.size == 5000 and w.read(10, 20) == data[1010:1030]
    with pytest.raises(KvcFormatError):
        HttpRangeReader(url, base=len(data) - 10, length=11)
    # the object is replaced mid-read: detected through If-Range, not mixed
    r2 = HttpRangeReader(url)
    (nginx_server.root / "blob.kvc").write_bytes(data[:500_000] + b"x" * 10)
    os.utime(nginx_server.root / "blob.kvc", (1, 1))
    with pytest.raises((KvcStoreError, KvcFormatError)):
        r2.read(0, 100)
    # errors carry the HTTP status
    with pytest.raises(KvcStoreError, match="404"):
        HttpRangeReader(nginx_server.base + "missing.kvc")
    (nginx_server.root / "empty.kvc").write_bytes(b"")
    assert HttpRangeReader(nginx_server.base + "empty.kvc").size == 0


@pytest.mark.requires_nginx
def test_published_directory_store_over_nginx(nginx_server, tmp_path):  # noqa: F811
    src = Store.open(f"file://{tmp_path}/src?fsync=0")
    payloads = {i: random.Random(i).randbytes(200_000 + i) for i in range(3)}
    for i, b in payloads.items():
        src.put(key(i), b, {"i": i})
    shutil.copytree(tmp_path / "src", nginx_server.root / "store")   # "publish" = copy the tree
    base = nginx_server.base + "store/"

    remote = Store.open(base)
    assert remote.get(key(1)) == payloads[1] and remote.get_meta(key(1)) == {"i": 1}
    assert remote.get(key(7)) is None and not remote.contains(key(7)) and remote.contains(key(2))
    assert remote.longest_prefix(list(range(2, 2 + 700)), model="m", codec="c", namespace="pub")[1] == 512
    res = remote.put(key(5), b"x")
    assert res.tiers["http"] == "skipped: read-only"
    remote.memory.clear()
    with remote.reader(key(0)) as rd:                   # piecewise, payload only
        assert rd.size == len(payloads[0])
        assert rd.read(1234, 999) == payloads[0][1234:1234 + 999]

    # local directory in front: the first get back-fills it, later gets are local
    st = Store.open(f"{tmp_path}/cache,{base}")
    assert st.get(key(2)) == payloads[2]
    assert DirectoryTier(tmp_path / "cache").get(st.physical(key(2))) == payloads[2]
    http_tier = st.tier("http")
    st.memory.clear()
    hits = http_tier.counters.hits
    assert st.get(key(2)) == payloads[2] and http_tier.counters.hits == hits

    # damage on the server: a miss with a warning, never wrong bytes
    ph = src.physical(key(0))
    p = nginx_server.root / "store" / "objects" / ph.namespace / ph.digest[:2] / f"{ph.digest}.kve"
    raw = bytearray(p.read_bytes())
    raw[5000] ^= 0xFF
    p.write_bytes(bytes(raw))
    fresh = Store.open(base)
    assert fresh.get(key(0)) is None and http_tier.name == "http"
    assert fresh.tier("http").counters.corrupt == 1


# -- misbehaving servers (what nginx will not do on purpose) -----------------------------

class _LyingServer:
    """Answers every request with 206 + a Content-Range/Content-Length it then breaks."""

    def __init__(self, mode: str, size: int = 10_000) -> None:
        self.mode, self.size = mode, size
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.t = threading.Thread(target=self._serve, daemon=True)
        self.t.start()

    def _serve(self) -> None:
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                req = b""
                while b"\r\n\r\n" not in req:
                    chunk = c.recv(4096)
                    if not chunk:
                        break
                    req += chunk
                rng = [ln for ln in req.decode().split("\r\n") if ln.lower().startswith("range:")]
                a, b = map(int, rng[0].split("=")[1].split("-"))
                n = b - a + 1
                if self.mode == "short_body" and a > 0:
                    body, clen = b"z" * (n // 2), n // 2          # honest length, fewer bytes
                elif self.mode == "truncated" and a > 0:
                    body, clen = b"z" * (n // 2), n               # connection drops mid-body
                else:
                    body, clen = b"z" * n, n
                c.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{self.size}\r\n"
                          f"Content-Length: {clen}\r\nConnection: close\r\n\r\n".encode() + body)

    def close(self) -> None:
        self.sock.close()


@pytest.mark.parametrize("mode", ["short_body", "truncated"])
def test_short_http_reads_raise_format_error(mode):
    srv = _LyingServer(mode)
    try:
        r = HttpRangeReader(f"http://127.0.0.1:{srv.port}/x.kvc", timeout=5)
        assert r.size == 10_000
        with pytest.raises(KvcFormatError, match="short read"):
            r.read(100, 1000)
    finally:
        srv.close()


def test_server_without_range_support_and_refused_connection(tmp_path):
    (tmp_path / "f.bin").write_bytes(b"a" * 1000)

    class H(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *a, **kw):
            super().__init__(*a, directory=str(tmp_path), **kw)

        def log_message(self, *a):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        with pytest.raises(KvcStoreError, match="ignored the Range"):
            HttpRangeReader(f"http://127.0.0.1:{srv.server_address[1]}/f.bin")
        with pytest.raises(KvcStoreError, match="404"):
            HttpRangeReader(f"http://127.0.0.1:{srv.server_address[1]}/nope.bin")
    finally:
        srv.shutdown()
        srv.server_close()
    with pytest.raises(KvcStoreError, match="cannot connect"):
        HttpRangeReader(f"http://127.0.0.1:{free_port()}/x", timeout=2)
    # an http tier whose server is gone: misses, not exceptions
    st = Store.open(f"http://127.0.0.1:{free_port()}/store/?timeout=2")
    assert st.get(key(1)) is None and not st.contains(key(1))
    assert st.stats()["tiers"][1]["errors"] >= 1


# -- slow and lying servers: every HTTP read is bounded in time and size ------------------

class _HostileServer:
    """A loopback server that misbehaves in one ``mode`` after an honest ``Range: bytes=0-0`` probe."""

    def __init__(self, mode: str, size: int = 10_000) -> None:
        self.mode, self.size = mode, size
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/x.kve"

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._handle, args=(c,), daemon=True).start()

    def _handle(self, c: socket.socket) -> None:
        with c:
            try:
                req = b""
                while b"\r\n\r\n" not in req:
                    chunk = c.recv(4096)
                    if not chunk:
                        return
                    req += chunk
                if self.mode == "silent":
                    self.stop.wait(30)                       # accept, then never answer
                    return
                rng = [ln for ln in req.decode().split("\r\n") if ln.lower().startswith("range:")]
                a, b = map(int, rng[0].split("=")[1].split("-"))
                n = b - a + 1
                head = f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{self.size}\r\n"
                if a == 0 and b == 0 or self.mode == "honest":
                    c.sendall(f"{head}Content-Length: {n}\r\nConnection: close\r\n\r\n".encode() + b"z" * n)
                elif self.mode == "trickle":                 # one byte every 0.2 s: never a read timeout
                    c.sendall(f"{head}Content-Length: {n}\r\nConnection: close\r\n\r\n".encode())
                    for _ in range(n):
                        if self.stop.wait(0.2):
                            return
                        c.sendall(b"z")
                elif self.mode == "trickle_headers":
                    for ch in head.encode() * 1000:
                        if self.stop.wait(0.2):
                            return
                        c.sendall(bytes([ch]))
                elif self.mode == "announces_more":
                    c.sendall(f"{head}Content-Length: {n + 10}\r\nConnection: close\r\n\r\n".encode()
                              + b"z" * (n + 10))
                elif self.mode == "sends_more":           # no Content-Length, more bytes than asked
                    c.sendall(f"{head}Connection: close\r\n\r\n".encode() + b"z" * (n + 100_000))
                elif self.mode == "endless":              # no Content-Length, never stops
                    c.sendall(f"{head}Connection: close\r\n\r\n".encode())
                    while not self.stop.is_set():
                        c.sendall(b"z" * 65536)
                elif self.mode in ("arabic_range", "huge_range"):
                    digits = "\u0661\u0660\u0660" if self.mode == "arabic_range" else "9" * 5000
                    c.sendall(f"HTTP/1.1 206 Partial Content\r\nContent-Range: bytes {a}-{b}/{digits}\r\n"
                              f"Content-Length: {n}\r\nConnection: close\r\n\r\n".encode() + b"z" * n)
                elif self.mode == "gzip":
                    c.sendall(f"{head}Content-Length: {n}\r\nContent-Encoding: gzip\r\n"
                              "Connection: close\r\n\r\n".encode() + b"z" * n)
            except OSError:
                return

    def close(self) -> None:
        self.stop.set()
        self.sock.close()


@pytest.mark.parametrize("mode,match", [
    ("trickle", "deadline"),
    ("trickle_headers", "deadline"),
    ("silent", "read timeout|deadline"),
    ("announces_more", "more than the 1,000 asked"),
    ("sends_more", "more than the 1,000 body bytes"),
    ("endless", "more than the 1,000 body bytes"),
    ("gzip", "encoded body"),
    ("arabic_range", "bad Content-Range"),
    ("huge_range", "bad Content-Range"),
])
def test_hostile_server_cannot_hang_or_flood_a_reader(mode, match):
    from kvcodec.store import HttpLimits

    srv = _HostileServer(mode)
    try:
        t0 = time.monotonic()
        with pytest.raises(KvcStoreError, match=match):
            r = HttpRangeReader(srv.url, limits=HttpLimits(connect=1, read=1, total=2))
            r.read(100, 1000)
        assert time.monotonic() - t0 < 10, "the total deadline did not hold (a trickle takes 200 s)"
    finally:
        srv.close()


def test_honest_server_control():
    """The hostile-server harness itself serves correct ranges (so the test above can fail)."""
    srv = _HostileServer("honest")
    try:
        assert HttpRangeReader(srv.url, timeout=2).read(100, 1000) == b"z" * 1000
    finally:
        srv.close()


def test_http_tier_over_a_hostile_server_is_a_quick_miss():
    srv = _HostileServer("trickle")
    try:
        st = Store.open(f"http://127.0.0.1:{srv.port}/?timeout=1&connect_timeout=1&deadline=1.5",
                        memory_bytes=0)
        t0 = time.monotonic()
        assert st.get(key(1)) is None and st.reader(key(1)) is None
        assert time.monotonic() - t0 < 10  # unbounded, the trickle would take minutes
    finally:
        srv.close()


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:\u0668\u0660/store/",        # Arabic-Indic digits in the port
    "http://[::1/store/",                          # broken IPv6 literal
    "http://127.0.0.1:99999/store/",
    "http://127.0.0.1/store/?deadline=\u0662",
    "http://127.0.0.1/store/?timeout=nan",
    "http://127.0.0.1/store/?max_bytes=\u0661\u0660M",
    "http://127.0.0.1/store/?bogus=1",
])
def test_odd_http_store_urls_are_input_errors(url):
    with pytest.raises(KvcInputError):
        Store.open(url)
