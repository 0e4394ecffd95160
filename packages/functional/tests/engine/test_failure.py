"""One rank fails inside a shardopt API: every other rank raises RankFailedError within seconds,
naming it, instead of waiting for the process group's timeout.

The failing rank (the last) stays alive for ``HOLD_S`` after its error, as a process that logs,
cleans up or waits would: the others cannot learn of it from a closed connection.
``scripts/failure_matrix.py`` runs every case of ``CASES`` at W = 2 and 3 against any checkout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.core import adam, plan_partition
from shardopt.functional.engine._failure import MAX_TEXT, error_text
from shardopt.testing import World

HOLD_S = 3.0  # the failing rank's process stays this long after its error
Act = Callable[[], Any]


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 4))


def _backward(model: torch.nn.Module) -> None:
    model(torch.randn(2, 8)).square().sum().backward()


def _oom() -> RuntimeError:
    return RuntimeError("CUDA out of memory (a stand-in)")


def zero_step_closure(failing: bool) -> Act:
    from shardopt.optim import ZeroRedundancyOptimizer

    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

    def closure() -> torch.Tensor:
        if failing:
            raise _oom()
        return torch.tensor(0.0)

    _backward(model)
    return lambda: zero.step(closure)


class UnprintableError(RuntimeError):
    """An error whose message cannot be formatted."""

    def __str__(self) -> str:
        raise ValueError("no message")


def zero_step_raises(error: Callable[[], BaseException]) -> Callable[[bool], Act]:
    """``zero.step`` whose closure raises ``error()`` on the failing rank."""

    def case(failing: bool) -> Act:
        from shardopt.optim import ZeroRedundancyOptimizer

        model = _model()
        zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)

        def closure() -> torch.Tensor:
            if failing:
                raise error()
            return torch.tensor(0.0)

        _backward(model)
        return lambda: zero.step(closure)

    return case


HUGE = "\x1b[2J\u202e" + "x" * (32 << 20) + "\n"  # 32 MiB, with escapes and a newline


def zero_step_bad_grad(failing: bool) -> Act:
    from shardopt.optim import ZeroRedundancyOptimizer

    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _backward(model)
    if failing:
        p = next(model.parameters())
        p.grad = torch.zeros_like(p).to_sparse()  # Adam refuses it, on this rank only
    return zero.step


def zero_add_param_group(failing: bool) -> Act:
    from shardopt.optim import ZeroRedundancyOptimizer

    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _backward(model)
    extra = torch.nn.Parameter(torch.zeros(3))
    return (lambda: zero.add_param_group({"params": [extra]})) if failing else zero.step


def zero_consolidate(failing: bool) -> Act:
    from shardopt.optim import ZeroRedundancyOptimizer

    model = _model()
    zero = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    _backward(model)
    zero.step()
    if failing:
        zero.optim.state_dict = lambda: (_ for _ in ()).throw(_oom())
    return lambda: zero.consolidate_state_dict(to=0)


def shard_step_bad_grad(failing: bool) -> Act:
    from shardopt.functional import shard

    params = list(_model().parameters())
    sharded = shard(adam(1e-3), plan_partition(params, dist.get_world_size()), stage=2)
    state = sharded.init(params)
    grads = [torch.ones_like(p) for p in params]
    if failing:
        grads[0] = torch.ones(3)  # of the wrong shape: refused on this rank only
    return lambda: sharded.step(params, grads, state)


def grad_hooks_oom(failing: bool) -> Act:
    from shardopt.functional import register_grad_hooks, shard

    model = _model()
    params = list(model.parameters())
    sharded = shard(adam(1e-3), plan_partition(params, dist.get_world_size()), stage=2)
    state = sharded.init(params)
    register_grad_hooks(params, state)
    if failing:  # the reduction's staging cannot be allocated
        state.reducer.grads.start_reduce = lambda *a, **k: (_ for _ in ()).throw(_oom())
    return lambda: _backward(model)


def consolidate_oom(failing: bool) -> Act:
    import shardopt.functional.checkpoint._torch_format as torch_format
    from shardopt.functional import consolidate_state_dict, shard

    params = list(_model().parameters())
    sharded = shard(adam(1e-3), plan_partition(params, dist.get_world_size()))
    state = sharded.init(params)
    state = sharded.step(params, [torch.ones_like(p) for p in params], state)
    if failing:
        torch_format.gather_scalars = lambda *a, **k: (_ for _ in ()).throw(_oom())
    return lambda: consolidate_state_dict(state, None, to=0)


def average_user_error(failing: bool) -> Act:
    from shardopt.functional import average_params

    params = [torch.ones(4), torch.ones(2)]
    return lambda: average_params([*params, "not a tensor"] if failing else params)


def save_failed_write(failing: bool) -> Act:
    import os
    import tempfile

    from torch.distributed.checkpoint import FileSystemWriter

    from shardopt.functional import save_checkpoint, shard

    class FailingWriter(FileSystemWriter):
        def write_data(self, plan: Any, planner: Any) -> Any:
            raise OSError("disk full (a stand-in)")

    params = list(_model().parameters())
    sharded = shard(adam(1e-3), plan_partition(params, dist.get_world_size()))
    state = sharded.init(params)
    root = [tempfile.mkdtemp()]
    dist.broadcast_object_list(root)  # one directory for every rank
    writer = FailingWriter if failing else FileSystemWriter
    return lambda: save_checkpoint(state, os.path.join(root[0], "ckpt"), writer=writer)


CASES: dict[str, Callable[[bool], Act]] = {
    "zero.step/closure raises": zero_step_closure,
    "zero.step/bad gradient": zero_step_bad_grad,
    "zero.step/unprintable error": zero_step_raises(UnprintableError),
    "zero.step/32 MiB error with escapes": zero_step_raises(lambda: RuntimeError(HUGE)),
    "zero.add_param_group on one rank": zero_add_param_group,
    "zero.consolidate_state_dict/out of memory": zero_consolidate,
    "shard.step/bad gradient": shard_step_bad_grad,
    "grad hooks/out of memory": grad_hooks_oom,
    "consolidate_state_dict/out of memory": consolidate_oom,
    "average_params/bad input": average_user_error,
    "save_checkpoint/failed write": save_failed_write,
}


def run_case(rank: int, world: int, case: str, hold: float = HOLD_S) -> tuple[str, float, str]:
    """Every rank runs ``case``'s API, the last one failing; returns (error type or "no error",
    seconds until it returned or raised, message). Ends by destroying the group."""
    failing = rank == world - 1
    act = CASES[case](failing)
    dist.barrier()
    start = time.perf_counter()
    try:
        act()
        out = ("no error", time.perf_counter() - start, "")
    except BaseException as exc:  # (any error of the API)
        out = (type(exc).__name__, time.perf_counter() - start, error_text(exc, 1 << 16))
    if failing:
        time.sleep(hold)
    dist.destroy_process_group()  # the group cannot be used after a failure
    return out


TESTED = [  # (case, W, what the others' error must say besides the failing rank)
    ("zero.step/closure raises", 3, "RuntimeError: CUDA out of memory"),
    ("zero.add_param_group on one rank", 2, "different collectives"),
    ("shard.step/bad gradient", 2, "ValueError: shard: expected grads[0] of shape"),
    ("grad hooks/out of memory", 3, "RuntimeError: CUDA out of memory"),
    ("zero.consolidate_state_dict/out of memory", 2, "RuntimeError: CUDA out of memory"),
    ("zero.step/unprintable error", 2, "UnprintableError: <message unavailable: its __str__"),
    ("zero.step/32 MiB error with escapes", 2, "RuntimeError: \\x1b[2J\\u202exxxx"),
]


@pytest.mark.parametrize(("case", "n", "says"), TESTED, ids=[f"{c}-W{n}" for c, n, _ in TESTED])
@pytest.mark.world("n", backend="gloo", timeout=60, fresh=True)  # it destroys the group
def test_when_one_rank_fails_every_other_rank_raises_rank_failed_error_naming_it(
    world: World, case: str, n: int, says: str
) -> None:
    from shardopt.functional import RankFailedError

    kind, seconds, message = run_case(world.rank, n, case)
    if world.rank == n - 1:
        assert kind != "no error"  # its own error (add_param_group: the mismatch, named)
        return
    assert kind == RankFailedError.__name__, message
    assert seconds < HOLD_S  # told through the store, not by the failing rank's exit
    assert f"rank {n - 1}" in message
    assert says in message
    assert len(message) < MAX_TEXT + 300  # the published text is bounded
    assert message.isprintable()  # and escaped


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (ValueError("plain"), "ValueError: plain"),
        (ValueError("a\nb\x1b[0m\u202ec\x00"), "ValueError: a\\nb\\x1b[0m\\u202ec\\x00"),
        (
            UnprintableError(),
            "UnprintableError: <message unavailable: its __str__ raised ValueError>",
        ),
    ],
    ids=["plain", "control-characters", "unprintable"],
)
def test_the_published_text_escapes_control_characters_and_survives_unprintable_errors(
    error: BaseException, text: str
) -> None:
    assert error_text(error) == text


def test_the_published_text_is_at_most_4_kib_and_names_the_whole_length() -> None:
    text = error_text(RuntimeError("\x07" * (32 << 20)))
    assert len(text) == MAX_TEXT == 4096
    assert text.startswith("RuntimeError: \\x07\\x07")
    assert text.endswith(f" ... [cut: {len('RuntimeError: ') + (32 << 20)} characters in all]")
