#!/usr/bin/env bash
# The full Table 1 run of issue 34 (benchmarks/bench_rag.py) in passes that each resume the run directory, so
# that a run cut short still holds every (model, shape) with as many requests as its time allowed, ICL and
# KV-cache requests interleaved; fine-tuning (LoRA for --ft-budget-x times the KV-cache injection, capped by
# FT_BUDGET_S) after the first pass. Rerun the same command to continue a cut run.
#   bash benchmarks/rag_table1.sh [RUN_DIR]      (default benchmarks/results/rag-table1)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/rag-table1}
PY=${PY:-.venv/bin/python}
FT_BUDGET_S=${FT_BUDGET_S:-900}
bench() { "$PY" benchmarks/bench_rag.py --out "$OUT" --ft-budget-s "$FT_BUDGET_S" "$@"; }
serve=(--methods "in-context learning" "KV-cache learning")
for n in 10 25 50 100; do
  bench --shapes paper "${serve[@]}" --requests "$n"
  bench --shapes 4k "${serve[@]}" --requests "$n"
  bench --shapes paper 4k --methods fine-tuning --requests "$n"
done
