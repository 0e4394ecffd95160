#!/usr/bin/env sh
# The GPU check, offline: no nox, no network, no build backend. Makes .nox/gpu, a venv that sees
# the interpreter's own packages (torch included), puts the four packages' src folders on its
# path with a .pth file, and runs `python -m shardopt.devtools.gpu_check` with the given arguments.
# Usage: ci/gpu.sh [--out DIR] [--items abcdefg] (or ci/nox.sh -s gpu -- ARGS).
# PYTHON picks the interpreter (default python3); SHARDOPT_GPU_REPORT the report folder
# (default out/gpu). Where torch sees no CUDA device it prints one line and exits 0.
set -eu
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
venv="$root/.nox/gpu"
cd "$root"
paths="$root/packages/core/src
$root/packages/functional/src
$root/packages/testing/src
$root/packages/devtools/src"
if "$py" -m venv --clear --system-site-packages --without-pip "$venv" >/dev/null 2>&1; then
  python="$venv/bin/python"
  site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  # $py may itself be a venv, whose packages --system-site-packages does not reach: add them.
  base=$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  printf '%s\n%s\n' "$paths" "$base" >"$site/shardopt-src.pth"
else  # no venv module (e.g. a bare Debian python3): the interpreter itself, src on PYTHONPATH
  python=$py
  PYTHONPATH=$(printf '%s' "$paths" | tr '\n' ':')${PYTHONPATH:+:$PYTHONPATH}
  export PYTHONPATH
fi
exec "$python" -m shardopt.devtools.gpu_check "$@"
