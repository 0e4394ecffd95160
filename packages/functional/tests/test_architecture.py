"""The dependency direction inside shardopt.functional: the engine imports nothing above it."""

from __future__ import annotations

import ast
import pathlib

import pytest

import shardopt.functional.engine as engine

ENGINE = pathlib.Path(engine.__file__).parent


def imported_modules(path: pathlib.Path) -> list[str]:
    """Every module an ``import`` or ``from ... import`` of ``path`` names (absolute form)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            assert node.level == 0, f"{path.name}: relative import of {node.module}"
            names.append(node.module)
    return names


@pytest.mark.parametrize("path", sorted(ENGINE.glob("*.py")), ids=lambda p: p.name)
def test_no_engine_module_imports_from_above_the_engine(path: pathlib.Path) -> None:
    above = [
        name
        for name in imported_modules(path)
        if name.startswith(("shardopt.functional", "shardopt.optim", "shardopt.cli"))
        and not name.startswith("shardopt.functional.engine")
    ]
    assert above == [], f"{path.name} imports {above} from above the engine"
