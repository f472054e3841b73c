#!/usr/bin/env bash
# Regenerate every CPU benchmark behind BENCHMARKS.md, one after another on a quiet machine.
# Outputs (JSON, Markdown tables, logs, curve.png) go to benchmarks/results/ and benchmarks/curve.*.
# Usage: bash benchmarks/run_all.sh            (all)   |   bash benchmarks/run_all.sh curve ttft   (a subset)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
R=benchmarks/results
mkdir -p "$R"
export OMP_NUM_THREADS=1 NUMBA_NUM_THREADS=1
sel=("$@")
run() { local name=$1; shift; if [ ${#sel[@]} -eq 0 ] || [[ " ${sel[*]} " == *" $name "* ]]; then
  echo "== $name: $*" >&2; local t0=$(date +%s)
  "$@" > "$R/$name.txt" 2> "$R/$name.log"; echo "   $name done in $(( $(date +%s) - t0 )) s" >&2; fi; }
{ uname -a; lscpu | grep -E "Model name|^CPU\(s\)"; $PY -c "import torch, numpy; print('torch', torch.__version__, 'numpy', numpy.__version__)"; } > "$R/machine.txt"
run curve   $PY benchmarks/bench_curve.py --out benchmarks --capture-dir /tmp/kvc-cache --target-kl 1e-3 --threads 1
run codec   $PY benchmarks/bench_codec.py --json "$R/codec.json"
run ttft    $PY benchmarks/bench_ttft.py --tokens 1024,2048,4096,8192 --preset balanced --repeats 3 --threads 1 --cold --json "$R/ttft.json"
run coldstart $PY benchmarks/bench_coldstart.py --tokens 2048,4096 --repeats 3 --profile --json "$R/coldstart.json"
run calibration $PY benchmarks/bench_calibration.py --texts '' --reference-cost --json "$R/calibration.json"
run llamacpp bash -c "bash .ci/llama.sh && $PY benchmarks/bench_llamacpp.py --tokens 2048 --threads 1 --repeats 3 --json $R/llamacpp.json"
run speed   $PY benchmarks/bench_speed.py --tokens 4096 --repeat 5 --json
run speed_model $PY benchmarks/bench_speed.py --tokens 4096 --repeat 5 --model --json
run speed_avx2 $PY benchmarks/bench_speed.py --tokens 4096 --repeat 5 --target avx2 --json
run entropy $PY benchmarks/bench_entropy.py --real-kv 1024
run lossless $PY benchmarks/bench_lossless.py --tokens 2048
run store   $PY benchmarks/bench_store.py
run fingerprint $PY benchmarks/bench_fingerprint.py --repeats 3 --json "$R/fingerprint.json"
run prune   $PY benchmarks/bench_prune.py --tokens 1024
run blend   $PY benchmarks/bench_blend.py
run load    $PY benchmarks/bench_load.py --engines 8 --requests 3 --docs 12 --doc-tokens 200 --json "$R/load.json"
run kdn_scale_model $PY benchmarks/kdn_scale_model.py
run verify  $PY benchmarks/bench_verify.py --tokens 2048 --repeat 3 --json "$R/verify.json"
run fuzz    nice -n 19 $PY kvcodec/testing/fuzz.py --n 100000 --workers 2 --seed 1 --json "$R/fuzz.json"
