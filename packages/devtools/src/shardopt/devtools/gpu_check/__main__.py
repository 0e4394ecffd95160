"""``python -m shardopt.devtools.gpu_check``: the GPU check (what ``ci/nox.sh -s gpu`` runs)."""

import sys

from shardopt.devtools.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
