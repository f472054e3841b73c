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
    def __init__(self, tmp: Path, max_body: str = "8M") -> None:
        self.port = free_port()
        self.store_dir = tmp / "kdn-store"
        tokens = tmp / "tokens.json"
        tokens.write_text(json.dumps({"tokens": [
            {"token": TOK_A, "tenant": "a"},
            {"token": TOK_A_RO, "tenant": "a", "write": False},
            {"token": TOK_B, "tenant": "b"},
        ]}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvcodec", "serve", "--store", str(self.store_dir), "--port", str(self.port),
             "--tokens", str(tokens), "--max-body", max_body],
            env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=open(tmp / "serve.log", "wb"))  # noqa: SIM115
        # (a file, not a pipe: nobody reads a pipe while the service runs, and a full one would block it)
        wait_port(self.port, timeout=120, proc=self.proc)
        self.base = f"http://127.0.0.1:{self.port}"

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
