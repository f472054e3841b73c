#!/usr/bin/env bash
# Make the redis-server, redis-cli and nginx binaries available for the store tests
# (redis-cli joins the Redis Cluster the tests start; moto's S3 server comes from
# PyPI through .ci/setup).
# Idempotent and quiet; starts nothing: the tests start their own servers on
# random loopback ports and stop them.  Without root (or apt) it only warns,
# and the tests marked requires_redis / requires_nginx skip with a reason.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx)
[ ${#need[@]} -eq 0 ] && exit 0
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then SUDO="sudo -n"; else
    echo "services.sh: not root; cannot install ${need[*]} (store tests needing them will skip)" >&2
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "services.sh: no apt-get; install ${need[*]} yourself (store tests needing them will skip)" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq >/dev/null
$SUDO apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
exit 0
