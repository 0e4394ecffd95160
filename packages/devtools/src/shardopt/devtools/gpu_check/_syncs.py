"""Item d's machinery: every host synchronisation that CUDA's sync debug mode reports, each with
the frame inside shardopt that caused it."""

from __future__ import annotations

import contextlib
import os
import traceback
import warnings
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

__all__ = ["SYNC_WARNING", "culprit", "recording_syncs", "sync_debug_mode", "tally"]

# [Note: listing every host sync]
# torch.cuda.set_sync_debug_mode("error") raises at the first synchronising call, which names
# one sync only. "warn" makes each one a UserWarning ("called a synchronizing CUDA operation")
# raised while the offending Python frame is still on the stack; with the "always" filter and
# our own showwarning, every warning is seen and the stack at that moment tells which line of
# shardopt made the call (the innermost frame under a shardopt package, this check's own
# frames excepted), so the report lists them all, counted.
SYNC_WARNING = "synchronizing CUDA operation"
_PACKAGE = os.sep + "shardopt" + os.sep
_OURS = os.sep + os.path.join("shardopt", "devtools") + os.sep


class _Frame(Protocol):
    filename: str
    lineno: int | None
    name: str


def _short(filename: str) -> str:
    """``filename`` from its last ``shardopt`` or ``torch`` folder on."""
    parts = filename.split(os.sep)
    for anchor in ("shardopt", "torch"):
        if anchor in parts:
            at = len(parts) - 1 - parts[::-1].index(anchor)
            return "/".join(parts[at:])
    return os.path.basename(filename)


def culprit(stack: Sequence[_Frame]) -> str:
    """The innermost frame of ``stack`` (outermost first, as ``traceback.extract_stack`` gives
    it) inside shardopt and outside this check, as ``shardopt/...py:LINE in NAME``; else the
    innermost frame, marked as outside shardopt.

    Example:
        >>> import traceback
        >>> frames = [traceback.FrameSummary("/x/shardopt/functional/_shard.py", 7, "step"),
        ...           traceback.FrameSummary("/x/torch/_tensor.py", 9, "item")]
        >>> culprit(frames)
        'shardopt/functional/_shard.py:7 in step'
    """
    for frame in reversed(stack):
        path = frame.filename
        if _PACKAGE in path and _OURS not in path:
            return f"{_short(path)}:{frame.lineno} in {frame.name}"
    if not stack:
        return "(no Python frame)"
    last = stack[-1]
    return f"(outside shardopt) {_short(last.filename)}:{last.lineno} in {last.name}"


def tally(culprits: Sequence[str]) -> list[str]:
    """Each distinct culprit once, most frequent first (ties in order of first sight), with its
    count.

    Example:
        >>> tally(["a.py:1 in f", "b.py:2 in g", "b.py:2 in g"])
        ['b.py:2 in g (2x)', 'a.py:1 in f (1x)']
    """
    counts = Counter(culprits)
    first = {c: i for i, c in reversed(list(enumerate(culprits)))}
    ordered = sorted(counts, key=lambda c: (-counts[c], first[c]))
    return [f"{c} ({counts[c]}x)" for c in ordered]


@contextlib.contextmanager
def recording_syncs() -> Iterator[list[str]]:
    """Collects the culprit of every sync warning raised inside (see [Note: listing every host
    sync]); other warnings are shown as usual."""
    found: list[str] = []
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if SYNC_WARNING in str(message):
            found.append(culprit(traceback.extract_stack()[:-1]))
        else:
            shown(message, category, filename, lineno, *rest)

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show  # type: ignore[assignment]
        yield found


@contextlib.contextmanager
def sync_debug_mode(torch_module: Any, mode: str = "warn") -> Iterator[None]:
    """``torch.cuda.set_sync_debug_mode(mode)`` inside, the previous mode restored after."""
    cuda = torch_module.cuda
    previous = cuda.get_sync_debug_mode()
    cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        cuda.set_sync_debug_mode(previous)
