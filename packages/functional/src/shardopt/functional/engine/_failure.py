"""Failing together: a rank that fails inside a shardopt API stops the others within seconds."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import time
import unicodedata
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch.distributed as dist

__all__ = [
    "failing_together",
    "RankFailedError",
    "completed",
    "error_text",
    "fails_together",
    "raised_on_every_rank",
]

F = TypeVar("F", bound=Callable[..., Any])
E = TypeVar("E", bound=BaseException)

# [Note: failing together]
# A collective waits for every rank of its group. When one rank raises inside a shardopt API
# (its own input, the user's closure, an out-of-memory error, a failed write) while the others
# are already in, or about to enter, a collective of that API, those others would wait for the
# process group's timeout (gloo's default: 30 minutes) and their logs would show a timeout, not
# the cause. So:
# - every public API that communicates runs under ``fails_together(api)``: an exception leaving
#   it on one rank is published in the default store (``shardopt/failed``: the global rank, the
#   API, the error's type and message) before it propagates there, and under NCCL the rank aborts
#   its communicator, so that the others' kernels end with an error instead of waiting;
# - every wait of shardopt on a gloo collective is ``completed(work)``: it waits in slices of
#   ``POLL_S``; while the collective is not done, it looks in the store after each slice, and
#   once another rank's failure is there (seen twice, a slice apart) it raises
#   RankFailedError naming that rank, its API and its error. A collective that completes within
#   a slice costs nothing more: no collective and no store access on the successful path.
# A rank in one API while another is in a different one (``add_param_group`` on one rank,
# ``step`` on the others) is no failure to publish, yet both wait forever. So a wait still
# pending after one slice also announces where it waits (``shardopt/waiting/<rank>``: the
# outermost shardopt API of the rank), and a rank that finds another waiting in a different API
# raises RankFailedError naming it and its API. The announcement is withdrawn when the wait ends.
# Errors that every rank raises together by construction (the cross-rank agreement's,
# [Note: cross-rank validation]) are not published: no rank waits for another there. A rank that
# published and is called again (the user caught the error and goes on) withdraws its record
# first. After a RankFailedError the process group is unusable (its collective is still
# pending on the waiting ranks): end the processes and restart from a checkpoint. Under NCCL the
# waits are not sliced (a timed-out NCCL wait aborts the communicator): there the failing rank's
# abort is what ends the others' collectives, reported by torch's own NCCL errors.

KEY = "shardopt/failed"
MAX_TEXT = 4096  # characters of an error's published text (see [Note: publishing an error])
POLL_S = 0.5  # a failure is seen within about 2 POLL_S of being published

_state: dict[str, Any] = {"posted": False, "seen": None, "waiting": False, "enabled": True}
_apis: list[str] = []  # the shardopt APIs this process is inside, outermost first


class RankFailedError(RuntimeError):
    """Raised on the other ranks when one rank failed inside a shardopt API that communicates
    (see [Note: failing together]); the process group can no longer be used."""

    def __init__(self, rank: int, api: str, error: str) -> None:
        self.rank, self.api, self.error = rank, api, error
        super().__init__(
            f"{api}: rank {rank} failed ({error}); this rank stopped waiting for it. The process "
            "group can no longer be used: end every process and restart from a checkpoint"
        )

    def __reduce__(self) -> tuple[Any, tuple[int, str, str]]:
        return type(self), (self.rank, self.api, self.error)  # pickles (a process's report)


def raised_on_every_rank(exc: E) -> E:
    """Marks ``exc`` as raised on every rank together (never published); returns it."""
    exc.__dict__["_shardopt_every_rank"] = True
    return exc


def _store() -> Any:
    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        return dist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


def _polling() -> bool:
    """Whether waits are sliced: the default group's backend is not NCCL."""
    return dist.is_initialized() and "nccl" not in str(dist.get_backend()).lower()


# [Note: publishing an error]
# What a failing rank publishes goes into every other rank's error message and log, so it is
# made safe to print whatever the exception holds: ``error_text`` formats it as
# ``"<type>: <message>"``; a message whose ``__str__`` raises becomes a placeholder naming that
# error (the failure is published all the same: the others must not wait for the timeout);
# control and format characters (newlines, escapes, bidirectional overrides) are written as
# Python escapes (``\n``, ``\x1b``, ``\u202e``); the text is cut to MAX_TEXT characters, its
# end replaced by the length of the whole. Publishing never replaces the rank's own exception.


def _escaped(text: str) -> str:
    """``text`` with its control, format and separator characters as Python escapes."""
    if text.isprintable():
        return text
    out = []
    for ch in text:
        if ch == " " or unicodedata.category(ch) not in ("Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"):
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def error_text(exc: BaseException, limit: int = MAX_TEXT) -> str:
    r"""``"<type>: <message>"`` of ``exc``, escaped and at most ``limit`` characters (see
    [Note: publishing an error]).

    Example:
        >>> error_text(ValueError("bad\x1b[2J value"))
        'ValueError: bad\\x1b[2J value'
        >>> class Odd(Exception):
        ...     def __str__(self):
        ...         raise RuntimeError("no")
        >>> error_text(Odd())
        'Odd: <message unavailable: its __str__ raised RuntimeError>'
        >>> len(error_text(ValueError("x" * 10**6), limit=100))
        100
    """
    try:
        message = str(exc)
    except BaseException as inner:  # (any __str__ failure, still published)
        message = f"<message unavailable: its __str__ raised {type(inner).__name__}>"
    full = f"{type(exc).__name__}: {message}"
    text = _escaped(full[:limit])  # (an escape is 2 to 10 characters)
    if len(text) <= limit and len(full) <= limit:
        return text
    cut = f" ... [cut: {len(full)} characters in all]"
    return text[: limit - len(cut)] + cut


def publish(api: str, exc: BaseException) -> None:
    """Publishes this rank's failure in ``api`` (see [Note: failing together]); never raises
    (an error it meets is dropped: the rank's own exception is the one to raise)."""
    try:
        store = _store()
        if store is None or exc.__dict__.get("_shardopt_every_rank"):
            return
        _post(store, {"rank": dist.get_rank(), "api": api, "error": error_text(exc)})
    except Exception:  # (the rank's own exception matters more)
        return


def _post(store: Any, record: dict[str, Any]) -> None:
    """Writes this rank's failure ``record`` for the others; aborts the communicator (NCCL)."""
    try:
        store.set(KEY, json.dumps(record))
        _state["posted"] = True
    except Exception:  # the store itself is gone: nothing to tell the others with
        return
    if not _polling():
        abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
        if abort is not None:
            abort()  # NCCL: the others' kernels end with an error


def _withdraw() -> None:
    """Removes this rank's own record, from a failure the user caught before going on."""
    if _state["posted"]:
        _state["posted"] = False
        store = _store()
        if store is not None:
            store.delete_key(KEY)


def _published_by_another() -> dict[str, Any] | None:
    """The failure record in the store if another rank published it."""
    store = _store()
    if store is None or not store.check([KEY]):
        return None
    record = json.loads(store.get(KEY))
    return None if record["rank"] == dist.get_rank() else record


def _peer_failure() -> dict[str, Any] | None:
    """Another rank's published failure, once seen on two consecutive looks."""
    record = _published_by_another()
    seen, _state["seen"] = _state["seen"], record
    return record if record is not None and seen == record else None


def _waiting_key(rank: int) -> str:
    return f"shardopt/waiting/{rank}"


def _announce(store: Any) -> None:
    """Announces that this rank waits in its outermost API (see [Note: failing together])."""
    if not _state["waiting"]:
        _state["waiting"] = True
        store.set(_waiting_key(dist.get_rank()), _apis[0] if _apis else "")


def _unannounce() -> None:
    if _state["waiting"]:
        _state["waiting"] = False
        store = _store()
        if store is not None:
            store.delete_key(_waiting_key(dist.get_rank()))


def _elsewhere(store: Any) -> dict[str, Any] | None:
    """Another rank waiting in a different API than this one's, as a failure record (and this
    rank's own record of it, posted for the others)."""
    mine, me = (_apis[0] if _apis else "") or "shardopt", dist.get_rank()
    for r in range(dist.get_world_size()):
        key = _waiting_key(r)
        if r == me or not store.check([key]):
            continue
        theirs = store.get(key).decode() or "a collective outside shardopt"
        if theirs != mine:
            both = f"rank {me} waits in {mine}, rank {r} in {theirs}: different collectives"
            _post(store, {"rank": me, "api": mine, "error": both})
            return {"rank": r, "api": mine, "error": both}
    return None


def completed(work: Any) -> None:
    """Waits for ``work`` (a collective's handle); raises RankFailedError if another rank
    failed meanwhile, or waits in another API (see [Note: failing together])."""
    if work is None:
        return
    if not _state["enabled"] or not _polling():  # (disabled: benchmarks/bench_fail_fast.py)
        work.wait()
        return
    slice_ = datetime.timedelta(seconds=POLL_S)
    try:
        while True:
            try:
                work.wait(timeout=slice_)
                _state["seen"] = None
                return
            except RuntimeError as exc:
                if "timed out" not in str(exc).lower():
                    failure = _peer_failure() or _peer_failure_now()
                    if failure is not None:
                        raise RankFailedError(**failure) from exc
                    raise
            store = _store()
            failure = _peer_failure()
            if failure is None and store is not None:
                _announce(store)
                failure = _elsewhere(store)
            if failure is not None:
                raise RankFailedError(**failure)
    finally:
        _unannounce()


def _peer_failure_now() -> dict[str, Any] | None:
    """Another rank's published failure, looked for at once (a collective that broke)."""
    time.sleep(0.05)  # the failing rank publishes before its exit breaks the connection
    return _published_by_another()


@contextlib.contextmanager
def failing_together(api: str) -> Iterator[None]:
    """Runs its body under [Note: failing together]: an exception leaving it is published for
    the other ranks, then raised here. (A ``with`` block, not a wrapper: the body's own calls
    stay in its file, so a traced path does not pass through this one.)"""
    if not _state["enabled"]:
        yield
        return
    _withdraw()
    _apis.append(api)
    try:
        yield
    except RankFailedError:
        raise
    except BaseException as exc:
        if not exc.__dict__.get("_shardopt_published"):
            exc.__dict__["_shardopt_published"] = True
            publish(api, exc)
        raise
    finally:
        _apis.pop()


def fails_together(api: str) -> Callable[[F], F]:
    """Runs the decorated API under [Note: failing together] (``failing_together``)."""

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with failing_together(api):
                return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
