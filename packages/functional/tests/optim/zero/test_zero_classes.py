"""Which optimizer classes ZeroRedundancyOptimizer runs, and how: per bucket or per iteration
under overlap, coupled ones refused, elementwise ones on flat slices, optimizer-wide state and
train()/eval(). Small user-written classes stand in for third-party ones (those are tested in
tests/integration/test_third_party_optimizers.py)."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from shardopt.optim.zero._classes import steps_per_bucket
from shardopt.optim.zero._core_optimizer import CoreShardOptimizer
from shardopt.testing import World

STEPS = 3


class CountingSignSGD(torch.optim.Optimizer):
    """p -= lr * calls * sign(grad), ``calls`` counting step() calls in the param group, and an
    optimizer-wide ``state["k"]`` counting them too (as MADGRAD's): elementwise, but stepping
    it once per DDP bucket would run its counts ahead."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr, "calls": 0})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        self.state.setdefault("k", torch.tensor(0))  # type: ignore[call-overload]
        self.state["k"] += 1  # type: ignore[index]
        for group in self.param_groups:
            group["calls"] += 1
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["m"] = 0.5 * state.get("m", torch.zeros_like(p)) + p.grad
                    k = float(self.state["k"])  # type: ignore[index]
                    p.add_(torch.sign(state["m"]), alpha=-group["lr"] * group["calls"] * k)
        return None


class GlobalNormSGD(torch.optim.Optimizer):
    """p -= lr * grad / (norm of all gradients): coupled."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
        norm = torch.stack([g.square().sum() for g in grads]).sum().sqrt() if grads else 1.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / norm, alpha=-group["lr"])
        return None


class NoisySGD(torch.optim.Optimizer):
    """p -= lr * (grad + noise): each rank would draw its own noise."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad + 0.01 * torch.randn_like(p), alpha=-group["lr"])
        return None


class TensorNormSGD(torch.optim.Optimizer):
    """p -= lr * grad / |grad| per tensor: per parameter, not elementwise."""

    def __init__(self, params: Any, lr: float = 0.01) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / p.grad.norm(), alpha=-group["lr"])
        return None


class PlainAdamW(torch.optim.AdamW):
    """AdamW under another name: overrides nothing."""


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def mean_gradients(model: torch.nn.Module, step: int, world_size: int) -> list[torch.Tensor]:
    """The mean over ranks of each rank's gradient at ``step``, summed in rank order."""
    total: list[torch.Tensor] | None = None
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        loss = torch.nn.functional.mse_loss(model(x), y)
        grads = torch.autograd.grad(loss, list(model.parameters()))
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    assert total is not None
    return [t / world_size for t in total]


def train(model: torch.nn.Module, opt: Any, world_size: int) -> list[torch.Tensor]:
    for step in range(STEPS):
        for p, g in zip(model.parameters(), mean_gradients(model, step, world_size)):
            p.grad = g
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def one_process(optimizer: Any, world_size: int, **kwargs: Any) -> tuple[list[Any], Any]:
    model = build_model()
    opt = optimizer(model.parameters(), **kwargs)
    return train(model, opt, world_size), copy.deepcopy(opt.state_dict())


def assert_bitwise(got: list[torch.Tensor], want: list[torch.Tensor], what: str) -> None:
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"{what}, parameter {i}: max difference {(a - b).abs().max()}"


def test_only_torch_s_per_parameter_classes_are_stepped_per_bucket() -> None:
    assert steps_per_bucket(torch.optim.Adam)
    assert steps_per_bucket(PlainAdamW)
    assert not steps_per_bucket(CountingSignSGD)
    assert not steps_per_bucket(torch.optim.LBFGS)


class MeanGradients:
    """A DDP comm hook writing given gradients into each bucket (no communication)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.by_param = model, {}

    @staticmethod
    def hook(state: MeanGradients, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            g.copy_(state.by_param[id(p)])
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future


@pytest.mark.parametrize("interleaved", [False, True], ids=["at_end", "interleaved"])
@pytest.mark.world(2, backend="gloo", timeout=120)
def test_overlap_steps_a_class_counting_per_call_once_per_iteration_as_the_default_partition(
    world: World, interleaved: bool
) -> None:
    default = ZeroRedundancyOptimizer((m := build_model()).parameters(), CountingSignSGD, lr=0.01)
    want = train(m, default, world.world_size)
    model = build_model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), CountingSignSGD, overlap_with_ddp=True, lr=0.01
    )
    ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)  # one bucket per parameter
    means = MeanGradients(model)
    wrap = hook_with_zero_step_interleaved if interleaved else hook_with_zero_step
    ddp.register_comm_hook(means, wrap(MeanGradients.hook, ddp, zero))
    for step in range(STEPS):
        grads = mean_gradients(model, step, world.world_size)
        means.by_param = {id(p): g for p, g in zip(model.parameters(), grads)}
        ddp(torch.zeros(1, 4)).sum().backward()
    assert_bitwise([p.detach() for p in model.parameters()], want, "overlap")
    assert zero.optim.param_groups[0]["calls"] == STEPS
    assert int(zero.optim.state["k"]) == STEPS


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_coupled_classes_are_refused_on_every_rank_unless_allowed_with_one_warning(
    world: World,
) -> None:
    reasons = {
        GlobalNormSGD: "its update of a parameter depends on the other parameters it steps",
        NoisySGD: "its update draws random numbers",
    }
    for optimizer, reason in reasons.items():
        expected = f"cannot shard {optimizer.__qualname__} over 2 ranks: {reason}"
        with pytest.raises(ValueError, match=re.escape(expected)) as info:
            ZeroRedundancyOptimizer(build_model().parameters(), optimizer, lr=0.1)
        assert "pass allow_coupled=True" in str(info.value)
        with pytest.warns(UserWarning, match=r"allow_coupled=True: .* its result is not") as seen:
            ZeroRedundancyOptimizer(
                build_model().parameters(), optimizer, lr=0.1, allow_coupled=True
            )
        assert len(seen) == 1
    ZeroRedundancyOptimizer(build_model().parameters(), TensorNormSGD, lr=0.1)  # per parameter


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_flat_runs_a_subclass_that_overrides_nothing_as_its_class(world: World) -> None:
    runs = []
    for optimizer in (torch.optim.AdamW, PlainAdamW):
        model = build_model()
        zero = ZeroRedundancyOptimizer(model.parameters(), optimizer, lr=0.01, partition="flat")
        assert isinstance(zero.optim, CoreShardOptimizer)
        runs.append(train(model, zero, world.world_size))
    assert_bitwise(runs[1], runs[0], "PlainAdamW against AdamW")


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_flat_refuses_a_class_its_probe_finds_not_elementwise(world: World) -> None:
    with pytest.raises(
        ValueError,
        match=r"partition='flat' cannot step TensorNormSGD on slices of flat buffers: its "
        r"update of an element depends on other elements",
    ):
        ZeroRedundancyOptimizer(build_model().parameters(), TensorNormSGD, lr=0.1, partition="flat")


def broadcast(value: Any, src: int = 0) -> Any:
    box = [value]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(3, backend="gloo", timeout=120)
def test_elementwise_class_and_its_optimizer_wide_state_match_one_process_through_a_reload(
    world: World, partition: str
) -> None:
    """CountingSignSGD (per-call counts, optimizer-wide state["k"]) sharded at W=3: parameters
    and the consolidated state dict (torch's format, "k" included) as one process's; loaded
    into a new optimizer, training goes on as one process's does."""
    want, want_state = one_process(CountingSignSGD, world.world_size, lr=0.01)
    model = build_model()
    zero = ZeroRedundancyOptimizer(
        model.parameters(), CountingSignSGD, lr=0.01, partition=partition
    )
    assert_bitwise(train(model, zero, world.world_size), want, partition)
    zero.consolidate_state_dict(to=0)
    saved = broadcast(copy.deepcopy(zero.state_dict()) if world.rank == 0 else None)
    assert list(saved["state"]) == [0, 1, 2, 3, "k"]
    for key, entry in want_state["state"].items():
        if isinstance(entry, dict):
            for name, value in entry.items():
                assert torch.equal(saved["state"][key][name], value), (key, name)
        else:
            assert torch.equal(saved["state"][key], entry), key
    assert saved["param_groups"][0]["calls"] == STEPS
    again = ZeroRedundancyOptimizer(
        model.parameters(), CountingSignSGD, lr=0.01, partition=partition
    )
    again.load_state_dict(saved)
    assert int(again.optim.state["k"]) == STEPS
    reference = build_model()
    ref = CountingSignSGD(reference.parameters(), lr=0.01)
    ref.load_state_dict(copy.deepcopy(want_state))
    with torch.no_grad():
        for p, q in zip(reference.parameters(), want):
            p.copy_(q)
    assert_bitwise(
        train(model, again, world.world_size), train(reference, ref, world.world_size), "reloaded"
    )


@pytest.mark.world(1, backend="gloo", timeout=60)
def test_train_and_eval_exist_only_where_the_local_optimizer_has_them(world: World) -> None:
    zero = ZeroRedundancyOptimizer(build_model().parameters(), torch.optim.Adam, lr=0.1)
    assert not hasattr(zero, "train")
    assert not hasattr(zero, "eval")
    with pytest.raises(AttributeError, match=r"ZeroRedundancyOptimizer.train: the local"):
        zero.train()


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_flat_slices_take_a_new_param_group_and_defer_their_gathers_to_the_forward(
    world: World,
) -> None:
    """A probed class under partition='flat': add_param_group gives the new group buffers of
    its own; register_param_hooks leaves the gathers to the next forward; both as one process."""
    ref_model = build_model()
    ref = CountingSignSGD(ref_model[0].parameters(), lr=0.01)
    model = build_model()
    zero = ZeroRedundancyOptimizer(
        model[0].parameters(), CountingSignSGD, lr=0.01, partition="flat"
    )
    hooks = zero.register_param_hooks(model)
    for step in range(STEPS):
        if step == 1:
            ref.add_param_group({"params": list(ref_model[2].parameters()), "lr": 0.02})
            zero.add_param_group({"params": list(model[2].parameters()), "lr": 0.02})
        grads = mean_gradients(model, step, world.world_size)  # the forward waits
        for p, q, g in zip(model.parameters(), ref_model.parameters(), grads):
            p.grad, q.grad = g, g.clone()
        zero.step()
        ref.step()
    zero.wait_params()
    for h in hooks:
        h.remove()
    got = [p.detach() for p in model.parameters()]
    assert_bitwise(got, [p.detach() for p in ref_model.parameters()], "flat slices")


class DecayedSignSGD(torch.optim.Optimizer):
    """p -= lr * sign(grad) + weight_decay * p * (mean |p| over all parameters): coupled only
    where weight_decay is not 0."""

    def __init__(self, params: Any, lr: float = 0.01, weight_decay: float = 0.0) -> None:
        super().__init__(params, {"lr": lr, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        scale = torch.cat([p.abs().reshape(-1) for p in params]).mean() if params else 0.0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.sub_(p * scale, alpha=group["weight_decay"])
                    p.add_(torch.sign(p.grad), alpha=-group["lr"])
        return None


@pytest.mark.world(2, backend="gloo", timeout=60)
def test_the_probes_run_with_each_param_group_s_hyperparameters(world: World) -> None:
    m = build_model()
    ZeroRedundancyOptimizer(m.parameters(), DecayedSignSGD, lr=0.1)  # no decay: uncoupled
    groups = [
        {"params": list(m[0].parameters())},
        {"params": list(m[2].parameters()), "weight_decay": 0.1},
    ]
    with pytest.raises(ValueError, match=r"cannot shard DecayedSignSGD over 2 ranks: its upd"):
        ZeroRedundancyOptimizer(groups, DecayedSignSGD, lr=0.1)
    with pytest.raises(ValueError, match=r"partition='flat' cannot step DecayedSignSGD"):
        ZeroRedundancyOptimizer(groups, DecayedSignSGD, lr=0.1, partition="flat")
