#!/usr/bin/env bash
# NVIDIA kvpress (issue 15: a real peer in the rate/quality curve), in its own venv: kvpress 0.5.5
# pins transformers<5.3, older than the main .venv's. Creates ./.venv-kvpress from scratch if missing
# (idempotent). Nothing from kvcodec is installed there: kvcodec/eval/kvpress_runner.py is a standalone
# script (torch + transformers + kvpress only) that kvcodec.eval.peers runs in this venv as a subprocess
# and that hands back which tokens each press keeps (kvcodec/eval/peers.py: KVPRESS_VENV).
# Usage: bash .ci/kvpress.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source .ci/sidevenv.sh
t0=$(date +%s)
kvpress_deps() { pip install kvpress==0.5.5 'transformers>=4.56,<5.3'; }
side_venv .venv-kvpress kvpress kvpress_deps
"$V/bin/python" -c 'import kvpress, transformers; print("kvpress-ci: kvpress", kvpress.__version__ if hasattr(kvpress, "__version__") else "0.5.5", "transformers", transformers.__version__)'
echo "kvpress-ci: venv ready in $(( $(date +%s) - t0 )) s"
