"""Real local servers for tests and benchmarks: redis-server, a redis cluster, nginx and moto's S3, on loopback ports.

Here, not in tests/, so the benchmarks import it without a ``sys.path`` edit (a benchmark's own folder
is on the path when it runs); the pytest fixtures around these servers are tests/_support/store_fixtures.py.
Standard library only. CI installs the binaries via ``.ci/services.sh``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]  # the repository root (kvcodec/testing/servers.py)


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


def stop_process(proc: subprocess.Popen | None) -> None:
    """Terminate a server process; kill it if it has not exited 10 s later."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:  # pragma: no cover
        proc.kill()
        proc.wait()


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
        stop_process(self.proc)
        self.proc = None

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
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.poll() is not None and self.proc.stderr else ""
            raise RuntimeError(f"nginx did not start: {e}: {err}") from None

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None

PY = sys.executable



# -- redis cluster ---------------------------------------------------------------------

def free_cluster_port() -> int:
    """A free port whose cluster-bus port (port + 10000) is free too."""
    for _ in range(200):
        p = free_port()
        if p + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", p + 10000))
            except OSError:
                continue
        return p
    raise RuntimeError("no free port pair for a cluster node")


class RedisCluster:
    """``masters`` redis-server processes in cluster mode on loopback, joined by ``redis-cli --cluster create``."""

    def __init__(self, server: str, cli: str, workdir: Path, masters: int = 3) -> None:
        self.server, self.cli, self.workdir = server, cli, workdir
        self.ports = [free_cluster_port() for _ in range(masters)]
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.ports[0]}?nodes=" + "+".join(f"127.0.0.1:{p}" for p in self.ports[1:])

    def start_node(self, port: int) -> None:
        d = self.workdir / f"node-{port}"
        d.mkdir(parents=True, exist_ok=True)
        args = [self.server, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-config-file", str(d / "nodes.conf"), "--cluster-node-timeout", "1000",
                "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no",
                "--dir", str(d), "--daemonize", "no", "--loglevel", "warning", "--protected-mode", "no"]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(port, proc=self.procs[port])

    def start(self, attempts: int = 3) -> None:
        """Start the nodes and join them; on a port race with another process, retry on fresh ports."""
        for attempt in range(attempts):
            try:
                for p in self.ports:
                    self.start_node(p)
                time.sleep(0.2)
                dead = [p for p, proc in self.procs.items() if proc.poll() is not None]
                if dead:
                    raise RuntimeError(f"cluster nodes on ports {dead} exited (port taken?)")
                out = subprocess.run([self.cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                                      "--cluster-replicas", "0", "--cluster-yes"],
                                     capture_output=True, text=True, timeout=60)
                if out.returncode != 0:
                    raise RuntimeError(f"redis-cli --cluster create failed: {out.stdout[-500:]} {out.stderr[-500:]}")
                self.wait_ok()
                return
            except RuntimeError:
                self.stop()
                if attempt == attempts - 1:
                    raise
                self.ports = [free_cluster_port() for _ in self.ports]

    def info(self, port: int) -> dict[str, str]:
        out = subprocess.run([self.cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True, timeout=10)
        return dict(line.strip().split(":", 1) for line in out.stdout.splitlines() if ":" in line)

    def wait_ok(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(self.info(p).get("cluster_state") == "ok" for p in self.procs):
                return
            time.sleep(0.1)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def node_of(self, redis_key: str) -> int:
        """Port of the master that owns ``redis_key``'s slot (asked of a live node)."""
        from redis.cluster import RedisCluster as Client

        c = Client(host="127.0.0.1", port=next(iter(self.procs)))
        try:
            return int(c.get_node_from_key(redis_key).port)
        finally:
            c.close()

    def node_id(self, port: int) -> str:
        return subprocess.run([self.cli, "-p", str(port), "cluster", "myid"], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    def reshard(self, src: int, dst: int, slots: int) -> None:
        """Move ``slots`` slots (with their keys) from master ``src`` to master ``dst``."""
        out = subprocess.run([self.cli, "--cluster", "reshard", f"127.0.0.1:{self.ports[0]}",
                              "--cluster-from", self.node_id(src), "--cluster-to", self.node_id(dst),
                              "--cluster-slots", str(slots), "--cluster-yes"],
                             capture_output=True, text=True, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"reshard failed: {out.stdout[-500:]} {out.stderr[-500:]}")

    def kill(self, port: int) -> None:
        p = self.procs.pop(port)
        p.kill()
        p.wait(10)

    def stop(self) -> None:
        for port in list(self.procs):
            stop_process(self.procs.pop(port))

# -- S3 (moto's standalone server) -------------------------------------------------------

S3_ENV = {"AWS_ACCESS_KEY_ID": "kvctest", "AWS_SECRET_ACCESS_KEY": "kvctest-secret", "AWS_DEFAULT_REGION": "us-east-1"}


class S3Server:
    """moto's S3-protocol server (``moto_server``) on a loopback port, with one bucket."""

    def __init__(self, binary: str, bucket: str = "kvc-test") -> None:
        self.binary, self.bucket = binary, bucket
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "store", **opts: str) -> str:
        q = "&".join(f"{k}={v}" for k, v in {"endpoint_url": self.endpoint, **opts}.items())
        return f"s3://{self.bucket}/{prefix}?{q}"

    def client(self):
        import boto3

        return boto3.session.Session().client("s3", endpoint_url=self.endpoint, region_name="us-east-1")

    def start(self, create_bucket: bool = True) -> None:
        self.proc = subprocess.Popen([self.binary, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=subprocess_env(**S3_ENV))
        wait_port(self.port, timeout=60, proc=self.proc)
        if create_bucket:
            self.client().create_bucket(Bucket=self.bucket)

    def stop(self) -> None:
        stop_process(self.proc)
        self.proc = None


def find_moto() -> str | None:
    c = os.path.join(os.path.dirname(sys.executable), "moto_server")
    return c if os.access(c, os.X_OK) else shutil.which("moto_server")
