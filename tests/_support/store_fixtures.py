"""Pytest fixtures for real servers in the store tests: redis-server, a redis cluster, nginx, moto's S3, ``kvc serve``.

Import the fixtures into a test module (``from store_fixtures import redis_server``). The servers
themselves are kvcodec/testing/servers.py (shared with the benchmarks), except the KDN service, which
is kvcodec itself (:class:`KdnServer`); a missing binary skips the test with a clear reason (CI
installs them via ``.ci/services.sh``).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from kvcodec.testing.servers import (  # noqa: F401  (re-exported for the test modules)
    NGINX_CONF,
    NginxServer,
    PY,
    REPO,
    RedisCluster,
    RedisServer,
    S3Server,
    S3_ENV,
    find_binary,
    find_moto,
    free_cluster_port,
    free_port,
    stop_process,
    subprocess_env,
    wait_port,
)


@pytest.fixture
def redis_server(tmp_path):
    binary = find_binary("redis-server")
    if binary is None:
        pytest.skip("redis-server binary not found (apt-get install redis-server, or run .ci/services.sh)")
    srv = RedisServer(binary, tmp_path)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def nginx_server(tmp_path):
    binary = find_binary("nginx")
    if binary is None:
        pytest.skip("nginx binary not found (apt-get install nginx, or run .ci/services.sh)")
    srv = NginxServer(binary, tmp_path / "nginx", tmp_path / "www")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def redis_cluster(tmp_path):
    server, cli = find_binary("redis-server"), find_binary("redis-cli")
    if server is None or cli is None:
        pytest.skip("redis-server / redis-cli not found (apt-get install redis-server, or run .ci/services.sh)")
    c = RedisCluster(server, cli, tmp_path / "cluster")
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture
def s3_server(monkeypatch):
    binary = find_moto()
    if binary is None:
        pytest.skip("moto_server not found (pip install 'moto[server]'; `bash .ci/setup test` installs it)")
    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    srv = S3Server(binary)
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class KdnServer:
    """``kvc serve`` over a directory store (``store_dir``) on a loopback port, one read-write token for ``namespaces``."""

    TOKEN = "kdn-tier-tests-0123456789"

    def __init__(self, workdir: Path, namespaces: tuple[str, ...] = ("a", "b")) -> None:
        self.workdir = workdir
        self.store_dir = workdir / "kdn-store"
        self.tokens = workdir / "tokens.json"
        workdir.mkdir(parents=True, exist_ok=True)
        self.tokens.write_text(json.dumps({"tokens": [
            {"token": self.TOKEN, "tenant": "a", "namespaces": list(namespaces)}]}))
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def url(self, **opts: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in opts.items())
        return f"kvc+http://:{self.TOKEN}@127.0.0.1:{self.port}" + (f"?{q}" if q else "")

    def start(self) -> None:
        self.proc = subprocess.Popen(
            # no in-process LRU in the service: what a test does to its directory is what it serves
            [PY, "-m", "kvcodec", "serve", "--store", f"mem://?max_bytes=0,{self.store_dir}", "--port", str(self.port),
             "--tokens", str(self.tokens)],
            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, timeout=120, proc=self.proc)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


@pytest.fixture
def kdn_server(tmp_path):
    srv = KdnServer(tmp_path / "kdn")
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
