"""Old names that still resolve, with a warning that names the new one."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["renamed_getattr"]

# [Note: renamed core names]
# Issue 39 gave each concept one word (docs/glossary.md), which renamed some of core's public names
# (``FlatGroup``, ``update_flat_`` and the flat rules). The old names still resolve through the
# module's ``__getattr__`` (PEP 562, so ``from m import Old`` works too), each with a FutureWarning
# naming the new name; they are not in ``__all__``, and a later release removes them. The other
# packages do the same for theirs ([Note: renamed names] in shardopt.functional's engine).


def renamed_getattr(
    module: str, names: Mapping[str, str], namespace: Mapping[str, Any]
) -> Callable[[str], Any]:
    """A module ``__getattr__`` that resolves each old name of ``names`` to its new one."""

    def resolve(name: str) -> Any:
        new = names.get(name)
        if new is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        warnings.warn(
            f"{module}.{name} is renamed {module}.{new} (one meaning per word: see the "
            "glossary of the docs); the old name will be removed in a later release",
            FutureWarning,
            stacklevel=2,
        )
        return namespace[new]

    return resolve
