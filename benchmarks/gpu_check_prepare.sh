#!/usr/bin/env bash
# Stage what benchmarks/gpu_check needs on a bare GPU machine, here, before any device time is spent.
#
#   bash benchmarks/gpu_check_prepare.sh                  # smollm2 only
#   GPU_CHECK_MODELS="smollm2 gemma3-270m" bash benchmarks/gpu_check_prepare.sh   # both models (8 parts, 2026-11-27)
#
# The device tool's machines (KINDS.md: Python 3.12 with torch, triton, transformers, numba, h5py; no
# package index) lack some of kvcodec's dependencies and the shipped models, and one device call carries
# at most 64 MiB (the working tree, ~7 MB, included). This builds a site folder of the missing packages
# (wheels for CPython 3.12 on x86-64, pinned to this venv's versions; transformers too, so the check runs the
# release CI runs: the image's 5.17 converts Gemma 3's GGUF tokenizer without its merges, which kvcodec refuses)
# and of the shipped models' packages
# (copied from this venv), tars it and cuts it into parts of at most 50 MiB under .whl/gpu-check/load1,
# load2, ... (.whl/ is git-ignored). Then, back to back (a warm machine keeps what earlier calls carried):
#
#   run(command="true", carry=[".whl/gpu-check/load1"], timeout_s=60)
#   ...                                                       one call per part but the last
#   run(command="bash benchmarks/gpu_check", carry=[".whl/gpu-check/loadN"], timeout_s=540)
#
# benchmarks/gpu_check unpacks the parts into /tmp/kvc-gpu-check and puts it on PYTHONPATH.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
MODELS=${GPU_CHECK_MODELS:-smollm2}
OUT=.whl/gpu-check
rm -rf "$OUT"
mkdir -p "$OUT/site"
pins=$("$PY" - <<'PY'
from importlib import metadata
print(" ".join(f"{n}=={metadata.version(n)}" for n in ("zstandard", "google-crc32c", "blake3", "constriction", "gguf",
                                                       "transformers")))
PY
)
# shellcheck disable=SC2086
"$PY" -m pip install -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --target "$OUT/site" $pins
sp=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
for m in $MODELS; do
    for mod in $("$PY" -c "from kvcodec.models.load import SHIPPED; m = SHIPPED['$m']; print(' '.join(dict.fromkeys([m.module, *[c for c, _ in m.chunks]])))"); do
        cp -r "$sp/$mod" "$OUT/site/"
    done
done
tar -cf - -C "$OUT" site | gzip -1 | split -b 50m -d - "$OUT/site.tar.gz."  # gzip: Python sources shrink ~5x
rm -rf "$OUT/site"
n=0
for f in "$OUT"/site.tar.gz.*; do
    n=$((n + 1))
    mkdir -p "$OUT/load$n"
    mv "$f" "$OUT/load$n/"
done
du -sh "$OUT"/load*
echo "staged $n part(s) under $OUT (models: $MODELS); carry them one per device call, the last with: bash benchmarks/gpu_check"
