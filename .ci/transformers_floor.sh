#!/usr/bin/env bash
# The oldest transformers kvcodec supports (pyproject: transformers>=5.17), beside the main venv's newest.
# The first GPU check ran on an image with 5.17 and found what only that release does (benchmarks/BENCHMARKS.md,
# "GPU"): per-layer cache kwargs as one dict, other GGUF token roles, Gemma 3's tokenizer without merges.
# This installs 5.17.0 (and the huggingface_hub it needs) into a folder put ahead of the main venv's packages,
# then runs the HF-loader and model tests on the embedded model with a model cache of its own.
# TF_FLOOR_SETUP_ONLY=1: install only (.ci/run does it in the background during the main suite).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
FLOOR=${FLOOR:-.venv-tf-floor}
if [ ! -f "$FLOOR/.kvcodec-ok" ]; then
    rm -rf "$FLOOR"
    .venv/bin/python -m pip -q --disable-pip-version-check install --target "$FLOOR" --no-deps \
        transformers==5.17.0 huggingface_hub==1.33.0
    .venv/bin/python -m pip -q --disable-pip-version-check install --target "$FLOOR" httpx==0.28.1
    echo "*" > "$FLOOR/.gitignore"
    touch "$FLOOR/.kvcodec-ok"
fi
[ -n "${TF_FLOOR_SETUP_ONLY:-}" ] && { echo "transformers-floor-ci: ready in $(( $(date +%s) - t0 )) s"; exit 0; }
cache=$(mktemp -d)
trap 'rm -rf "$cache"' EXIT
PYTHONPATH="$PWD/$FLOOR" KVCODEC_CACHE="$cache" .venv/bin/python - <<'PY'
import transformers
assert transformers.__version__ == "5.17.0", transformers.__version__
PY
# test_device_paths.py's vLLM-connector tests (the chunk entry into paged blocks: Triton and vllm.entries, no
# transformers; ~85 s of this job on the 2-core box) run once, in the main suite; here only its HF-loader ones.
PYTHONPATH="$PWD/$FLOOR" KVCODEC_CACHE="$cache" .venv/bin/python -m pytest -q -p no:cacheprovider \
    tests/models/test_transformers_versions.py tests/integrations/test_hf_loader.py tests/integrations/test_device_paths.py \
    -k "not connector and not paged_views and not block_table"
echo "transformers-floor-ci: done in $(( $(date +%s) - t0 )) s"
