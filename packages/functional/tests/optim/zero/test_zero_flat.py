"""partition='flat' and allow_mixed_dtypes against single-process torch.optim, W = 2 and 4."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.optim.zero import _core_optimizer
from shardopt.testing import World, requires_torch

NEEDS_MUON = requires_torch("2.9", "torch.optim.Muon and Adafactor")
STEPS = 20
RTOL = {torch.float32: 1e-6, torch.float64: 1e-12}

# name: (torch class, kwargs for both). SGD is bitwise: on CPU shardopt.core's piece rule applies
# the ops of torch's default SGD in the same order, on any split of a tensor (see [Note: SGD on
# CPU is foreach] in shardopt.core._fused).
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd_nesterov": (
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
    ),
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw_amsgrad": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    "adagrad": (torch.optim.Adagrad, {"lr": 5e-2}),
    "rmsprop_centered": (torch.optim.RMSprop, {"lr": 1e-2, "momentum": 0.9, "centered": True}),
    "adamax": (torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (torch.optim.RAdam, {"lr": 1e-2}),
    "adadelta": (torch.optim.Adadelta, {"lr": 1.0}),
    "rprop": (torch.optim.Rprop, {"lr": 1e-2}),
}


def build_model(dtype: torch.dtype = torch.float32, mixed: bool = False) -> torch.nn.Module:
    """Odd sizes, so that flat slices cut tensors; the last layer frozen; float64 head if mixed."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(7, 13), torch.nn.Tanh(), torch.nn.Linear(13, 5), torch.nn.Linear(5, 3)
    ).to(dtype)
    model[3].requires_grad_(False)
    if mixed:
        model[2].double()
    return model


def averaged_backward(model: torch.nn.Module, step: int, world: World) -> None:
    gen = torch.Generator().manual_seed(100 * step + world.rank)
    h = torch.randn(4, 7, generator=gen)
    for layer in model:
        h = layer(h.to(next(iter(layer.parameters()), h).dtype))
    h.pow(2).mean().backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    for dtype in {g.dtype for g in grads}:  # one all-reduce per dtype: DDP's averaged gradients
        mine = [g for g in grads if g.dtype == dtype]
        flat = torch.cat([g.reshape(-1) for g in mine])
        dist.all_reduce(flat)
        flat.div_(world.world_size)
        for g, part in zip(mine, flat.split([g.numel() for g in mine])):
            g.copy_(part.view_as(g))


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = max(b.abs().max().item(), 1e-30) if b.numel() else 1.0
    return (a.double() - b.double()).abs().max().item() / scale if a.numel() else 0.0


def compare(a: Any, b: Any, where: str, exact: bool) -> list[str]:
    """Differences between two state values/dicts beyond tolerance, as messages."""
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [f"{where}: keys {sorted(a)} and {sorted(b) if isinstance(b, dict) else b}"]
        return [m for k in a for m in compare(a[k], b[k], f"{where}[{k!r}]", exact)]
    if isinstance(a, torch.Tensor):
        b = torch.as_tensor(b)
        if a.shape != b.shape or a.dtype != b.dtype:
            return [f"{where}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if exact and not torch.equal(a, b):
            return [f"{where}: not bitwise equal"]
        err = rel_error(a, b)
        return [f"{where}: relative error {err:.2e}"] if err > RTOL[torch.float32] else []
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def train_against_torch(world: World, name: str, mixed: bool) -> list[str]:
    cls, kwargs = OPTIMIZERS[name]
    exact = name.startswith("sgd")
    ref_model, model = build_model(mixed=mixed), build_model(mixed=mixed)
    ref = cls(ref_model.parameters(), **kwargs)
    ours = ZeroRedundancyOptimizer(
        model.parameters(), cls, partition="flat", allow_mixed_dtypes=mixed, **kwargs
    )
    problems = []
    for step in range(STEPS):
        for m, o in ((ref_model, ref), (model, ours)):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
        for (pname, a), b in zip(model.named_parameters(), ref_model.parameters()):
            problems += compare(a.detach(), b.detach(), f"{name} step {step} {pname}", exact)
    ours.consolidate_state_dict(to=world.world_size - 1)
    if world.rank == world.world_size - 1:
        problems += compare(ours.state_dict(), ref.state_dict(), f"{name} state_dict", exact)
    return problems[:5]


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_every_elementwise_optimizer_matches_torch_optim_for_20_steps(world: World, n: int) -> None:
    """Parameters after every step and the consolidated state dict: SGD bitwise, the others
    within float32 tolerance (shardopt.core's arithmetic); frozen layer included."""
    problems = [p for name in OPTIMIZERS for p in train_against_torch(world, name, mixed=False)]
    assert not problems, problems


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=120)
def test_mixed_dtypes_train_like_torch_optim_with_one_flat_group_per_dtype(
    world: World, partition: str
) -> None:
    if partition == "flat":
        problems = [
            p
            for name in ("adam", "sgd_nesterov")
            for p in train_against_torch(world, name, mixed=True)
        ]
        assert not problems, problems
        o = ZeroRedundancyOptimizer(
            build_model(mixed=True).parameters(),
            torch.optim.Adam,
            partition="flat",
            allow_mixed_dtypes=True,
        )
        param_buffers = o.optim.units()[0].state.param_buffers
        assert [b.dtype for b in param_buffers.buffers] == [torch.float32, torch.float64]
        return
    ref_model, model = build_model(mixed=True), build_model(mixed=True)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ours = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.Adam, lr=1e-2, allow_mixed_dtypes=True
    )
    for step in range(STEPS):
        for m, o in ((ref_model, ref), (model, ours)):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
    for a, b in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(a, b)  # the same torch.optim.Adam, on each owner
    assert ours._backend.param_buffers is not None  # the staged storage: no bucket views
    assert len(ours._backend.param_buffers.plan.groups) == 2  # float32 and float64: one each


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_lr_scheduler_and_param_group_edits_reach_the_flat_update(world: World) -> None:
    """StepLR halves the lr every 3 steps, and a direct edit sets it: the core transformation is
    rebuilt from the param group each time it changes, so the run stays torch's."""
    ref_model, model = build_model(), build_model()
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2, partition="flat")
    scheds = [torch.optim.lr_scheduler.StepLR(o, 3, 0.5) for o in (ref, ours)]
    for step in range(STEPS):
        if step == 12:
            for o in (ref, ours):
                o.param_groups[0]["lr"] = 0.2
        for m, o, s in zip((ref_model, model), (ref, ours), scheds):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
            s.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert rel_error(a.detach(), b.detach()) <= RTOL[torch.float32], f"step {step}"
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert ours.optim.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    frozen = torch.nn.Sequential(build_model())  # a fresh lr would have moved every parameter
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), frozen.parameters()))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_flat_state_is_split_exactly_and_readable_through_optim(world: World, n: int) -> None:
    """Each rank holds an equal slice of the elements (and so of Adam's state), the last one
    what remains; ``optim`` shows the slice's pieces and their state under torch's names."""
    model = build_model()
    ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-2, partition="flat")
    averaged_backward(model, 0, world)
    ours.step()
    pieces = ours.optim.param_groups[0]["params"]
    held = torch.tensor([sum(p.numel() for p in pieces)])
    gathered = [torch.zeros(1, dtype=torch.int64) for _ in range(n)]
    dist.all_gather(gathered, held)
    total = sum(p.numel() for p in model.parameters())
    (bucket,) = ours.optim.units()[0].plan.groups[0].buckets  # a small model: one bucket
    shard = bucket.shards[0]
    assert [g.item() for g in gathered] == [min(shard, max(total - r * shard, 0)) for r in range(n)]
    fields = ours.optim.units()[0].state.fields
    elementwise = [f for f in fields if f.granularity.value == "elementwise"]
    assert {b.numel() for f in elementwise for b in f.buffers} == {shard}
    state = ours.optim.state
    frozen = {id(p) for p in model[3].parameters()}
    for piece, unit_piece in zip(pieces, ours.optim.units()[0].state.param_buffers.pieces):
        trained = id(ours.optim.units()[0].params[unit_piece.tensor]) not in frozen
        assert (piece in state) == trained
        if trained:
            assert set(state[piece]) == {"step", "exp_avg", "exp_avg_sq"}
            assert state[piece]["exp_avg"].shape == piece.shape
            assert state[piece]["step"].item() == 1.0


def cosine(step: int) -> float:
    return 0.5 * (1 + math.cos(step / 5))


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_a_per_step_lr_scheduler_trains_like_torch_and_shards_only_at_construction(
    world: World,
) -> None:
    """LambdaLR gives a new lr at every step: SGD stays bitwise torch's, Adam within float32
    tolerance, state dicts included; the new values go into the state (set_hyperparams), so
    ``shard`` runs once per param group, at construction, and no state is probed after it."""
    calls = {"shard": 0, "probe_fields": 0}

    def counting(name: str) -> Any:
        real = getattr(_core_optimizer, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            calls[name] += 1
            return real(*args, **kwargs)

        return counted

    problems = []
    with pytest.MonkeyPatch.context() as mp:
        for name in calls:
            mp.setattr(_core_optimizer, name, counting(name))
        for name in ("sgd_nesterov", "adam"):
            cls, kwargs = OPTIMIZERS[name]
            ref_model, model = build_model(), build_model()
            ref = cls(ref_model.parameters(), **kwargs)
            before = calls["shard"]
            ours = ZeroRedundancyOptimizer(model.parameters(), cls, partition="flat", **kwargs)
            built = dict(calls)
            assert built["shard"] == before + 1  # the one param group, sharded once
            scheds = [torch.optim.lr_scheduler.LambdaLR(o, cosine) for o in (ref, ours)]
            for step in range(STEPS):
                for m, o, s in zip((ref_model, model), (ref, ours), scheds):
                    o.zero_grad()
                    averaged_backward(m, step, world)
                    o.step()
                    s.step()
                for (pname, a), b in zip(model.named_parameters(), ref_model.parameters()):
                    where = f"{name} step {step} {pname}"
                    problems += compare(a.detach(), b.detach(), where, name.startswith("sgd"))
            assert calls == built, f"{name}: {calls} after the steps, {built} at construction"
            ours.consolidate_state_dict(to=0)
            if world.rank == 0:
                exact = name.startswith("sgd")
                problems += compare(ours.state_dict(), ref.state_dict(), f"{name} sd", exact)
    assert not problems, problems[:5]


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_adamw_weight_decay_edited_to_and_from_zero_keeps_training_like_torch(
    world: World,
) -> None:
    """weight_decay 0 drops AdamW's decoupled decay from the core chain, not a state field: the
    same state tensors are re-seated in the new chain's state, as torch keeps its state."""
    ref_model, model = build_model(), build_model()
    kwargs = {"lr": 1e-2, "weight_decay": 0.1}
    ref = torch.optim.AdamW(ref_model.parameters(), **kwargs)
    ours = ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.AdamW, partition="flat", **kwargs
    )
    buffers = [b for f in ours.optim.units()[0].state.fields for b in f.buffers]
    for step in range(12):
        if step in (4, 8):
            for o in (ref, ours):
                o.param_groups[0]["weight_decay"] = 0.0 if step == 4 else 0.05
        for m, o in ((ref_model, ref), (model, ours)):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert rel_error(a.detach(), b.detach()) <= RTOL[torch.float32], f"step {step}"
    now = [b for f in ours.optim.units()[0].state.fields for b in f.buffers]
    assert len(now) == len(buffers)
    assert all(a is b for a, b in zip(now, buffers))
    assert ours.optim.units()[0].state.inner.hyperparams["weight_decay"] == 0.05


# Muon and Adafactor need whole matrices: partition="flat" gives their groups a greedy plan of
# whole parameters (Muon balanced by Newton-Schulz flops) on the same engine.
WHOLE = {
    "muon": (getattr(torch.optim, "Muon", None), {"lr": 0.02, "weight_decay": 0.01}),
    "adafactor": (getattr(torch.optim, "Adafactor", None), {"lr": 0.01, "weight_decay": 0.01}),
}


def matrix_model() -> torch.nn.Module:
    """build_model without biases: torch.optim.Muon takes matrices only."""
    torch.manual_seed(0)
    layers = [
        torch.nn.Linear(7, 13, bias=False),
        torch.nn.Tanh(),
        torch.nn.Linear(13, 5, bias=False),
    ]
    return torch.nn.Sequential(*layers, torch.nn.Linear(5, 3, bias=False))


def train_whole(world: World, name: str, steps: range, state: dict[str, Any] | None) -> Any:
    """Ours and torch's side by side over ``steps`` (both loaded from ``state`` if given)."""
    cls, kwargs = WHOLE[name]
    make = matrix_model if name == "muon" else build_model
    (ref_model, model), problems = (make(), make()), []
    ref = cls(ref_model.parameters(), **kwargs)
    ours = ZeroRedundancyOptimizer(model.parameters(), cls, partition="flat", **kwargs)
    if state is not None:
        for p, q in zip([*model.parameters(), *ref_model.parameters()], state["params"] * 2):
            p.data.copy_(q)
        ref.load_state_dict(state["torch"])
        ours.load_state_dict(state["torch"])
    for step in steps:
        for m, o in ((ref_model, ref), (model, ours)):
            o.zero_grad()
            averaged_backward(m, step, world)
            o.step()
        for (pname, a), b in zip(model.named_parameters(), ref_model.parameters()):
            problems += compare(a.detach(), b.detach(), f"{name} step {step} {pname}", False)
    return model, ref_model, ref, ours, problems


@NEEDS_MUON
@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_muon_and_adafactor_match_torch_optim_with_torchs_state_dict(world: World, n: int) -> None:
    """10 steps against torch.optim; the consolidated state dict is torch's (keys, order, shapes,
    values) and ``optim.state`` shows it in the parameters' shapes; then both load torch's dict
    and train 10 more steps alike."""
    problems = []
    for name in WHOLE:
        _, ref_model, ref, ours, found = train_whole(world, name, range(10), None)
        problems += found
        (unit,) = ours.optim.units()
        assert unit.plan.owners is not None  # a greedy plan: whole tensors
        for piece, where in zip(unit.pieces, unit.state.param_buffers.pieces):
            trained = unit.params[where.tensor].requires_grad
            assert (piece in ours.optim.state) == trained
            if trained:  # torch's entry of the parameter, in its shapes
                got = ours.optim.state[piece]
                want = ref.state[list(ref_model.parameters())[where.tensor]]
                assert piece.shape == unit.params[where.tensor].shape
                assert [(k, v.shape) for k, v in got.items()] == [
                    (k, v.shape) for k, v in want.items()
                ]
        ours.consolidate_state_dict(to=n - 1)
        if world.rank == n - 1:
            sd = ours.state_dict()
            problems += compare(sd, ref.state_dict(), f"{name} state_dict", False)
            for i, entry in ref.state_dict()["state"].items():
                assert list(sd["state"][i]) == list(entry), (name, i)
        saved = {"params": [p.detach().clone() for p in ref_model.parameters()]}
        saved["torch"] = ref.state_dict()
        problems += train_whole(world, name, range(10, STEPS), saved)[4]
    assert not problems, problems[:5]


@NEEDS_MUON
@pytest.mark.world(2, backend="gloo", timeout=60)
def test_muon_refuses_a_vector_on_every_rank_before_sharding(world: World) -> None:
    with pytest.raises(ValueError, match=r"ZeroRedundancyOptimizer: muon: expected 2-D param"):
        ZeroRedundancyOptimizer(build_model().parameters(), torch.optim.Muon, partition="flat")


@pytest.mark.world(1, backend="gloo", timeout=120)
@pytest.mark.parametrize("set_to_none", [False, True])
def test_one_rank_steps_each_bucket_as_one_tensor_and_keeps_kept_gradients_in_place(
    world: World, set_to_none: bool
) -> None:
    """At W = 1 the flat drop-in takes its gradients into one gradient shard, as ``shard``'s
    stage 1 does ([Note: one rank's gradients]): each step is one update kernel; a loop that
    zeroes ``.grad`` in place has them in the shard from the first step on (nothing copied),
    one that sets them to None has them copied. Both train as torch's fused AdamW, bitwise."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Names(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []
            self.updated: list[int] = []  # tensors per update kernel call

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            self.names.append(str(func))
            if func is torch.ops.aten._fused_adamw_.default:
                self.updated.append(len(args[0]))
            return func(*args, **(kwargs or {}))

    def build() -> torch.nn.Module:  # every tensor whole cache lines: a bucket can be one tensor
        torch.manual_seed(0)  # ([Note: prepared bucket updates]); every tensor with a gradient
        return torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 16)
        )

    model, ref_model = build(), build()
    ours = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, partition="flat")
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, fused=True)
    copied, kernels = [], []
    for step in range(4):
        for m, o in ((ref_model, ref), (model, ours)):
            o.zero_grad(set_to_none=set_to_none)
            m(torch.randn(4, 16, generator=torch.Generator().manual_seed(step))).pow(
                2
            ).mean().backward()
        ref.step()
        with Names() as names:
            ours.step()
        copied.append("aten._foreach_copy_.default" in names.names)
        kernels.append(names.updated)
        for a, b in zip(model.parameters(), ref_model.parameters()):
            assert torch.equal(a, b), step
    assert kernels == [[1]] * 4  # one kernel over one tensor (the bucket), not 4 pieces
    assert copied == ([True] * 4 if set_to_none else [True, False, False, False])
