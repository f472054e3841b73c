"""(e) of the GPU check: SGLang HiCache with the kvcodec storage backend, end to end (issue 54).

HiCache is CUDA-gated, so this is the only place the backend (kvcodec/integrations/sglang.py) runs inside SGLang:
tests/integrations/test_sglang_hicache.py checks it against SGLang's ABC and backend factory on the CPU.

The step starts ``python -m sglang.launch_server`` on the embedded model's HF directory with
``--enable-hierarchical-cache --hicache-storage-backend dynamic`` and the kvcodec backend over a fresh store
directory, sends one long prompt (greedy), flushes SGLang's GPU and host caches, sends it again (the pages come
back from the kvcodec store), and passes when both answers are identical and the store holds `.kvc` entries.
Skipped, with the reason, where SGLang is not installed or there is no CUDA device.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 - loopback only
        raw = r.read()
    return json.loads(raw) if raw.strip().startswith(b"{") else raw.decode()


def step_sglang(quick: bool, seconds_left: float, root: Path) -> dict[str, Any]:
    """Run the step; a dict with ``status`` (passed / failed / skipped) and ``why``."""
    if importlib.util.find_spec("sglang") is None:
        return {"status": "skipped", "why": "SGLang is not installed in this Python (CI checks the backend against "
                                            "its ABC on the CPU: bash .ci/sglang.sh)"}
    if quick:
        return {"status": "skipped", "why": "quick mode: SGLang's HiCache needs CUDA"}
    import torch

    if not torch.cuda.is_available():
        return {"status": "skipped", "why": "no CUDA device"}
    if seconds_left < 90:
        return {"status": "skipped", "why": "the check's time budget ran out"}
    from kvcodec.models.load import resolve_model_dir

    model = str(resolve_model_dir("smollm2"))
    port = _port()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        key = os.path.join(tmp, "t.key")
        from kvcodec.store import TenantKey

        TenantKey.generate(key)
        extra = {"backend_name": "kvcodec", "module_path": "kvcodec.integrations.sglang",
                 "class_name": "KvcodecHiCacheStorage", "store_url": store, "key_file": key, "model": "smollm2"}
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
               "--host", "127.0.0.1", "--enable-hierarchical-cache", "--hicache-storage-backend", "dynamic",
               "--hicache-storage-backend-extra-config", json.dumps(extra), "--mem-fraction-static", "0.3"]
        log = open(os.path.join(tmp, "server.log"), "w+")
        proc = subprocess.Popen(cmd, cwd=root, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(root)))
        deadline = time.monotonic() + seconds_left - 10
        base = f"http://127.0.0.1:{port}"
        try:
            while True:
                try:
                    urllib.request.urlopen(base + "/health", timeout=2)  # noqa: S310 - loopback only
                    break
                except OSError:
                    if proc.poll() is not None or time.monotonic() > deadline:
                        log.seek(0)
                        return {"status": "failed", "why": "the SGLang server did not start", "tail": log.read()[-3000:]}
                    time.sleep(2)
            prompt = " ".join(f"Fact {i}: the code word number {i} is {i * 7919 % 10007}." for i in range(120))
            body = {"text": prompt + " The code word number 3 is", "sampling_params": {"max_new_tokens": 12, "temperature": 0}}
            first = _post(base + "/generate", body, timeout=max(10.0, deadline - time.monotonic()))
            time.sleep(3)  # HiCache writes pages to storage in the background
            _post(base + "/flush_cache", {}, timeout=30)
            second = _post(base + "/generate", body, timeout=max(10.0, deadline - time.monotonic()))
            entries = sum(1 for _ in Path(store).rglob("*") if _.is_file())
            same = first.get("text") == second.get("text")
            ok = same and entries > 0
            return {"status": "passed" if ok else "failed", "same_answer": same, "store_files": entries,
                    "answers": [first.get("text"), second.get("text")],
                    "why": None if ok else ("answers differ" if not same else "the store holds no entries")}
        except Exception as e:  # noqa: BLE001 - the step records any failure and the check goes on
            log.seek(0)
            return {"status": "failed", "why": f"{type(e).__name__}: {e}", "tail": log.read()[-3000:]}
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            log.close()
