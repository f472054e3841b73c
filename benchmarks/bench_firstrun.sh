#!/usr/bin/env bash
# The README's first command on a "fresh machine" (issue 21): a clean clone and an empty home
# directory, timed per phase. .ci/setup installs with uv (pip only installs uv itself), and uv's
# cache lives in the empty home, so the downloads from the package index are *included* in the
# setup phase: an upper bound on the time without them. (A pre-filled uv cache would not count
# them separately but skip them: it holds unpacked wheels, so it would also skip the unpacking.)
# The optional PIP_CACHE_DIR only serves pip's install of uv (or everything, where uv cannot be had).
#
#   bash benchmarks/bench_firstrun.sh [PIP_CACHE_DIR]      (prints one table row per phase)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d /tmp/kvc-firstrun-XXXXXX)
export HOME="$WORK/home" CI=
mkdir -p "$HOME"
[ -n "${1:-}" ] && export PIP_CACHE_DIR="$1"
git clone -q "$SRC" "$WORK/clone"
cd "$WORK/clone"
t() { date +%s.%N; }
t0=$(t)
bash .ci/setup > "$WORK/setup.log" 2>&1
t1=$(t)
.venv/bin/kvc demo > "$WORK/demo.txt" 2> "$WORK/demo.log"
t2=$(t)
cat "$WORK/demo.txt"
echo
echo "| phase | seconds |"
echo "|---|---|"
printf '| .ci/setup (venv, uv, installs incl. downloads, model conversion, kernel warm-up) | %.0f |\n' "$(awk "BEGIN{print $t1 - $t0}")"
printf '| kvc demo | %.0f |\n' "$(awk "BEGIN{print $t2 - $t1}")"
printf '| total | %.0f |\n' "$(awk "BEGIN{print $t2 - $t0}")"
echo "(load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); logs in $WORK)"
