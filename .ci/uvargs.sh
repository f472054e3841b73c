# Sourced by .ci/setup and .ci/sidevenv.sh: uv's arguments for installing into the venv whose python is $1,
# in the array UVARGS. uv reads no pip.conf, so pip's find-links, extra indexes (where this machine keeps its
# CPU torch) and constraint files are passed on. Byte-compiling is kept: where PYTHONDONTWRITEBYTECODE=1, as on
# this project's machines, Python never writes .pyc itself and every process would compile its imports from
# source (pip byte-compiles by default; uv does it only when asked, on every core).
uv_args() {
  # --index-strategy unsafe-best-match: pip's rule, every index equal and the best version wins. uv's own
  # default takes a package only from the first index that has it, and a CI machine whose local index holds
  # an older mypy than the pin failed to resolve.
  UVARGS=(--python "$1" --compile-bytecode -q --index-strategy unsafe-best-match)
  local u c
  for u in ${PIP_FIND_LINKS:-} $(.venv/bin/python -m pip config get global.find-links 2>/dev/null || true); do
    case $u in http://*|https://*) UVARGS+=(--find-links "$u") ;; *) [ -d "${u#file://}" ] && UVARGS+=(--find-links "${u#file://}") ;; esac
  done
  for u in ${PIP_EXTRA_INDEX_URL:-} $(.venv/bin/python -m pip config get global.extra-index-url 2>/dev/null || true); do
    case $u in http://*|https://*) UVARGS+=(--extra-index-url "$u") ;; file://*) [ -d "${u#file://}" ] && UVARGS+=(--extra-index-url "$u") ;; esac
  done
  # pip's constraint files too (this machine caps torch at the releases on its disk): uv knows no cap.
  for c in ${PIP_CONSTRAINT:-} $(.venv/bin/python -m pip config get global.constraint 2>/dev/null || true); do
    [ -f "$c" ] && UVARGS+=(--constraint "$c")
  done
  return 0
}
