#!/usr/bin/env bash
# The kvcodec HiCache backend against SGLang's own HiCacheStorage ABC and StorageBackendFactory (issue 54).
# SGLang is CUDA-gated and its dependency list is a GPU serving stack; its storage ABC and backend factory import
# with the wheel alone (--no-deps) plus seven small modules, so like .ci/transformers_floor.sh this installs them
# into a folder put ahead of the main venv's packages (.venv-sglang) instead of building a venv with a second torch.
# The end-to-end HiCache run is benchmarks/gpu_check.py's SGLang step.
# SGLANG_SETUP_ONLY=1: install and check the import only (.ci/run does it in the background during the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION=0.5.23
SG=${SG:-.venv-sglang}
t0=$(date +%s)
if [ ! -f "$SG/.kvcodec-sglang-$SGLANG_VERSION-ok" ]; then
    rm -rf "$SG"
    .venv/bin/python -m pip -q --disable-pip-version-check install --target "$SG" --no-deps \
        "sglang==$SGLANG_VERSION" orjson pybase64 starlette msgspec pyzmq ipython traitlets
    echo "*" > "$SG/.gitignore"
    touch "$SG/.kvcodec-sglang-$SGLANG_VERSION-ok"
fi
PYTHONPATH="$PWD/$SG" .venv/bin/python -c "
import importlib.metadata as m
from kvcodec.integrations.sglang import KvcodecHiCacheStorage
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
assert m.version('sglang') == '$SGLANG_VERSION', m.version('sglang')
assert issubclass(KvcodecHiCacheStorage, HiCacheStorage)
print('sglang-ci: sglang', m.version('sglang'))"
echo "sglang-ci: ready in $(( $(date +%s) - t0 )) s"
[ -n "${SGLANG_SETUP_ONLY:-}" ] && exit 0
PYTHONPATH="$PWD/$SG" .venv/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_sglang_hicache.py
echo "sglang-ci: done in $(( $(date +%s) - t0 )) s"
