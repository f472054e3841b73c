#!/usr/bin/env bash
# The README's first command on a "fresh machine" (issue 21): a clean clone and an empty home
# directory, timed per phase. Downloads are counted separately: pass a pip cache that already
# holds the wheels (PIP_CACHE_DIR, e.g. the one a previous CI run filled), so what is timed is
# installing, converting, compiling and the demo, not the network. Without one, pip downloads
# and the install phase includes them.
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
printf '| .ci/setup (venv, pip install from %s, model conversion, kernel warm-up) | %.0f |\n' "${PIP_CACHE_DIR:-the network}" "$(awk "BEGIN{print $t1 - $t0}")"
printf '| kvc demo | %.0f |\n' "$(awk "BEGIN{print $t2 - $t1}")"
printf '| total | %.0f |\n' "$(awk "BEGIN{print $t2 - $t0}")"
echo "(load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); logs in $WORK)"
