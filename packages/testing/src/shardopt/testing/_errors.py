"""Errors of a world: a rank that raised, exited early or did not finish in time."""

from __future__ import annotations

import enum
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Outcome",
    "RankError",
    "RankExitError",
    "RankFailure",
    "WorldError",
    "WorldTimeoutError",
    "format_world_error",
]

# Output tail kept in an error message; the whole output is replayed on stdout anyway.
_OUTPUT_TAIL_CHARS = 4000


class Outcome(enum.Enum):
    """How a rank failed."""

    RAISED = "raised"  # fn (or the set-up around it) raised; the traceback came back
    EXITED = "exited"  # the process ended without reporting: os._exit, a signal, a crash
    TIMED_OUT = "timed out"  # still running at the deadline


@dataclass(frozen=True, slots=True)
class RankFailure:
    """One failed rank.

    Attributes:
        rank: the rank.
        outcome: how it failed.
        pid: its process id (gone by the time the error is raised).
        exitcode: process exit code; negative for a signal (``-9`` is SIGKILL); None if it was
            still running when stopped.
        exception_type: qualified name of the exception (RAISED only).
        message: ``str()`` of the exception (RAISED), or a note on why a rank ended (EXITED).
        traceback: the rank's formatted traceback (RAISED), or its Python stacks dumped at the
            deadline or at a crash (TIMED_OUT, EXITED), or "".
        output: the tail of what the rank wrote to stdout/stderr.
    """

    rank: int
    outcome: Outcome
    pid: int | None = None
    exitcode: int | None = None
    exception_type: str = ""
    message: str = ""
    traceback: str = ""
    output: str = ""

    def summary(self, world_size: int) -> str:
        """What happened to this rank, e.g. ``rank 1 of 2 raised ValueError: bad``."""
        who = f"rank {self.rank} of {world_size}"
        if self.outcome is Outcome.RAISED:
            message = f": {self.message}" if self.message else ""
            return f"{who} raised {self.exception_type}{message}"
        if self.outcome is Outcome.EXITED:
            note = f" ({self.message})" if self.message else ""
            return f"{who} {describe_exitcode(self.exitcode)} before returning a result{note}"
        return f"{who} did not finish in time"


def describe_exitcode(exitcode: int | None) -> str:
    """``exited with code 3`` / ``was killed by signal SIGKILL (9)``.

    Example:
        >>> describe_exitcode(-9)
        'was killed by signal SIGKILL (9)'
    """
    if exitcode is None:
        return "ended with an unknown status"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "signal"
        return f"was killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


class WorldError(RuntimeError):
    """A world failed: the base of RankError, RankExitError and WorldTimeoutError.

    Attributes:
        world_size: the world's size.
        failures: the failed ranks, the first (root cause) first.
        stopped: ranks that had not finished and were stopped by the harness.
    """

    def __init__(
        self,
        message: str,
        *,
        world_size: int = 0,
        failures: Sequence[RankFailure] = (),
        stopped: Sequence[int] = (),
    ) -> None:
        super().__init__(message)
        self.world_size = world_size
        self.failures = tuple(failures)
        self.stopped = tuple(stopped)
        # The first failing rank's exception object, when it could be sent back (RankError).
        self.exception: BaseException | None = None

    @property
    def ranks(self) -> tuple[int, ...]:
        """The failed ranks, root cause first."""
        return tuple(f.rank for f in self.failures)

    @property
    def pids(self) -> tuple[int, ...]:
        """Process ids of the failed ranks (for checks that nothing is left running)."""
        return tuple(f.pid for f in self.failures if f.pid is not None)

    def __reduce__(self) -> tuple[Any, ...]:
        # Keyword-only fields do not survive the default exception pickling (cls(*args)).
        state = {"world_size": self.world_size, "failures": self.failures, "stopped": self.stopped}
        return (_rebuild_world_error, (type(self), str(self), state))


def _rebuild_world_error(cls: type[WorldError], message: str, state: dict[str, Any]) -> WorldError:
    return cls(message, **state)


class RankError(WorldError):
    """A rank raised: ``rank``, its ``traceback`` and, when it could be sent back, ``exception``."""

    @property
    def rank(self) -> int:
        """The rank that raised first."""
        return self.failures[0].rank

    @property
    def traceback(self) -> str:
        """That rank's formatted traceback."""
        return self.failures[0].traceback


class RankExitError(WorldError):
    """A rank's process ended (os._exit, a signal, a crash) before it returned a result."""


class WorldTimeoutError(WorldError, TimeoutError):
    """Some ranks did not finish within the timeout; ``ranks`` names them."""


def format_world_error(
    api: str,
    world_size: int,
    failures: Sequence[RankFailure],
    stopped: Sequence[int],
    timeout: float,
    exception: BaseException | None = None,
) -> WorldError:
    """Builds the error for ``failures`` (root cause first) with each rank's details."""
    first = failures[0]
    error_type: type[WorldError]
    if first.outcome is Outcome.TIMED_OUT:
        late = [f.rank for f in failures]
        head = (
            f"{api}: ranks {late} of {world_size} did not finish within {timeout:g} s "
            f"and were stopped."
        )
        error_type = WorldTimeoutError
    else:
        head = f"{api}: {first.summary(world_size)}"
        error_type = RankError if first.outcome is Outcome.RAISED else RankExitError
    sections = [head]
    sections += [f"  also: {f.summary(world_size)}" for f in failures[1:]]
    if stopped:
        sections.append(f"  the ranks still running were stopped: {list(stopped)}")
    # Details of the root cause only (its peers' errors are usually its echo), but of every
    # late rank: together their stacks show who waits for whom.
    detailed = failures if first.outcome is Outcome.TIMED_OUT else failures[:1]
    for failure in detailed:
        sections.extend(_detail_sections(failure))
    error = error_type(
        "\n".join(sections), world_size=world_size, failures=failures, stopped=stopped
    )
    error.exception = exception
    return error


def _detail_sections(failure: RankFailure) -> list[str]:
    label = {
        Outcome.RAISED: "traceback",
        Outcome.EXITED: "stack at the crash",
        Outcome.TIMED_OUT: "Python stacks at the deadline",
    }[failure.outcome]
    sections = []
    if failure.traceback.strip():
        sections.append(f"---- rank {failure.rank} {label} ----\n{failure.traceback.rstrip()}")
    if failure.output.strip() and failure.outcome is not Outcome.RAISED:
        tail = failure.output[-_OUTPUT_TAIL_CHARS:]
        sections.append(f"---- rank {failure.rank} output (tail) ----\n{tail.rstrip()}")
    return sections
