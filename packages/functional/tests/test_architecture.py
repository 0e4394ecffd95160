"""The dependency direction inside shardopt.functional: the engine imports nothing above it, no
class mixes in one of ours, and a stage-2 gradient's path goes one way through few files."""

from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess
import sys

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


SOURCES = sorted(
    path
    for package in ("core", "functional", "testing", "devtools")
    for path in (pathlib.Path(__file__).parents[2] / package / "src" / "shardopt").rglob("*.py")
)


def shardopt_classes(path: pathlib.Path) -> dict[str, list[str]]:
    """Each class ``path`` defines -> the names of its bases (as written)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    return {
        node.name: [ast.unparse(base) for base in node.bases]
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    }


def is_mixing(bases: list[str], ours: set[str]) -> bool:
    """Whether a class of these ``bases`` mixes in a class of ours: several bases, one of them
    ours, except a Protocol extending protocols and an exception that is also a builtin one
    (``WorldTimeoutError(WorldError, TimeoutError)``), which add no state-reading methods."""
    names = [base.split(".")[-1] for base in bases]
    if len(names) < 2 or "Protocol" in names:
        return False
    if all(n.endswith(("Error", "Exception")) for n in names):
        return False
    return any(n in ours for n in names)


def test_no_class_mixes_in_a_class_of_ours() -> None:
    """A mixin here: a class of shardopt's that is one of several bases of another class (its
    methods read attributes that only the other bases' constructor sets)."""
    classes = {path: shardopt_classes(path) for path in SOURCES}
    ours = {name for defined in classes.values() for name in defined}
    mixed = [
        f"{path.name}: {name}({', '.join(bases)})"
        for path, defined in classes.items()
        for name, bases in defined.items()
        if is_mixing(bases, ours)
    ]
    assert len(SOURCES) > 100, SOURCES
    assert mixed == [], mixed


def test_a_stage_2_gradient_crosses_at_most_8_files_and_no_call_goes_back_up() -> None:
    """``scripts/gradient_path.py`` traces a stage-2 gradient from its hook, and ``step``, to
    the updated parameter (issue 39: 9 files and 2 calls back up before the gradient half left
    the layout and the update drove its own gather loop)."""
    script = pathlib.Path(__file__).resolve().parents[3] / "scripts" / "gradient_path.py"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    files = re.search(r"^files \((\d+)\)", out.stdout, re.MULTILINE)
    back = re.search(r"^calls back up \((\d+)\): (.*)$", out.stdout, re.MULTILINE)
    assert files is not None, out.stdout
    assert back is not None, out.stdout
    assert int(files.group(1)) <= 8, out.stdout
    assert int(back.group(1)) == 0, back.group(2)


LIBRARY = [p for p in SOURCES if "/devtools/" not in p.as_posix()]


def test_the_library_imports_no_developer_tool_but_the_commands_optional_hook() -> None:
    """Installing the library ships the library ([Note: developer tools] in cli/_cli.py): no
    module of core, functional or testing imports shardopt.devtools, but the command's guarded
    import of its parsers."""
    importing = sorted(
        path.as_posix().split("/src/", 1)[1]
        for path in LIBRARY
        if any(m.startswith("shardopt.devtools") for m in imported_modules(path))
    )
    assert importing == ["shardopt/cli/_cli.py"]
