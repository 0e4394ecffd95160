"""PostLocalSGDOptimizer against torch's, alone, after a reload, with DDP's hook and with ZeRO."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.algorithms.model_averaging.averagers as torch_averagers
import torch.distributed.algorithms.model_averaging.hierarchical_model_averager as torch_hier
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.post_localSGD_hook import (
    PostLocalSGDState,
    post_localSGD_hook,
)
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim._averagers import HierarchicalModelAverager, PeriodicModelAverager
from shardopt.optim._post_local_sgd import PostLocalSGDOptimizer
from shardopt.testing import spawn

with warnings.catch_warnings():  # torch.distributed.optim scripts its functional optimizers
    warnings.simplefilter("ignore", DeprecationWarning)
    from torch.distributed.optim import PostLocalSGDOptimizer as TorchPostLocalSGDOptimizer
    from torch.distributed.optim import ZeroRedundancyOptimizer

STEPS = 30
Factory = Callable[[], Any]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))


def _train_step(model: nn.Module, opt: Any, step: int) -> None:
    rank = dist.get_rank() if dist.is_initialized() else 0
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _assert_same(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{what}: parameter {name} differs"


def _lockstep(pairs: list[tuple[nn.Module, Any]], steps: range, what: str) -> None:
    """Trains each (model, optimizer) pair on the same batches; all models stay bitwise equal."""
    for step in steps:
        for model, opt in pairs:
            _train_step(model, opt, step)
        for model, _ in pairs[1:]:
            _assert_same(pairs[0][0], model, f"{what}, step {step}")


def _sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _check_periodic_with_reload() -> dict[str, Any]:
    """Ours and torch's for 30 steps; ours reloaded at step 15 continues like the others."""
    models = [_model() for _ in range(3)]
    ours = PostLocalSGDOptimizer(_sgd(models[0]), PeriodicModelAverager(4, 6))
    theirs = TorchPostLocalSGDOptimizer(
        _sgd(models[1]), torch_averagers.PeriodicModelAverager(4, 6)
    )
    reloaded = PostLocalSGDOptimizer(_sgd(models[2]), PeriodicModelAverager(4, 6))
    pairs = list(zip(models, [ours, theirs, reloaded]))
    _lockstep(pairs, range(15), "periodic")
    state = copy.deepcopy(reloaded.state_dict())
    out: dict[str, Any] = {"step saved": (state["step"], theirs.state_dict()["step"])}
    reloaded = PostLocalSGDOptimizer(_sgd(models[2]), PeriodicModelAverager(4, 6))
    reloaded.load_state_dict(state)
    pairs[2] = (models[2], reloaded)
    _lockstep(pairs, range(15, STEPS), "periodic after reload")
    out["steps"] = (ours.averager.step, theirs.averager.step, reloaded.averager.step)
    return out


def _check_zero() -> None:
    """A torch ZeroRedundancyOptimizer as the local optimizer, against torch's wrapper."""
    models = [_model() for _ in range(2)]
    zeros = [
        ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
        for m in models
    ]
    ours = PostLocalSGDOptimizer(zeros[0], PeriodicModelAverager(3, 2))
    theirs = TorchPostLocalSGDOptimizer(zeros[1], torch_averagers.PeriodicModelAverager(3, 2))
    _lockstep([(models[0], ours), (models[1], theirs)], range(STEPS), "ZeRO")


def _two_rank_world(rank: int, world_size: int) -> dict[str, Any]:
    out = _check_periodic_with_reload()
    _check_zero()
    return out


def test_post_local_sgd_matches_torch_with_periodic_averager_reload_and_zero_on_2_ranks() -> None:
    results = spawn(_two_rank_world, 2, backend="gloo", timeout=150)
    for out in results:
        assert out["step saved"] == (15, 15)
        assert out["steps"] == (STEPS, STEPS, STEPS)


def _ranks_agreeing(model: nn.Module) -> list[int]:
    """For each rank, the lowest rank holding exactly the same parameters."""
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, flat)
    return [next(j for j, h in enumerate(gathered) if torch.equal(g, h)) for g in gathered]


def _check_hierarchical() -> None:
    models = [_model() for _ in range(2)]
    adam = [torch.optim.Adam(m.parameters(), lr=0.01) for m in models]
    sizes = {2: 2, 6: 4}
    ours = PostLocalSGDOptimizer(adam[0], HierarchicalModelAverager(sizes, warmup_steps=3))
    theirs = TorchPostLocalSGDOptimizer(
        adam[1], torch_hier.HierarchicalModelAverager(sizes, warmup_steps=3)
    )
    _lockstep([(models[0], ours), (models[1], theirs)], range(STEPS), "hierarchical")


def _check_ddp_hook(warmup: int = 5, period: int = 4) -> list[list[int]]:
    """DDP with torch's post-localSGD hook (subgroups of 2) under ours and under torch's."""
    subgroup, _ = dist.new_subgroups_by_enumeration([[0, 1], [2, 3]])
    models = []
    for _ in range(2):
        ddp = DistributedDataParallel(_model())
        ddp.register_comm_hook(PostLocalSGDState(None, subgroup, warmup), post_localSGD_hook)
        models.append(ddp)
    ours = PostLocalSGDOptimizer(_sgd(models[0]), PeriodicModelAverager(period, warmup))
    theirs = TorchPostLocalSGDOptimizer(
        _sgd(models[1]), torch_averagers.PeriodicModelAverager(period, warmup)
    )
    agreement = []
    for step in range(STEPS):
        _lockstep([(models[0], ours), (models[1], theirs)], range(step, step + 1), "DDP")
        agreement.append(_ranks_agreeing(models[0]))
    return agreement


def _four_rank_world(rank: int, world_size: int) -> list[list[int]]:
    _check_hierarchical()
    return _check_ddp_hook()


def test_post_local_sgd_matches_torch_with_hierarchical_averager_and_ddp_hook_on_4_ranks() -> None:
    agreement = spawn(_four_rank_world, 4, backend="gloo", timeout=150)[0]
    for step, agreeing in enumerate(agreement):
        # Warm-up: DDP all-reduces globally; then within pairs, and every 4 steps all average.
        everyone = step < 5 or (step - 5) % 4 == 0
        assert agreeing == ([0, 0, 0, 0] if everyone else [0, 0, 2, 2]), f"step {step}"


class _CountingAverager:
    """A duck-typed averager that only counts (no process group needed)."""

    def __init__(self) -> None:
        self.step = 0
        self.calls: list[Any] = []

    def average_parameters(self, params: Any) -> None:
        self.calls.append(params)
        self.step += 1


WRAPPERS = [PostLocalSGDOptimizer, TorchPostLocalSGDOptimizer]


def _wrapped(cls: Any) -> tuple[nn.Module, Any]:
    model = _model()
    return model, cls(torch.optim.SGD(model.parameters(), lr=0.1), _CountingAverager())


@pytest.mark.parametrize("cls", WRAPPERS, ids=["ours", "torch"])
def test_load_state_dict_without_averager_step_warns_in_torchs_words_and_resets_it_to_0(
    cls: Any,
) -> None:
    model, opt = _wrapped(cls)
    _train_step(model, opt, 0)
    state = opt.state_dict()
    assert state["step"] == 1
    del state["step"]
    opt.averager.step = 7
    with pytest.warns(UserWarning, match="step counter") as caught:
        opt.load_state_dict(state)
    assert [str(w.message) for w in caught] == [
        "Loaded state dict does not contain a step counter for an averager. "
        "Setting step counter to 0."
    ]
    assert opt.averager.step == 0


@pytest.mark.parametrize("cls", WRAPPERS, ids=["ours", "torch"])
def test_wrapper_delegates_groups_state_and_passes_param_groups_to_averager(cls: Any) -> None:
    model, opt = _wrapped(cls)
    _train_step(model, opt, 0)
    assert opt.param_groups is opt.optim.param_groups
    assert opt.state is opt.optim.state
    assert opt.averager.calls == [opt.param_groups]
    opt.add_param_group({"params": [nn.Parameter(torch.ones(1))], "lr": 0.5})
    assert len(opt.optim.param_groups) == 2
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())
    assert repr(opt) == repr(opt.optim)


@pytest.mark.parametrize("cls", WRAPPERS, ids=["ours", "torch"])
def test_lr_scheduler_drives_the_wrapped_optimizer(cls: Any) -> None:
    model, opt = _wrapped(cls)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    _train_step(model, opt, 0)
    scheduler.step()
    assert opt.optim.param_groups[0]["lr"] == pytest.approx(0.05)


def test_step_runs_the_closure_returns_its_loss_and_then_averages() -> None:
    _, opt = _wrapped(PostLocalSGDOptimizer)
    loss = opt.step(lambda: torch.tensor(3.0))
    assert loss.item() == 3.0
    assert opt.averager.step == 1


@pytest.mark.parametrize(
    ("optim", "averager", "message"),
    [
        (object(), _CountingAverager(), "expected a torch.optim.Optimizer as optim"),
        (torch.optim.SGD([nn.Parameter(torch.ones(1))], lr=0.1), object(), "model averager"),
    ],
)
def test_post_local_sgd_rejects_what_is_not_an_optimizer_or_averager(
    optim: Any, averager: Any, message: str
) -> None:
    with pytest.raises(TypeError, match=message):
        PostLocalSGDOptimizer(optim, averager)
