"""The functional local-SGD step against torch's PostLocalSGDOptimizer, and its schedule."""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
from torch.func import grad

from shardopt.core import scale_by_learning_rate, sgd
from shardopt.core.blocks import tree_leaves
from shardopt.functional import average_params, averaging_due, local_sgd_step
from shardopt.testing import spawn

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import PostLocalSGDOptimizer

STEPS = 30


@pytest.mark.parametrize(("period", "warmup_steps"), [(1, 0), (4, 0), (4, 5), (3, 7), (7, 2)])
def test_averaging_due_is_torchs_periodic_schedule(
    monkeypatch: pytest.MonkeyPatch, period: int, warmup_steps: int
) -> None:
    torch_steps: list[int] = []
    averager = torch_averagers.PeriodicModelAverager.__new__(torch_averagers.PeriodicModelAverager)
    averager.__dict__.update(period=period, warmup_steps=warmup_steps, step=0, process_group=1)
    monkeypatch.setattr(
        torch_averagers.utils,
        "average_parameters_or_parameter_groups",
        lambda params, group: torch_steps.append(averager.step),
    )
    for _ in range(40):
        averager.average_parameters([])
    ours = [s for s in range(40) if averaging_due(s, period=period, warmup_steps=warmup_steps)]
    assert ours == torch_steps


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"step": 0, "period": 0}, ValueError, "averaging_due: expected period >= 1, got 0"),
        ({"step": 0, "period": 2, "warmup_steps": -3}, ValueError, "warmup_steps >= 0, got -3"),
        ({"step": -1, "period": 2}, ValueError, "expected step >= 0, got -1"),
        ({"step": 0, "period": 2.0}, TypeError, "expected an integer period, got 2.0"),
    ],
)
def test_averaging_due_rejects_bad_schedules(
    kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=re.escape(message)):
        averaging_due(**kwargs)


def _params(rank: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 4, generator=gen),
        "b": torch.randn(3, generator=gen),
        "frozen": torch.full((2,), float(rank)),  # never has a gradient: never averaged
    }


def _loss(params: Mapping[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(torch.tanh(x @ params["w"].T + params["b"]), y)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 4, generator=gen), torch.randn(6, 3, generator=gen)


def test_local_sgd_step_off_schedule_is_the_pure_update_and_leaves_inputs_alone() -> None:
    tx = sgd(lr=0.1, momentum=0.9)
    params = _params()
    grads = {"w": torch.ones(3, 4), "b": torch.ones(3), "frozen": None}
    state = tx.init(params)
    copies = [t.clone() for t in tree_leaves((params, grads, state)) if t is not None]
    new_params, new_state = local_sgd_step(tx, params, grads, state, step=2, period=4)
    after = [t for t in tree_leaves((params, grads, state)) if t is not None]
    assert all(torch.equal(a, b) for a, b in zip(copies, after))
    updates, expected_state = tx.update(grads, state, params)
    assert torch.equal(new_params["w"], params["w"] + updates["w"])
    assert new_params["frozen"] is params["frozen"]
    for a, b in zip(tree_leaves(new_state), tree_leaves(expected_state)):
        assert (a is None and b is None) or torch.equal(a, b)


def test_average_params_without_a_process_group_asks_for_init_process_group() -> None:
    with pytest.raises(RuntimeError, match="average_params: expected an initialized"):
        average_params([torch.ones(1)])


@pytest.mark.parametrize(
    ("params", "where", "error", "message"),
    [
        ([torch.ones(1)], [True, True], ValueError, "expected where with 1 leaves like params"),
        ([torch.ones(1, dtype=torch.int32)], None, ValueError, "got torch.int32"),
    ],
)
def test_average_params_rejects_bad_input(
    params: Any, where: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        average_params(params, where=where)


def _run_torch(rank: int) -> dict[str, torch.Tensor]:
    tensors = {k: torch.nn.Parameter(v) for k, v in _params(rank).items()}
    tensors["frozen"].requires_grad_(False)
    inner = torch.optim.SGD(tensors.values(), lr=0.1, momentum=0.9)
    opt = PostLocalSGDOptimizer(inner, torch_averagers.PeriodicModelAverager(3, 4))
    for step in range(STEPS):
        opt.zero_grad()
        _loss(tensors, *_batch(rank, step)).backward()
        opt.step()
    return {k: v.detach() for k, v in tensors.items()}


def _run_functional(rank: int) -> tuple[dict[str, torch.Tensor], bool]:
    tx = sgd(lr=0.1, momentum=0.9)
    params = _params(rank)
    state = tx.init(params)
    untouched = True
    for step in range(STEPS):
        grads: dict[str, Any] = grad(_loss)(params, *_batch(rank, step))
        grads["frozen"] = None
        old, snapshot = params, {k: v.clone() for k, v in params.items()}
        params, state = local_sgd_step(
            tx, params, grads, state, step=step, period=3, warmup_steps=4
        )
        untouched &= all(torch.equal(snapshot[k], old[k]) for k in old)
    return params, untouched


def _world(rank: int, world_size: int) -> dict[str, Any]:
    theirs = _run_torch(rank)
    ours, untouched = _run_functional(rank)
    errors = {
        k: ((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30)).item()
        for k in ours
    }
    gathered = [torch.empty(3) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, ours["b"])
    # A plain-SGD run with an average at the last step: the ranks end equal.
    tx = scale_by_learning_rate(0.1)
    params, state = _params(rank), tx.init(_params(rank))
    grads = grad(_loss)(params, *_batch(rank, 0))
    params, state = local_sgd_step(tx, params, grads, state, step=5, period=5)
    last = [torch.empty(4) for _ in range(dist.get_world_size())]
    dist.all_gather(last, params["w"][0].contiguous())
    return {
        "errors": errors,
        "ranks differ at the end of torch's run": not torch.equal(gathered[0], gathered[1]),
        "frozen": ours["frozen"].tolist(),
        "averaged step agrees": torch.equal(last[0], last[1]),
        "inputs unchanged": untouched,
    }


def test_local_sgd_step_matches_torch_post_local_sgd_for_30_steps_on_2_ranks() -> None:
    for rank, out in enumerate(spawn(_world, 2, backend="gloo", timeout=120)):
        assert all(e <= 1e-6 for e in out["errors"].values()), out["errors"]
        assert out["ranks differ at the end of torch's run"]
        assert out["frozen"] == [float(rank)] * 2
        assert out["averaged step agrees"]
        assert out["inputs unchanged"]
