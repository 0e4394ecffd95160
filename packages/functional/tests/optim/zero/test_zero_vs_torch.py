"""Ours against torch's ZeroRedundancyOptimizer in the same world: same inputs, same bits."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World
from shardopt.testing._candidates import zero_redundancy_optimizer_class

STEPS = 20


class SignSGD(torch.optim.Optimizer):
    """A user-defined optimizer: p -= lr * sign(grad), with a per-parameter step count."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None if closure is None else closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self.state[p]["n"] = self.state[p].get("n", 0) + 1
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return loss


@dataclasses.dataclass(frozen=True)
class Scenario:
    optimizer: type[torch.optim.Optimizer]
    kwargs: dict[str, Any]
    view: bool = False
    groups: bool = False  # weights and biases in two groups, the biases without weight decay
    frozen: bool = False  # the first layer never trains
    add_group_at: int | None = None  # the last layer joins as a new param group at this step
    scheduler: bool = False  # StepLR(step_size=3, gamma=0.5)
    closure: bool = False  # step(closure)
    toggle: bool = False  # the first weight's requires_grad flips from step 10 on (as torch's)


SCENARIOS = {
    "adam_fused_bucket_view": Scenario(torch.optim.Adam, {"lr": 1e-2, "fused": True}, view=True),
    "adam_frozen_layer": Scenario(
        torch.optim.Adam, {"lr": 1e-2, "weight_decay": 1e-2}, frozen=True
    ),
    "sgd_param_groups_lr_scheduler": Scenario(
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
        groups=True,
        scheduler=True,
    ),
    "adamw_add_param_group_bucket_view": Scenario(
        torch.optim.AdamW, {"lr": 1e-2}, view=True, add_group_at=10
    ),
    "rmsprop_closure_bucket_view": Scenario(
        torch.optim.RMSprop,
        {"lr": 1e-3, "centered": True, "momentum": 0.5},
        view=True,
        closure=True,
    ),
    "adagrad_trainability_toggles": Scenario(torch.optim.Adagrad, {"lr": 0.05}, toggle=True),
    "user_defined_optimizer": Scenario(SignSGD, {"lr": 1e-3}, groups=True),
}


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16),
        torch.nn.Tanh(),
        torch.nn.Linear(16, 12),
        torch.nn.Tanh(),
        torch.nn.Linear(12, 4),
    )


def param_spec(model: torch.nn.Sequential, scenario: Scenario) -> list[Any]:
    layers = [model[0], model[2], model[4]]
    if scenario.frozen:
        layers[0].requires_grad_(False)
    if scenario.add_group_at is not None:
        layers = layers[:2]
    if scenario.groups:
        wd = scenario.kwargs.get("weight_decay", 0.0)
        return [
            {"params": [layer.weight for layer in layers]},
            {"params": [layer.bias for layer in layers], "lr": 0.02, "weight_decay": 0.1 * wd},
        ]
    return [p for layer in layers for p in layer.parameters()]


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=gen), torch.randn(8, 4, generator=gen)


def averaged_backward(model: torch.nn.Module, step: int, world: World) -> torch.Tensor:
    x, y = batch(step, world.rank)
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad.div_(world.world_size)
    return loss.detach()


def train_step(model: Any, opt: Any, scenario: Scenario, step: int, world: World) -> Any:
    if scenario.toggle and step >= 10:
        model[0].weight.requires_grad_(bool(step % 2))
    if scenario.closure:

        def closure() -> torch.Tensor:
            opt.zero_grad()
            return averaged_backward(model, step, world)

        return opt.step(closure=closure)
    opt.zero_grad()
    averaged_backward(model, step, world)
    return opt.step()


def assert_same(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor), where
        assert isinstance(b, torch.Tensor), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape), f"{where}: {a.dtype}{a.shape} {b.dtype}"
        assert torch.equal(a, b), f"{where}: max difference {(a - b).abs().max()}"
    elif isinstance(a, dict):
        assert isinstance(b, dict), where
        assert a.keys() == b.keys(), f"{where}: keys {a.keys()} and {b.keys()}"
        for key in a:
            assert_same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{where}: lengths {len(a)} and {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def run_pair(scenario: Scenario, world: World) -> None:
    """Trains torch's and our optimizer side by side; both are checked bit for bit."""
    models = [build_model(), build_model()]
    originals = [p.data_ptr() for p in models[1].parameters()]
    classes = [zero_redundancy_optimizer_class(), ZeroRedundancyOptimizer]
    opts = [
        cls(
            param_spec(m, scenario),
            scenario.optimizer,
            parameters_as_bucket_view=scenario.view,
            **scenario.kwargs,
        )
        for cls, m in zip(classes, models)
    ]
    scheds = (
        [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in opts] if scenario.scheduler else []
    )
    for step in range(STEPS):
        if step == scenario.add_group_at:
            for m, o in zip(models, opts):
                o.add_param_group({"params": list(m[4].parameters()), "lr": 5e-3})
        losses = [train_step(m, o, scenario, step, world) for m, o in zip(models, opts)]
        for s in scheds:
            s.step()
        assert_same(losses[0], losses[1], f"loss at step {step}")
        for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
            assert_same(a.detach(), b.detach(), f"step {step}, parameter {name}")
        assert_same(opts[0].param_groups, opts[1].param_groups, f"step {step}, param_groups")
    assert_same(opts[0].optim.state_dict(), opts[1].optim.state_dict(), "local state dict")
    to = world.world_size - 1
    for o in opts:
        o.consolidate_state_dict(to=to)
    if world.rank == to:
        assert_same(opts[0].state_dict(), opts[1].state_dict(), "consolidated state dict")
    storages = {p.untyped_storage().data_ptr() for p in models[1].parameters()}
    if scenario.view:
        assert len(storages) == 1  # views of one flat buffer (one dtype, one device)
    else:
        assert [p.data_ptr() for p in models[1].parameters()] == originals


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_parameters_and_state_dict_match_torch_s_zero_bitwise_for_20_steps(
    world: World, n: int, name: str
) -> None:
    run_pair(SCENARIOS[name], world)


def train_joined(model: torch.nn.Module, zero: Any, world: World) -> None:
    ddp = DistributedDataParallel(model)
    with Join([ddp, zero]):
        for step in range(3 + 2 * world.rank):  # uneven: rank r has 2r more batches
            zero.zero_grad()
            x, y = batch(step, world.rank)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            zero.step()


@pytest.mark.parametrize("view", [False, True], ids=["staged", "bucket_view"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_join_with_uneven_inputs_ends_where_torch_s_zero_ends(
    world: World, n: int, view: bool
) -> None:
    models = [build_model(), build_model()]
    classes = [zero_redundancy_optimizer_class(), ZeroRedundancyOptimizer]
    for cls, m in zip(classes, models):
        zero = cls(m.parameters(), torch.optim.Adam, parameters_as_bucket_view=view, lr=1e-2)
        train_joined(m, zero, world)
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        assert_same(a.detach(), b.detach(), f"parameter {name}")
        gathered = [torch.empty_like(b) for _ in range(n)]
        dist.all_gather(gathered, b.detach())
        assert all(torch.equal(gathered[0], g) for g in gathered[1:]), "replicas differ"


def continue_training(model: Any, opt: Any, world: World, first: int) -> list[torch.Tensor]:
    for step in range(first, first + 5):
        opt.zero_grad()
        averaged_backward(model, step, world)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def broadcast_dict(sd: dict[str, Any] | None, src: int) -> dict[str, Any]:
    box = [sd]
    dist.broadcast_object_list(box, src=src)
    assert box[0] is not None
    return box[0]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_state_dicts_cross_load_between_ours_torch_s_zero_and_torch_optim(
    world: World, n: int
) -> None:
    """Ours -> torch's ZeroRedundancyOptimizer and -> plain torch.optim.Adam; torch's -> ours
    (greedy and flat): after loading, 5 more steps end where uninterrupted training ends."""
    Torch = zero_redundancy_optimizer_class()
    models = [build_model(), build_model()]
    opts = [
        cls(m.parameters(), torch.optim.Adam, lr=1e-2)
        for cls, m in zip((ZeroRedundancyOptimizer, Torch), models)
    ]
    for step in range(5):
        for m, o in zip(models, opts):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
    dicts = []
    for o in opts:
        o.consolidate_state_dict(to=0)
        # a copy now: on rank 0 torch's dict shares its own entries with the live state
        sd = copy.deepcopy(o.state_dict()) if world.rank == 0 else None
        dicts.append(broadcast_dict(sd, 0))
    ours_sd, torch_sd = dicts
    loaders: dict[str, tuple[Callable[[Any], Any], dict[str, Any]]] = {
        "ours -> torch's zero": (
            lambda m: Torch(m.parameters(), torch.optim.Adam, lr=0.5),
            ours_sd,
        ),
        "ours -> torch.optim": (lambda m: torch.optim.Adam(m.parameters(), lr=0.5), ours_sd),
        "torch's -> ours": (
            lambda m: ZeroRedundancyOptimizer(m.parameters(), torch.optim.Adam, lr=0.5),
            torch_sd,
        ),
        "torch's -> ours (flat)": (
            lambda m: ZeroRedundancyOptimizer(
                m.parameters(), torch.optim.Adam, lr=0.5, partition="flat"
            ),
            torch_sd,
        ),
    }
    expected = continue_training(models[0], opts[0], world, 5)
    for what, (build, sd) in loaders.items():
        model = copy.deepcopy(models[1])
        opt = build(model)
        opt.load_state_dict(copy.deepcopy(sd))
        assert opt.param_groups[0]["lr"] == 1e-2, what
        got = continue_training(model, opt, world, 5)
        for i, (a, b) in enumerate(zip(got, expected)):
            if what.endswith("(flat)"):  # shardopt.core's Adam: float32 tolerance
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=f"{what}, param {i}")
            else:
                assert_same(a, b, f"{what}, parameter {i}")
