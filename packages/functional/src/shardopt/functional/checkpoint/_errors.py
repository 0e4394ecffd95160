"""The error of a failed checkpoint save or load: an Exception naming the API, on every rank."""

from __future__ import annotations

from typing import Any

from shardopt.functional.engine._failure import error_text, raised_on_every_rank

__all__ = ["CheckpointError", "dcp_failure"]


class CheckpointError(RuntimeError):
    """A checkpoint save or load failed while reading or writing files (a failed write, a
    truncated or crafted file); raised on every rank of the group together.

    ``torch.distributed.checkpoint`` reports such failures as its ``CheckpointException``, a
    ``BaseException`` that ``except Exception`` does not catch: shardopt raises this instead,
    from it (``__cause__``), naming the API, the failed ranks and the first rank's error.
    """


def dcp_failure(api: str, exc: BaseException) -> CheckpointError:
    """``exc`` (DCP's CheckpointException, raised on every rank alike) as a CheckpointError.

    Example:
        >>> from torch.distributed.checkpoint import CheckpointException
        >>> failed = CheckpointException("save failed", {1: (OSError("disk full"), None)})
        >>> str(dcp_failure("save_checkpoint", failed))
        'save_checkpoint: failed on rank(s) [1]; rank 1: OSError: disk full'
    """
    failures: dict[int, Any] = dict(getattr(exc, "failures", None) or {})
    if not failures:
        return raised_on_every_rank(CheckpointError(f"{api}: failed: {error_text(exc)}"))
    first = min(failures)
    cause = failures[first]
    cause = cause[0] if isinstance(cause, tuple) else cause
    text = error_text(cause) if isinstance(cause, BaseException) else repr(cause)[:4096]
    error = CheckpointError(f"{api}: failed on rank(s) {sorted(failures)}; rank {first}: {text}")
    return raised_on_every_rank(error)
