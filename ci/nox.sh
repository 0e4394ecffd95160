#!/usr/bin/env sh
# Bootstraps a pinned nox into .nox/_bootstrap (needs only python3) and runs it with the given arguments.
# Usage: ci/nox.sh -s tests | ci/nox.sh -s demo | ci/nox.sh -s bench
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
boot="$root/.nox/_bootstrap"
py=${PYTHON:-python3}
if [ ! -x "$boot/bin/nox" ]; then
  "$py" -m venv "$boot"
  "$boot/bin/python" -m pip install -q --disable-pip-version-check -r "$root/ci/requirements-nox.txt"
fi
cd "$root"
exec "$boot/bin/nox" "$@"
