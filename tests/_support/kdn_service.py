"""A real ``kvc serve`` process on loopback for tests: three bearer tokens (tenant a read-write and read-only,
tenant b), a directory store behind it."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

from kvcodec.store import StoreKey
from store_fixtures import free_port, subprocess_env, wait_port

TOK_A, TOK_A_RO, TOK_B = "tok-a-0123456789", "tok-a-readonly-99", "tok-b-0123456789"


class Service:
    """``extra``: more ``kvc serve`` arguments; ``tokens``: the token file's rows (default: the three above);
    ``env``: more environment. The server's stderr (its log) goes to ``self.log_path``."""

    def __init__(self, tmp: Path, max_body: str = "8M", extra: list[str] | None = None,
                 tokens: list[dict] | None = None, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.store_dir = tmp / "kdn-store"
        token_file = tmp / "tokens.json"
        token_file.write_text(json.dumps({"tokens": tokens or [
            {"token": TOK_A, "tenant": "a"},
            {"token": TOK_A_RO, "tenant": "a", "write": False},
            {"token": TOK_B, "tenant": "b"},
        ]}))
        self.log_path = tmp / "serve.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcodec", "serve", "--store", str(self.store_dir), "--port", str(self.port),
             "--tokens", str(token_file), "--max-body", max_body, *(extra or [])],
            env=subprocess_env(**(env or {})), stdout=subprocess.DEVNULL,
            stderr=open(self.log_path, "wb"))  # noqa: SIM115
        # (a file, not a pipe: nobody reads a pipe while the service runs, and a full one would block it)
        wait_port(self.port, timeout=120, proc=self.proc)
        self.base = f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def metrics(self) -> dict[str, float]:
        _, _, body = self.request("GET", "/metrics", token=None)
        vals = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                name, _, v = line.rpartition(" ")
                vals[name] = float(v)
        return vals

    def worker_pids(self) -> list[int]:
        out = subprocess.run(["ps", "--ppid", str(self.proc.pid), "-o", "pid="], capture_output=True, text=True)
        return [int(x) for x in out.stdout.split()]

    def url(self, token: str | None = None) -> str:
        return f"kvc+http://{':' + token + '@' if token else ''}127.0.0.1:{self.port}"

    def request(self, method: str, path: str, token: str | None = TOK_A, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
        h = dict(headers or {})
        if token:
            h["Authorization"] = f"Bearer {token}"
        req = urllib.request.Request(self.base + path, data=body, method=method, headers=h)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, dict(r.headers), r.read()
        except urllib.error.HTTPError as e:
            return e.code, dict(e.headers), e.read()

    def stored(self) -> list:
        """Every entry on the service's backing directory, all tenants (tier level: physical names)."""
        from kvcodec.store.tiers.directory import DirectoryTier

        return list(DirectoryTier(self.store_dir).ls()) if self.store_dir.exists() else []

    def put_raw(self, key: StoreKey, data: bytes, token: str = TOK_A, **headers: str) -> int:
        """A PUT with the key in clear, as curl would send it."""
        return self.request("PUT", path_of(key), token=token, body=data, headers=headers)[0]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def path_of(key: StoreKey) -> str:
    return f"/v1/entries/{key.to_str()}"
