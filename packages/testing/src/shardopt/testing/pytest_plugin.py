"""pytest plugin of shardopt.testing: the ``world`` marker and fixture, the ``gpu`` marker, and
the ``no_leaks`` fixture (worlds leave no process, file descriptor or temp dir behind)."""

from __future__ import annotations

import inspect
import pickle
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from shardopt.testing._errors import WorldError
from shardopt.testing._leaks import no_leaks, started_worlds
from shardopt.testing._markers import GPU_MARKER, WORLD_MARKER, skip_reason, world_request
from shardopt.testing._pool import close_pools, reusing_worlds
from shardopt.testing._spawn import spawn
from shardopt.testing._world import World, current_world

__all__ = [
    "no_leaks",
    "pytest_addoption",
    "pytest_configure",
    "pytest_unconfigure",
    "pytest_pyfunc_call",
    "pytest_runtest_setup",
    "started_worlds",
    "world",
]

_WARM = pytest.StashKey[Any]()

# [Note: world tests]
# A test marked @pytest.mark.world(n) is run by spawn(): pytest sets the fixtures up in its own
# process, then the test function and its fixture values are pickled to n ranks, which call it
# with `world` = their World. So fixture values must be picklable and are copies in each rank
# (a tmp_path is the same directory for all ranks). The test module is loaded by path in the
# ranks, asserts rewritten as pytest does (see [Note: loading test modules in ranks]), and
# the warning filters in force for the test are installed in the ranks too, so that
# `filterwarnings = error` holds there. The test fails with the first failing rank's
# traceback; pytest.skip() in any rank skips the test.


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--fresh-worlds",
        action="store_true",
        help="shardopt.testing: start every world's ranks afresh instead of reusing warm ones",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", WORLD_MARKER)
    config.addinivalue_line("markers", GPU_MARKER)
    if not config.getoption("--fresh-worlds", default=False):  # [Note: warm worlds]
        warm = reusing_worlds()
        warm.__enter__()
        config.stash[_WARM] = warm


def pytest_unconfigure(config: pytest.Config) -> None:
    warm = config.stash.get(_WARM, None)
    if warm is not None:
        warm.__exit__(None, None, None)
        close_pools()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    try:
        reason = skip_reason(item)
    except ValueError as exc:
        reason, misuse = None, str(exc)
    else:
        misuse = ""
    if misuse:
        pytest.fail(misuse, pytrace=False)  # outside the except: no chained traceback
    if reason is not None:
        pytest.skip(reason)


@pytest.fixture
def world(request: pytest.FixtureRequest) -> World | None:
    """The rank's World (rank, world_size, backend, device, process_group) in a ``world`` test."""
    if request.node.get_closest_marker("world") is None:
        pytest.fail(
            f"{request.node.nodeid}: the world fixture needs @pytest.mark.world(n) on the test",
            pytrace=False,
        )
    return None  # replaced by the rank's World in each rank (see [Note: world tests])


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    request = world_request(pyfuncitem)  # validated by pytest_runtest_setup already
    if request is None:
        return None
    names = [name for name in inspect.signature(pyfuncitem.obj).parameters]
    kwargs = {n: pyfuncitem.funcargs[n] for n in names if n in pyfuncitem.funcargs}
    wants_world = "world" in kwargs
    kwargs.pop("world", None)
    _check_picklable(pyfuncitem.nodeid, kwargs)
    failure = ""
    try:
        outcomes = spawn(
            run_test_on_rank,
            request.size,
            pyfuncitem.obj,
            kwargs,
            wants_world,
            _picklable_filters(),
            backend=request.backend,
            timeout=request.timeout,
            init_store=request.init_store,
            fresh=request.fresh,
        )
    except WorldError as exc:
        failure = str(exc)
    if failure:
        pytest.fail(failure, pytrace=False)  # outside the except: no chained traceback
    skipped = [reason for reason in outcomes if reason is not None]
    if skipped:
        pytest.skip(skipped[0])
    return True


def _check_picklable(nodeid: str, kwargs: dict[str, Any]) -> None:
    for name, value in kwargs.items():
        try:
            pickle.dumps(value)
        except Exception as exc:
            pytest.fail(
                f"{nodeid}: the value of {name!r} cannot be sent to the ranks of a world test "
                f"(fixture values and parameters must be picklable): {exc}",
                pytrace=False,
            )


def _picklable_filters() -> list[tuple[Any, ...]]:
    kept = []
    for entry in warnings.filters:
        try:
            pickle.dumps(entry)
        except Exception:
            continue
        kept.append(entry)
    return kept


def _as_regex(pattern: re.Pattern[str] | str | None) -> str:
    """A filter field as filterwarnings takes it: a plain string in a filter matches exactly."""
    if pattern is None:
        return ""
    if isinstance(pattern, str):
        return re.escape(pattern) + r"\Z"
    return pattern.pattern


def run_test_on_rank(
    rank: int,
    world_size: int,
    test: Callable[..., Any],
    kwargs: dict[str, Any],
    wants_world: bool,
    filters: list[tuple[Any, ...]],
) -> str | None:
    """Runs a world test's body in a rank; returns a skip reason, or None when it passed."""
    if wants_world:
        kwargs = {**kwargs, "world": current_world()}
    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, message, category, module, lineno in filters:
            warnings.filterwarnings(
                action,
                message=_as_regex(message),
                category=category,
                module=_as_regex(module),
                lineno=lineno,
                append=True,
            )
        try:
            test(**kwargs)
        except pytest.skip.Exception as exc:
            return str(exc.msg) or "skipped in a rank"
    return None
