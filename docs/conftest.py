"""Runs the examples of every docs page as doctests (README.md is collected by pyproject's
``--doctest-glob``): each ``docs/**/*.md`` file is one doctest, its examples sharing one
namespace, as the README's do."""

from __future__ import annotations

import pathlib

import pytest
from _pytest.doctest import DoctestTextfile

# The site's build code (a griffe extension) needs the docs venv, not the test one; gpu/ holds
# generated GPU reports, not examples.
collect_ignore = ["_ext", "gpu"]


def pytest_collect_file(
    file_path: pathlib.Path, parent: pytest.Collector
) -> pytest.Collector | None:
    if file_path.suffix == ".md":
        return DoctestTextfile.from_parent(parent, path=file_path)
    return None
