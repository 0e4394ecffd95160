"""The CLI tests: their helper modules import by name, here and in the CLI's spawned ranks."""

from __future__ import annotations

import sys
from pathlib import Path

# Spawned ranks start with this process's sys.path, so _launch_ranks imports there too.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
