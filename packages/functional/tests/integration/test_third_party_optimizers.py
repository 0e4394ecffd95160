"""Third-party optimizer classes through ZeroRedundancyOptimizer: exact, or refused.

25 popular classes (pytorch-optimizer, lion-pytorch, schedulefree; pinned test-only
dependencies) are run at W=2 and W=3 under the default partition, the flat partition and
``overlap_with_ddp`` with both DDP hooks. Every rank feeds the optimizer the mean of all ranks'
gradients, computed in the same order as the reference: one process stepping the class itself
on the mean gradient. Each case must end bitwise where the reference ends (parameters, and the
consolidated state dict in the class's own format), or be refused at construction on every rank
with a message naming the class and why. EXPECTED pins which cases are refused, so that neither
a silent divergence nor a new refusal goes unnoticed. The overlap runs give DDP a comm hook that
writes the same mean gradients into the buckets, so they too compare bitwise.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import lion_pytorch
import pytest
import pytorch_optimizer as po
import schedulefree
import torch
from torch.nn.parallel import DistributedDataParallel

from shardopt.optim import (
    ZeroRedundancyOptimizer,
    hook_with_zero_step,
    hook_with_zero_step_interleaved,
)
from shardopt.testing import World

STEPS = 3
MODES = ("default", "flat", "overlap", "overlap_interleaved")


@dataclasses.dataclass(frozen=True)
class Case:
    optimizer: Any
    kwargs: dict[str, Any]
    flat: bool  # the flat partition accepts it (its probe finds it elementwise)
    coupled: str | None = None  # the refusal's reason under every partition, if refused


COUPLED = "depends on the other parameters it steps"
RANDOM = "draws random numbers"

CASES = {
    "Lion": Case(po.Lion, {"lr": 1e-2}, flat=True),
    "Adan": Case(po.Adan, {"lr": 1e-2}, flat=True),
    "ADOPT": Case(po.ADOPT, {"lr": 1e-2}, flat=True),
    "MADGRAD": Case(po.MADGRAD, {"lr": 1e-2}, flat=True),
    "Prodigy": Case(po.Prodigy, {"lr": 1.0}, flat=False, coupled=COUPLED),
    "DAdaptAdam": Case(po.DAdaptAdam, {"lr": 1.0}, flat=False, coupled=COUPLED),
    "AdamS": Case(po.AdamS, {"lr": 1e-2}, flat=False, coupled=COUPLED),
    "Ranger21": Case(
        po.Ranger21, {"lr": 1e-2, "num_iterations": STEPS}, flat=False, coupled=COUPLED
    ),
    "Kron": Case(po.Kron, {"lr": 1e-2}, flat=False, coupled=RANDOM),
    "Lamb": Case(po.Lamb, {"lr": 1e-2}, flat=False),
    "LARS": Case(po.LARS, {"lr": 1e-2}, flat=False),
    "AdaBelief": Case(po.AdaBelief, {"lr": 1e-2}, flat=True),
    "Yogi": Case(po.Yogi, {"lr": 1e-2}, flat=True),
    "NovoGrad": Case(po.NovoGrad, {"lr": 1e-2}, flat=False),
    "AdamP": Case(po.AdamP, {"lr": 1e-2}, flat=False),
    "AdaBound": Case(po.AdaBound, {"lr": 1e-2}, flat=True),
    "DiffGrad": Case(po.DiffGrad, {"lr": 1e-2}, flat=True),
    "Ranger": Case(po.Ranger, {"lr": 1e-2}, flat=False),
    "Tiger": Case(po.Tiger, {"lr": 1e-2}, flat=True),
    "LaProp": Case(po.LaProp, {"lr": 1e-2}, flat=True),
    "SOAP": Case(po.SOAP, {"lr": 1e-2}, flat=False),
    "AdEMAMix": Case(po.AdEMAMix, {"lr": 1e-2}, flat=True),
    "lion_pytorch.Lion": Case(lion_pytorch.Lion, {"lr": 1e-2}, flat=True),
    "AdamWScheduleFree": Case(
        schedulefree.AdamWScheduleFree, {"lr": 1e-2, "warmup_steps": 2}, flat=True
    ),
    "SGDScheduleFree": Case(
        schedulefree.SGDScheduleFree, {"lr": 1e-2, "warmup_steps": 2}, flat=True
    ),
}
NOT_ELEMENTWISE = "depends on other elements"


def build_model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


def mean_gradients(model: torch.nn.Module, step: int, world_size: int) -> list[torch.Tensor]:
    """The mean over ranks of each rank's gradient at ``step``, summed in rank order."""
    total: list[torch.Tensor] | None = None
    for rank in range(world_size):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(5, 4, generator=gen), torch.randn(5, 3, generator=gen)
        grads = torch.autograd.grad(
            torch.nn.functional.mse_loss(model(x), y), list(model.parameters())
        )
        total = list(grads) if total is None else [t + g for t, g in zip(total, grads)]
    assert total is not None
    return [t / world_size for t in total]


def switch(opt: Any, mode: str) -> None:
    if hasattr(opt, mode):
        getattr(opt, mode)()


def reference(case: Case, world_size: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """One process: the class itself stepped on the mean gradients."""
    model = build_model()
    opt = case.optimizer(model.parameters(), **case.kwargs)
    switch(opt, "train")
    for step in range(STEPS):
        for p, g in zip(model.parameters(), mean_gradients(model, step, world_size)):
            p.grad = g
        opt.step()
    state = copy.deepcopy(opt.state_dict())
    switch(opt, "eval")
    return [p.detach().clone() for p in model.parameters()], state


class MeanGradients:
    """A DDP comm hook's state and hook: writes the mean gradients into each bucket (no
    communication), so that DDP hands the optimizer exactly the reference's gradients."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.by_param: dict[int, torch.Tensor] = {}
        self.model = model

    def set(self, grads: list[torch.Tensor]) -> None:
        self.by_param = {id(p): g for p, g in zip(self.model.parameters(), grads)}

    @staticmethod
    def hook(state: MeanGradients, bucket: Any) -> torch.futures.Future[torch.Tensor]:
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            g.copy_(state.by_param[id(p)])
        future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future


def sharded(case: Case, mode: str, world: World) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """ZeroRedundancyOptimizer in ``mode``; returns the parameters (every rank) and the
    consolidated state dict (rank 0; {} elsewhere)."""
    model = build_model()
    overlap = mode.startswith("overlap")
    zero = ZeroRedundancyOptimizer(
        model.parameters(),
        case.optimizer,
        overlap_with_ddp=overlap,
        partition="flat" if mode == "flat" else "greedy",
        **case.kwargs,
    )
    switch(zero, "train")
    if overlap:
        ddp = DistributedDataParallel(model, bucket_cap_mb=1e-4)  # several buckets
        means = MeanGradients(model)
        wrap = hook_with_zero_step if mode == "overlap" else hook_with_zero_step_interleaved
        ddp.register_comm_hook(means, wrap(MeanGradients.hook, ddp, zero))
    for step in range(STEPS):
        grads = mean_gradients(model, step, world.world_size)
        if overlap:
            means.set(grads)
            ddp(torch.zeros(1, 4)).sum().backward()  # the hook steps the optimizer
        else:
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            zero.step()
    zero.consolidate_state_dict(to=0)
    state = copy.deepcopy(zero.state_dict()) if world.rank == 0 else {}
    switch(zero, "eval")
    return [p.detach().clone() for p in model.parameters()], state


def differences(a: Any, b: Any, where: str) -> list[str]:
    """Where ``a`` and ``b`` differ (tensors bitwise, NaN equal to NaN; dicts in any order)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        ok = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
        ok = ok and a.shape == b.shape and a.dtype == b.dtype
        ok = ok and bool(((a == b) | (a.isnan() & b.isnan())).all())
        return [] if ok else [f"{where}: {a!r} != {b!r}"]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {list(a)} != {list(b)}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}[{k!r}]")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def expected_refusal(case: Case, mode: str) -> str | None:
    if case.coupled is not None:
        return case.coupled
    if mode == "flat" and not case.flat:
        return "on slices of flat buffers"
    return None


def run_case(name: str, mode: str, world: World) -> str:
    """'exact', 'refused: <message>', or what went wrong."""
    case = CASES[name]
    try:
        params, state = sharded(case, mode, world)
    except ValueError as exc:
        return f"refused: {exc}"
    want_params, want_state = reference(case, world.world_size)
    found = differences(params, want_params, "parameters")
    if world.rank == 0:
        found += differences(state["state"], want_state["state"], "state")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in state["param_groups"]]
        want = [{k: v for k, v in g.items() if k != "params"} for g in want_state["param_groups"]]
        found += differences(groups, want, "param_groups")
    return "exact" if not found else "diverged: " + "; ".join(found[:3])


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.world("n", backend="gloo", timeout=240)
def test_every_third_party_class_is_exact_or_refused_on_every_rank_with_its_reason(
    world: World, n: int
) -> None:
    table = {(name, mode): run_case(name, mode, world) for name in CASES for mode in MODES}
    problems = []
    for (name, mode), got in table.items():
        case = CASES[name]
        reason = expected_refusal(case, mode)
        class_name = case.optimizer.__qualname__
        if reason is None and got != "exact":
            problems.append(f"{name} {mode}: expected exact, got {got}")
        if reason is not None and not (
            got.startswith("refused:") and reason in got and class_name in got
        ):
            problems.append(f"{name} {mode}: expected refused ({reason}), got {got}")
    if world.rank == 0:
        for (name, mode), got in table.items():
            print(f"W={n} {name:18s} {mode:20s} {got}")
    assert not problems, "\n".join(problems)


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_schedule_free_mode_survives_a_state_dict_round_trip(world: World) -> None:
    """eval() on the wrapper switches every parameter on every rank; the mode travels in the
    state dict, and after loading, train() switches back where one process does."""
    for optimizer in (schedulefree.AdamWScheduleFree, schedulefree.SGDScheduleFree):
        case = Case(optimizer, {"lr": 1e-2, "warmup_steps": 2}, flat=True)
        for partition in ("greedy", "flat"):
            model = build_model()
            zero = ZeroRedundancyOptimizer(
                model.parameters(), optimizer, partition=partition, **case.kwargs
            )
            zero.train()
            ref_model = build_model()
            ref = optimizer(ref_model.parameters(), **case.kwargs)
            ref.train()
            for step in range(STEPS):
                grads = mean_gradients(model, step, world.world_size)
                for p, q, g in zip(model.parameters(), ref_model.parameters(), grads):
                    p.grad, q.grad = g, g.clone()
                zero.step()
                ref.step()
            zero.eval()
            ref.eval()
            assert not differences(list(model.parameters()), list(ref_model.parameters()), "eval")
            zero.consolidate_state_dict(to=0)
            box = [copy.deepcopy(zero.state_dict()) if world.rank == 0 else None]
            torch.distributed.broadcast_object_list(box, src=0)
            saved = box[0]
            assert saved is not None
            assert [g["train_mode"] for g in saved["param_groups"]] == [False]
            again = ZeroRedundancyOptimizer(
                model.parameters(), optimizer, partition=partition, **case.kwargs
            )
            again.load_state_dict(saved)
            assert again.param_groups[0]["train_mode"] is False
            assert again.optim.param_groups[0]["train_mode"] is False
            again.train()
            ref.train()
            got, want = list(model.parameters()), list(ref_model.parameters())
            assert not differences(got, want, f"{optimizer.__name__} {partition} train")
