"""The packages keep their boundaries: no private cross-package import, core without import
cycles, and a harness that imports no other shardopt package (scripts/count_boundaries.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def counter():
    spec = importlib.util.spec_from_file_location(
        "count_boundaries", ROOT / "scripts" / "count_boundaries.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_package_imports_another_packages_private_modules():
    assert counter().private_cross_imports(str(ROOT)) == []


def test_core_has_no_import_cycles():
    assert counter().core_cycles(str(ROOT)) == set()


def test_the_harness_imports_no_other_shardopt_package():
    found = []
    for path in (ROOT / "packages" / "testing" / "src").rglob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["from"], ["import"]) and len(words) > 1:
                module = words[1]
                if module.startswith("shardopt.") and not module.startswith("shardopt.testing"):
                    found.append(f"{path.name}: {line.strip()}")
    assert found == []
