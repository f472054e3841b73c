"""Pytest fixtures for real servers in the store tests: redis-server, a redis cluster, nginx, moto's S3.

Import the fixtures into a test module (``from store_fixtures import redis_server``). The servers
themselves are kvcodec/testing/servers.py (shared with the benchmarks); a missing binary skips the
test with a clear reason (CI installs them via ``.ci/services.sh``).
"""

from __future__ import annotations

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
