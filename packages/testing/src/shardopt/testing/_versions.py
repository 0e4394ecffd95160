"""The running torch's version, and a pytest mark that skips what needs a newer one."""

from __future__ import annotations

import re

import pytest
import torch

__all__ = ["requires_torch", "torch_version"]


def torch_version(text: str | None = None) -> tuple[int, int, int]:
    """``(major, minor, patch)`` of ``text`` (default: the running torch's ``__version__``).

    Local and pre-release tags are ignored: ``2.4.1+cu121`` and ``2.10.0a0`` read as releases.

    Example:
        >>> torch_version("2.4.1+cu121"), torch_version("2.10.0a0+git1234")
        ((2, 4, 1), (2, 10, 0))
    """
    text = torch.__version__ if text is None else text
    match = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"torch_version: expected a version like '2.4.1', got {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def requires_torch(minimum: str, needs: str) -> pytest.MarkDecorator:
    """A ``skipif`` mark for a test that needs torch ``minimum`` or newer, for ``needs``.

    The reason names both versions and what is missing, so a skip on an older torch says why.

    Example:
        >>> mark = requires_torch("2.4", "torch.optim.AdamW")
        >>> mark.kwargs["reason"].startswith("needs torch >= 2.4 (torch.optim.AdamW)")
        True
    """
    running = torch_version()
    reason = f"needs torch >= {minimum} ({needs}); this is torch {torch.__version__}"
    return pytest.mark.skipif(running < torch_version(minimum), reason=reason)
