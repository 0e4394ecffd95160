"""Incoming state is the optimizer's state: damaged state dicts, tried as a user would.

Each damage of issue 46's table is loaded into the drop-in (both partitions) and the functional
loads, at W = 1 and 2 (one world per table and world size). Every refusal must come on every
rank, at the load, naming the API, the parameter and the entry, with the state bitwise as it
was; NaN with ``allow_nonfinite=True`` loads.
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.core import adam, plan_partition
from shardopt.functional import (
    load_checkpoint,
    load_sharded_state_dict,
    load_torch_state_dict,
    save_checkpoint,
    shard,
    sharded_state_dict,
)
from shardopt.optim import PeriodicModelAverager, PostLocalSGDOptimizer, ZeroRedundancyOptimizer
from shardopt.testing import World

SHAPES = [(3, 4), (3,)]


def _torch_dict() -> dict[str, Any]:
    """A plain torch.optim.Adam's state dict after two steps (the same on every rank)."""
    params = [torch.nn.Parameter(torch.linspace(-1, 1, 12)[: math.prod(s)].view(s)) for s in SHAPES]
    opt = torch.optim.Adam(params, lr=0.1)
    for i in range(2):
        for p in params:
            p.grad = torch.full_like(p, 0.5 + i)
        opt.step()
    return opt.state_dict()


def _set(key: str, make: Callable[[Any], Any]) -> Callable[[dict[str, Any]], None]:
    def damage(sd: dict[str, Any]) -> None:
        sd["state"][0][key] = make(sd["state"][0][key])

    return damage


def _drop(sd: dict[str, Any]) -> None:
    del sd["state"][0]["exp_avg_sq"]


def _lr(sd: dict[str, Any]) -> None:
    sd["param_groups"][0]["lr"] = "abc"


# name -> (damage, the entry the refusal names, what it says)
DAMAGES: dict[str, tuple[Callable[[dict[str, Any]], None], str, str]] = {
    "no exp_avg_sq": (_drop, "keys", "without ['exp_avg_sq']"),
    "exp_avg transposed": (_set("exp_avg", lambda x: x.t().contiguous()), "'exp_avg'", "(4, 3)"),
    "exp_avg (1,)": (_set("exp_avg", lambda x: torch.zeros(1)), "'exp_avg'", "got (1,)"),
    "exp_avg (1, 4)": (_set("exp_avg", lambda x: torch.zeros(1, 4)), "'exp_avg'", "got (1, 4)"),
    "exp_avg 1e9 expanded": (
        _set("exp_avg", lambda x: torch.zeros(1).expand(1000, 10**6)),
        "'exp_avg'",
        "got (1000, 1000000)",
    ),
    "exp_avg expanded": (
        _set("exp_avg", lambda x: torch.zeros(4).expand(3, 4)),
        "'exp_avg'",
        "expanded or overlapping view",
    ),
    "lr 'abc'": (_lr, "'lr'", "a real number, got 'abc'"),
    "exp_avg complex64": (
        _set("exp_avg", lambda x: x.to(torch.complex64)),
        "'exp_avg'",
        "got complex64",
    ),
    "exp_avg NaN": (_set("exp_avg", lambda x: torch.full_like(x, float("nan"))), "'exp_avg'", ""),
    "exp_avg_sq negative": (_set("exp_avg_sq", lambda x: -x), "'exp_avg_sq'", ">= 0"),
    "step -5": (_set("step", lambda x: torch.tensor(-5.0)), "'step'", ">= 0"),
}


def _bits(tensors: list[torch.Tensor]) -> list[bytes]:
    return [
        t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors
    ]


class _Zero:
    """The drop-in over two parameters of SHAPES, loaded with the clean dict."""

    def __init__(self, partition: str) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        self.opt = ZeroRedundancyOptimizer(
            self.params, torch.optim.Adam, lr=0.1, partition=partition
        )
        self.api = "ZeroRedundancyOptimizer.load_state_dict"
        self.opt.load_state_dict(_torch_dict())

    def load(self, sd: dict[str, Any], **kwargs: Any) -> None:
        self.opt.load_state_dict(sd, **kwargs)

    def tensors(self) -> list[torch.Tensor]:
        entries = self.opt.optim.state.values()
        return [v for e in entries for v in e.values() if isinstance(v, torch.Tensor)]

    def snapshot(self) -> Any:
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups]
        return _bits(self.tensors()), repr(hyper)


class _Functional:
    """load_torch_state_dict into a sharded Adam's state."""

    def __init__(self, world_size: int) -> None:
        params = [torch.zeros(s) for s in SHAPES]
        self.state = shard(adam(0.1), plan_partition(params, world_size, align=1)).init(params)
        self.api = "load_torch_state_dict"
        load_torch_state_dict(self.state, _torch_dict())

    def load(self, sd: dict[str, Any], **kwargs: Any) -> None:
        load_torch_state_dict(self.state, sd, **kwargs)

    def tensors(self) -> list[torch.Tensor]:
        return [b for f in self.state.fields for b in f.buffers]

    def snapshot(self) -> Any:
        return _bits(self.tensors())


class _PostLocal(_Zero):
    """PostLocalSGDOptimizer over a local torch.optim.Adam."""

    def __init__(self, partition: str) -> None:
        self.params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
        local = torch.optim.Adam(self.params, lr=0.1)
        self.opt = PostLocalSGDOptimizer(local, PeriodicModelAverager(period=2, warmup_steps=4))
        self.api = "PostLocalSGDOptimizer.load_state_dict"
        self.opt.load_state_dict({**_torch_dict(), "step": 0})

    def load(self, sd: dict[str, Any], **kwargs: Any) -> None:
        self.opt.load_state_dict({**sd, "step": 0}, **kwargs)


LOADS: dict[str, Callable[[int], Any]] = {
    "greedy": lambda n: _Zero("greedy"),
    "flat": lambda n: _Zero("flat"),
    "load_torch_state_dict": _Functional,
    "post-local SGD": lambda n: _PostLocal(""),
}


def _refused_everywhere(world: World, load: str, case: str) -> str | None:
    """Loads the damaged dict; None if refused as it should be, else what went wrong."""
    target = LOADS[load](world.world_size)
    damage, entry, says = DAMAGES[case]
    sd = copy.deepcopy(_torch_dict())
    damage(sd)
    before = target.snapshot()
    try:
        target.load(sd)
    except ValueError as exc:
        message = str(exc)
        where = "param group 0" if case == "lr 'abc'" else "parameter 0 (group 0)"
        for part in (target.api, where, entry, says):
            if part not in message:
                return f"{part!r} not in {message!r}"
        if "NaN" in case and "allow_nonfinite=True" not in message:
            return f"no switch named in {message!r}"
        return None if target.snapshot() == before else "state changed by a refused load"
    return "loaded"


def _nan_loads_with_the_switch(world: World, load: str) -> str | None:
    """NaN with ``allow_nonfinite=True``: loaded (some rank holds the NaN of parameter 0)."""
    target = LOADS[load](world.world_size)
    sd = copy.deepcopy(_torch_dict())
    DAMAGES["exp_avg NaN"][0](sd)
    target.load(sd, allow_nonfinite=True)
    held = torch.tensor([int(any(bool(t.isnan().any()) for t in target.tensors()))])
    dist.all_reduce(held, op=dist.ReduceOp.MAX)
    return None if held.item() == 1 else "no rank holds the NaN loaded"


def _damaged_state(world: World, case: str) -> Any:
    """A sharded Adam's state loaded from the clean dict, then damaged in every shard."""
    target = _Functional(world.world_size)
    state = target.state
    mu, nu = (f.buffers[0] for f in state.fields[1:])
    count = state.fields[0].buffers[0]
    with torch.no_grad():
        {
            "exp_avg NaN": lambda: mu.fill_(float("nan")),
            "exp_avg_sq negative": lambda: nu.neg_(),
        }.get(case, lambda: count.fill_(-5))()
    return state


DOMAIN = ["exp_avg NaN", "exp_avg_sq negative", "step -5"]  # all a file's form can carry


def _file_loads_refuse(world: World, root: str) -> dict[str, str]:
    """load_checkpoint and load_sharded_state_dict of damaged states: refused, nothing written."""
    failed = {}
    for i, case in enumerate(DOMAIN):
        path = os.path.join(root, f"case-{i}")
        damaged = _damaged_state(world, case)
        save_checkpoint(damaged, path)
        sharded = sharded_state_dict(damaged)
        entry = DAMAGES[case][1]
        for api in ("load_checkpoint", "load_sharded_state_dict"):
            if api == "load_checkpoint" and case == "step -5":
                continue  # save_checkpoint keeps no entry of a count <= 0: none reaches the load
            target = _Functional(world.world_size)
            before = target.snapshot()
            try:
                if api == "load_checkpoint":
                    load_checkpoint(target.state, path)
                else:
                    load_sharded_state_dict(target.state, sharded)
                failed[f"{api}, {case}"] = "loaded"
            except ValueError as exc:
                parts = (api, "parameter", "(group 0)", entry)
                missing = [p for p in parts if p not in str(exc)]
                if missing or target.snapshot() != before:
                    failed[f"{api}, {case}"] = (
                        f"{missing} {exc}; changed: {target.snapshot() != before}"
                    )
            if case == "exp_avg NaN":  # the switch loads it
                target = _Functional(world.world_size)
                if api == "load_checkpoint":
                    load_checkpoint(target.state, path, allow_nonfinite=True)
                else:
                    load_sharded_state_dict(target.state, sharded, allow_nonfinite=True)
        dist.barrier()
    if world.world_size == 2:  # rank 1's shard alone damaged: rank 0 refuses too, naming it
        source = _damaged_state(world, "exp_avg NaN") if world.rank == 1 else _Functional(2).state
        target = _Functional(2)
        before = target.snapshot()
        with pytest.raises(ValueError) as info:
            load_sharded_state_dict(target.state, sharded_state_dict(source))
        said = "load_sharded_state_dict: parameter 0 (group 0), entry 'exp_avg': expected finite"
        if said not in str(info.value) or (world.rank == 0 and "rank 1" not in str(info.value)):
            failed["load_sharded_state_dict, rank 1 alone"] = str(info.value)
        if target.snapshot() != before:
            failed["load_sharded_state_dict, rank 1 alone"] = "state changed"
    return failed


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_every_damaged_state_is_refused_at_load_on_every_rank_and_changes_nothing(
    world: World, n: int, tmp_path: Any
) -> None:
    failed = {}
    for load in LOADS:
        for case in DAMAGES:
            if case == "lr 'abc'" and load == "load_torch_state_dict":
                continue  # hyperparameters are not loaded there (fixed at construction)
            try:
                problem = _refused_everywhere(world, load, case)
            except Exception as exc:  # the next case still runs
                problem = f"{type(exc).__name__}: {exc}"
            if problem is not None:
                failed[f"{load}, {case}"] = problem
        problem = _nan_loads_with_the_switch(world, load)
        if problem is not None:
            failed[f"{load}, NaN with allow_nonfinite=True"] = problem
    root = os.path.join(str(tmp_path), "files")
    if world.rank == 0:
        os.makedirs(root)
    dist.barrier()
    failed.update(_file_loads_refuse(world, root))
    assert not failed, f"rank {world.rank}: {failed}"


def _round_trip_changes(world: World, load: str) -> str | None:
    """The drop-in's consolidated dict, loaded back: every rank's state bitwise the same."""
    target = LOADS[load](world.world_size)
    before = target.snapshot()
    target.opt.consolidate_state_dict(to=0)
    box = [target.opt.state_dict() if world.rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    target.load(box[0])
    return None if target.snapshot() == before else "changed by a clean round trip"


def _lbfgs_round_trip() -> str | None:
    model = torch.nn.Linear(4, 3)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.LBFGS, lr=0.1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(torch.ones(2, 4)).pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    opt.consolidate_state_dict(to=0)
    opt.load_state_dict(opt.state_dict())
    return None


class _Stepless(torch.optim.SGD):
    """SGD whose step fails on rank 1 only: the probe fails there alone."""

    def step(self, closure: Any = None) -> Any:
        if dist.get_rank() == 1:
            raise RuntimeError("no steps on rank 1\n\x1b[2J")
        return super().step(closure)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_clean_round_trips_are_bitwise_and_init_names_a_non_tensor_leaf_on_every_rank(
    world: World, n: int
) -> None:
    failed = {load: _round_trip_changes(world, load) for load in ("greedy", "flat")}
    if n == 1:  # a class the probe cannot step (no closure): its own state, flat 'd' included
        failed["LBFGS"] = _lbfgs_round_trip()
    sharded = shard(adam(0.1), plan_partition([torch.zeros(3)], n))
    for bad, name in ((5, "int"), ("abc", "str"), ([torch.zeros(3), None, 2.0], "float")):
        with pytest.raises(TypeError) as info:
            sharded.init(bad)
        index = 2 if name == "float" else 0
        expected = f"shard.init: expected params[{index}] to be a tensor, got {name}"
        failed[f"init({bad!r})"] = None if expected in str(info.value) else str(info.value)
    if n == 2:  # one rank alone: the other names it and carries its reason
        params: Any = 5 if world.rank == 1 else [torch.zeros(3)]
        with pytest.raises((TypeError, ValueError)) as caught:
            sharded.init(params)
        said = "shard.init: expected params[0] to be a tensor, got int"
        said = said if world.rank == 1 else f"rank 1: TypeError: {said}"
        failed["init on rank 1 only"] = None if said in str(caught.value) else str(caught.value)
        with pytest.raises(ValueError) as refused:
            ZeroRedundancyOptimizer([torch.nn.Parameter(torch.zeros(3))], _Stepless, lr=0.1)
        said = "rank 1: ValueError: ZeroRedundancyOptimizer: cannot shard _Stepless"
        text = str(refused.value)
        ok = world.rank == 1 or (said in text and "no steps on rank 1\\n\\x1b[2J" in text)
        failed["probe failing on rank 1 only"] = None if ok else text
    assert not {k: v for k, v in failed.items() if v is not None}, failed
