"""Behind DDP: ZeroRedundancyOptimizer against a local optimizer, and Join with a grad setter."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World


def ddp_parity(world: World, cls: type[torch.optim.Optimizer], maximize: bool) -> None:
    """torch's test_local_optimizer_parity: models differ per rank before DDP syncs them, the
    losses come from closures, the first weight's trainability flips in the second half, and at
    the end the checkpoints are cross-loaded and training goes on in step."""
    torch.manual_seed(world.rank)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    model.register_buffer("test_buffer", torch.ones(1) * world.rank)
    defaults = {"maximize": True} if maximize else {}
    sharded = ZeroRedundancyOptimizer(model.parameters(), cls, lr=1e-3, **defaults)
    sharded_ddp = DistributedDataParallel(model, find_unused_parameters=True)
    local_model = copy.deepcopy(model)
    local = cls(local_model.parameters(), lr=1e-3, **defaults)
    local_ddp = DistributedDataParallel(local_model, find_unused_parameters=True)

    def check_same() -> None:
        for group, local_group in zip(sharded.param_groups, local.param_groups):
            for p, q in zip(group["params"], local_group["params"]):
                torch.testing.assert_close(p, q)
        for b, c in zip(sharded_ddp.buffers(), local_ddp.buffers()):
            torch.testing.assert_close(b, c)

    def check_step() -> None:
        x = torch.rand(64, 2)

        def closure(opt: Any, ddp: Any) -> Any:
            opt.zero_grad()
            loss = ddp(x).abs().sum()
            loss.backward()
            return loss

        expected = local.step(closure=lambda: closure(local, local_ddp))
        got = sharded.step(closure=lambda: closure(sharded, sharded_ddp))
        torch.testing.assert_close(expected, got)
        check_same()

    check_same()
    for i in range(20):
        check_step()
        if i > 10:
            next(local_ddp.parameters()).requires_grad = bool(i % 2)
            next(sharded_ddp.parameters()).requires_grad = bool(i % 2)
    local_sd = local.state_dict()
    local_sd_copy = copy.deepcopy(local_sd)
    sharded.consolidate_state_dict(to=0)
    box = [sharded.state_dict() if world.rank == 0 else {}]
    dist.broadcast_object_list(box, src=0)
    # torch.optim keeps the loaded CPU tensors (torch runs this test on GPUs, where loading
    # copies): a copy, so that local's steps do not advance the dict loaded again below
    local.load_state_dict(copy.deepcopy(box[0]))
    sharded.load_state_dict(local_sd)
    check_step()
    local.load_state_dict(local_sd_copy)
    sharded.load_state_dict(box[0])
    check_step()


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_zero_behind_ddp_matches_a_local_optimizer_and_cross_loads(world: World) -> None:
    for cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
        for maximize in (False, True):
            ddp_parity(world, cls, maximize)


class SetGradsHook(JoinHook):
    def __init__(self, zero: Any, grads: list[list[torch.Tensor]]) -> None:
        self.zero, self.grads, self.index = zero, grads, 0
        super().__init__()

    def main_hook(self) -> None:
        for p, g in zip(self.zero._all_params, self.grads[self.index]):
            p.grad = g.detach().clone()
        self.index += 1


class GradientSetter(Joinable):
    """Sets the gradients a joined rank would have had, before ZeRO's hook steps (torch's test)."""

    def __init__(self) -> None:
        super().__init__()

    def join_hook(self, **kwargs: Any) -> JoinHook:
        return SetGradsHook(kwargs["zero_optim"], kwargs["grads"])

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return dist.group.WORLD


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=120)
def test_join_hook_steps_joined_ranks_with_the_gradients_set_before_it(
    world: World, partition: str
) -> None:
    """torch's test_zero_join: DDP + local Adam on uneven inputs give the reference gradients and
    parameters (from the last rank to join); ZeRO then steps with those gradients set by hand,
    the joined rank's set by a Joinable placed before ZeRO, and follows the reference."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    ddp = DistributedDataParallel(model)
    local = torch.optim.Adam(ddp.parameters(), lr=0.01)
    zero_model = copy.deepcopy(model)
    zero = ZeroRedundancyOptimizer(
        zero_model.parameters(), torch.optim.Adam, lr=0.01, partition=partition
    )
    inputs = [torch.randn(20, 2) for _ in range(3 + world.rank)]
    labels = torch.randn(20, 3)
    grads, params = [], []
    with ddp.join():
        for _ in range(2):
            for x in inputs:
                torch.nn.functional.mse_loss(ddp(x), labels).backward()
                grads.append([p.grad.detach().clone() for p in ddp.parameters()])
                local.step()
                params.append([p.detach().clone() for p in ddp.parameters()])
    box = [grads, params]
    dist.broadcast_object_list(box, src=world.world_size - 1)
    grads, params = box
    remaining = grads[-2 * (world.world_size - world.rank - 1) :] if world.rank == 0 else []
    setter = GradientSetter()
    step = 0
    with Join([setter, zero], zero_optim=zero, grads=remaining):
        for _ in range(2):
            for _x in inputs:
                Join.notify_join_context(setter)
                for p, g in zip(zero_model.parameters(), grads[step]):
                    p.grad = g.detach().clone()
                zero.step()
                for p, q in zip(zero_model.parameters(), params[step]):
                    torch.testing.assert_close(p, q)
                step += 1
    for p, q in zip(zero_model.parameters(), params[-1]):
        torch.testing.assert_close(p, q)
