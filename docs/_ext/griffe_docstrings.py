"""A griffe extension for the API pages, which reads the docstrings as they are written for
the doctests and for Sphinx-style readers, and adapts two habits before griffe parses them:

- the doctests are headed ``Example:``, which griffe's Google parser reads as an admonition
  (only ``Examples:`` is its examples section), so the examples would render as prose;
- cross-references are Sphinx roles (``:func:`shard```, ``:class:`~shardopt.core.Plan```),
  which Markdown shows verbatim; they become code spans (a ``~`` keeps the last name, as
  Sphinx shows it).

The source is left as it is: the doctests run from it either way."""

from __future__ import annotations

import re
from typing import Any

import griffe

_HEADING = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_ROLE = re.compile(r":(?:func|class|meth|mod|attr|data|exc|obj):`(~?)([^`]+)`")


def _code(match: re.Match[str]) -> str:
    tilde, target = match.groups()
    return f"`{target.rsplit('.', 1)[-1] if tilde else target}`"


class DocstringHabits(griffe.Extension):
    """Reads an ``Example:`` heading as ``Examples:`` and Sphinx roles as code spans."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _HEADING.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _ROLE.sub(_code, text)
