#!/usr/bin/env sh
# Bootstraps a pinned nox and uv into .nox/_bootstrap (needs only python3) and runs nox with the given arguments.
# Usage: ci/nox.sh -s tests | ci/nox.sh -s demo | ci/nox.sh -s bench
# ci/nox.sh -s gpu [-- ARGS] needs neither nox nor the network: it runs ci/gpu.sh ARGS.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
if [ "$#" -ge 2 ] && [ "$2" = "gpu" ] && { [ "$1" = "-s" ] || [ "$1" = "--session" ]; }; then
  shift 2
  if [ "${1-}" = "--" ]; then shift; fi
  exec "$root/ci/gpu.sh" "$@"
fi
boot="$root/.nox/_bootstrap"
py=${PYTHON:-python3}
if [ ! -x "$boot/bin/nox" ]; then
  "$py" -m venv "$boot"
  "$boot/bin/python" -m pip install -q --disable-pip-version-check -r "$root/ci/requirements-nox.txt"
fi
cd "$root"
exec "$boot/bin/nox" "$@"
