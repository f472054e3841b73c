"""Real servers for the store tests: redis-server and nginx on random loopback ports.

Import the fixtures into a test module (``from store_fixtures import redis_server``).
A missing binary skips the test with a clear reason (CI installs both via
``.ci/services.sh``).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def find_binary(name: str) -> str | None:
    p = shutil.which(name)
    if p:
        return p
    for d in ("/usr/sbin", "/usr/local/sbin", "/usr/local/bin", "/usr/bin"):
        c = os.path.join(d, name)
        if os.access(c, os.X_OK):
            return c
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.02)
    raise RuntimeError(f"nothing listening on 127.0.0.1:{port} after {timeout} s")


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for helper subprocesses: the repo importable, no hash seed pinned."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


# -- redis ------------------------------------------------------------------------------

class RedisServer:
    def __init__(self, binary: str, workdir: Path, password: str | None = None) -> None:
        self.binary = binary
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.workdir), "--daemonize", "no",
                "--loglevel", "warning"]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port, proc=self.proc)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait()
        self.proc = None


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


# -- nginx ------------------------------------------------------------------------------

NGINX_CONF = """\
daemon off;
master_process off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 64; }}
http {{
    access_log off;
    client_body_temp_path {prefix}/tmp/body;
    proxy_temp_path {prefix}/tmp/proxy;
    fastcgi_temp_path {prefix}/tmp/fastcgi;
    uwsgi_temp_path {prefix}/tmp/uwsgi;
    scgi_temp_path {prefix}/tmp/scgi;
    default_type application/octet-stream;
    sendfile on;
    server {{
        listen 127.0.0.1:{port};
        root {root};
        location / {{ }}
    }}
}}
"""


class NginxServer:
    def __init__(self, binary: str, prefix: Path, root: Path) -> None:
        self.binary, self.prefix, self.root = binary, prefix, root
        self.port = free_port()
        (prefix / "tmp").mkdir(parents=True, exist_ok=True)
        root.mkdir(parents=True, exist_ok=True)
        self.conf = prefix / "nginx.conf"
        self.conf.write_text(NGINX_CONF.format(prefix=prefix, port=self.port, root=root))
        self.proc: subprocess.Popen | None = None

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}/"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [self.binary, "-e", str(self.prefix / "error.log"), "-p", str(self.prefix), "-c", str(self.conf)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            wait_port(self.port, proc=self.proc)
        except RuntimeError as e:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None else ""
            raise RuntimeError(f"nginx did not start: {e}: {err}") from None

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:  # pragma: no cover
                self.proc.kill()
                self.proc.wait()
        self.proc = None


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


PY = sys.executable

