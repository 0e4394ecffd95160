"""Shared output of the benchmark scripts: a JSON file with the machine next to the rows."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path
from typing import Any

import torch


def write_results(path: Path, rows: list[dict[str, Any]]) -> None:
    """Writes ``{"meta": <torch, python, cpus>, "cases": rows}`` to ``path`` and says where."""
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    path.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
    print(f"\nwrote {path}")
