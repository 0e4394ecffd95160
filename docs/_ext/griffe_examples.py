"""A griffe extension for the API pages: the docstrings head their doctests ``Example:``, which
griffe's Google parser reads as an admonition (only ``Examples:`` is its examples section), so
the examples would render as prose. This renames the heading before griffe parses the
docstring; the source is left as it is (the doctests run from it either way)."""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(griffe.Extension):
    """Reads an ``Example:`` heading as ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _HEADING.sub(r"\1Examples:", obj.docstring.value)
