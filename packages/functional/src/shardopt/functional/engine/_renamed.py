"""Old names that still work, with a warning that names the new one ([Note: renamed names])."""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["renamed_keyword", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])

# [Note: renamed names]
# Issue 39 gave each concept one word (docs/glossary.md), which renamed some public names: a
# process group is ``process_group=`` (``group=`` before), the parameter half of the engine is
# ``ParamBuffers`` (``FlatLayout``), a state field's granularity is ``FieldGranularity``
# (``FieldKind``), a sharded state's buffers are ``param_buffers`` (``layout``). The old names
# still work, each with one FutureWarning naming the new name, and a later release removes them.
# Core does the same for its own names ([Note: renamed core names]), and the testing harness
# for ``World.group``.


def warn_renamed(old: str, new: str) -> None:
    """Warns (FutureWarning, at the caller's caller) that ``old`` is now ``new``."""
    warnings.warn(
        f"{old} is renamed {new} (one meaning per word: see the glossary of the docs); the old "
        "name will be removed in a later release",
        FutureWarning,
        stacklevel=3,
    )


def renamed_keyword(api: str, old: str, new: str) -> Callable[[F], F]:
    """Lets a function still take its keyword ``old`` as ``new``, with a warning."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs:
                    raise TypeError(f"{api}: got both {old}= and {new}=; pass {new}= only")
                warn_renamed(f"{api}({old}=)", f"{api}({new}=)")
                kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)

        return call  # type: ignore[return-value]

    return wrap
