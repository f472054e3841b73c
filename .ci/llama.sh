#!/usr/bin/env bash
# Install llama-cpp-python into ./.venv: the llama.cpp anchor in benchmarks/bench_llamacpp.py
# and the tests of the .kvc -> llama.cpp loader (kvcodec/integrations/llamacpp.py) need the real library.
# PyPI ships it as source only: pip builds llama.cpp with cmake for this CPU (CPU backend,
# GGML_NATIVE). Only the libraries kvcodec uses are built (no llava/mtmd, tools, examples, tests,
# server): 5 min 44 s on this 2-core box, quiet. The wheel is built once per (version, Python,
# CPU flags, build options) and kept under the user cache dir; later runs install it in seconds.
# Idempotent; called by .ci/run after .ci/setup.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=0.3.16
BUILD_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
PY=.venv/bin/python
if "$PY" -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$VERSION')" 2>/dev/null; then
  exit 0
fi
key=$( { echo "$VERSION $BUILD_ARGS"; "$PY" -c 'import sys; print(sys.version)'; grep -m1 '^flags' /proc/cpuinfo || true; } | sha256sum | cut -c1-16)
root=${KVCODEC_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvcodec}/wheels
dir=$root/llama-cpp-python-$key
if ! compgen -G "$dir/llama_cpp_python-$VERSION-*.whl" >/dev/null; then
  echo "llama.sh: building llama-cpp-python $VERSION for this CPU (once; several minutes)" >&2
  mkdir -p "$root"
  tmp=$(mktemp -d "$root/.build-XXXXXX")
  trap 'rm -rf "$tmp"' EXIT
  CMAKE_ARGS="$BUILD_ARGS" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) nice "$PY" -m pip wheel -q --no-deps -w "$tmp" "llama-cpp-python==$VERSION"
  mv -T "$tmp" "$dir" 2>/dev/null || [ -d "$dir" ]  # atomic; a concurrent builder that finished first wins
fi
"$PY" -m pip install -q --disable-pip-version-check "$dir"/llama_cpp_python-"$VERSION"-*.whl
