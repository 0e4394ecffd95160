"""The torch.optim form: consolidated by gathers, equal to torch.optim's own state dict for the
ten core optimizers at W = 2, 3, 4, and loadable both ways (into torch.optim, into shards)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardopt.core import (
    DEFAULT_BUCKET_NUMEL,
    adadelta,
    adagrad,
    adam,
    adamax,
    adamw,
    chain,
    nadam,
    plan_partition,
    radam,
    rmsprop,
    rprop,
    sgd,
    trace,
)
from shardopt.functional import (
    consolidate_state_dict,
    load_torch_state_dict,
    shard,
    torch_hyperparams,
)

from _functional_helpers import (
    MIXED_SHAPES,
    rank_average,
    rel_error,
    seeded_params,
    sixty_fourths,
    state_equal,
)

F32, F64 = torch.float32, torch.float64
# Mixed dtypes; tensor 3 is frozen (never a gradient: no state entry, except for Adagrad),
# tensor 4 gets its first gradient only at step 1. Flat plans cut tensors across ranks.
SHAPES = MIXED_SHAPES
FROZEN, LATE = 3, 4
STEPS, MORE = 4, 3  # steps before consolidating, and after loading
RTOL = {F32: 1e-5, F64: 1e-11}  # measured: at most ~1e-7 and ~1e-15

# name: (our factory, torch class, torch kwargs): the ten core optimizers, and stateless SGD.
OPTIMIZERS: dict[str, tuple[Callable[[], Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (lambda: sgd(0.1), torch.optim.SGD, {"lr": 0.1}),
    "sgd_momentum": (
        lambda: sgd(0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
        torch.optim.SGD,
        {"lr": 0.1, "momentum": 0.9, "dampening": 0.1, "weight_decay": 0.01},
    ),
    "adam": (lambda: adam(1e-2), torch.optim.Adam, {"lr": 1e-2}),
    "adamw_amsgrad": (
        lambda: adamw(1e-2, weight_decay=0.1, amsgrad=True),
        torch.optim.AdamW,
        {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True},
    ),
    "adagrad": (
        lambda: adagrad(5e-2, initial_accumulator_value=0.1),
        torch.optim.Adagrad,
        {"lr": 5e-2, "initial_accumulator_value": 0.1},
    ),
    "rmsprop_centered": (
        lambda: rmsprop(1e-2, momentum=0.9, centered=True),
        torch.optim.RMSprop,
        {"lr": 1e-2, "momentum": 0.9, "centered": True},
    ),
    "adamax": (lambda: adamax(1e-2), torch.optim.Adamax, {"lr": 1e-2}),
    "nadam": (lambda: nadam(1e-2), torch.optim.NAdam, {"lr": 1e-2}),
    "radam": (lambda: radam(1e-2), torch.optim.RAdam, {"lr": 1e-2}),
    "adadelta": (lambda: adadelta(1.0), torch.optim.Adadelta, {"lr": 1.0}),
    "rprop": (lambda: rprop(1e-2), torch.optim.Rprop, {"lr": 1e-2}),
}
# (strategy, stage, bucket_numel): one bucket per group, a bucket about per tensor, the default.
CONFIGS = [
    ("flat", 1, None),
    ("greedy", 2, 16),
    ("flat", 2, 16),
    ("greedy", 1, DEFAULT_BUCKET_NUMEL),
]


def make_params() -> list[torch.Tensor]:
    return seeded_params(SHAPES)


def local_grads(step: int, rank: int) -> list[torch.Tensor | None]:
    """Rank ``rank``'s gradients at ``step``: multiples of 1/64, so sums over ranks are exact."""
    return sixty_fourths(
        SHAPES, 1000 * step + rank, lambda i: i == FROZEN or (i == LATE and step == 0)
    )


def averaged(step: int, world: int) -> list[torch.Tensor | None]:
    """The rank average of :func:`local_grads`, as the reduce-scatter computes it (sum, / W)."""
    return rank_average(lambda r: local_grads(step, r), world)


def as_torch_loads(sd: dict[str, Any]) -> dict[str, Any]:
    """``sd`` as torch.optim's ``load_state_dict`` keeps it: every floating tensor but "step"
    cast to its parameter's dtype (NAdam's float32 ``mu_product`` of a float64 parameter too)."""
    state = {
        k: {key: x if key == "step" else x.to(SHAPES[k][1]) for key, x in entry.items()}
        for k, entry in sd["state"].items()
    }
    return {"state": state, "param_groups": sd["param_groups"]}


def state_error(ours: dict[str, Any], ref: dict[str, Any]) -> tuple[bool, float]:
    """(same structure: param_groups, entries, keys, dtypes, shapes, steps; largest relative
    error of the tensors scaled to their dtype's tolerance: <= 1 passes)."""
    same = ours["param_groups"] == ref["param_groups"] and set(ours["state"]) == set(ref["state"])
    worst = 0.0
    for k, entry in ref["state"].items():
        mine = ours["state"].get(k, {})
        same = same and set(mine) == set(entry)
        for key, x in entry.items():
            y = mine.get(key)
            if y is None or y.dtype != x.dtype or y.shape != x.shape:
                return False, float("inf")
            if key == "step":
                same = same and torch.equal(x, y)
            else:
                worst = max(worst, rel_error(y, x) / RTOL[x.dtype])
    return same, worst


def train(sharded, state, params, ref_opt, ref, steps: range, rank: int, world: int, stage: int):
    for step in steps:
        avg = averaged(step, world)
        if ref_opt is not None:
            for p, g in zip(ref, avg):
                p.grad = g
            ref_opt.step()
        state = sharded.step(params, local_grads(step, rank), state)  # step averages them
    return state


def one_case(
    rank: int, world: int, name: str, strategy: str, stage: int, bucket: int | None
) -> dict[str, Any]:
    """STEPS steps of ours and of torch; consolidate; load it into torch and torch's into ours;
    MORE steps of everything. The measures are taken on rank 0."""
    factory, cls, kwargs = OPTIMIZERS[name]
    hyper = torch_hyperparams(cls, **kwargs)
    params = make_params()
    ref = [p.clone().requires_grad_(i != FROZEN) for i, p in enumerate(params)]
    ref_opt = cls(ref, **kwargs)
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(factory(), plan, stage=stage)
    state = train(
        sharded, sharded.init(params), params, ref_opt, ref, range(STEPS), rank, world, stage
    )
    ours = consolidate_state_dict(state, hyper)
    ref_sd = ref_opt.state_dict()
    # torch -> shards: a fresh sharded state on torch's parameters, loaded from torch's dict
    back_params = [p.detach().clone() for p in ref]
    back = shard(factory(), plan, stage=stage)
    back_state = back.init(back_params)
    load_torch_state_dict(back_state, ref_sd)
    reloaded = consolidate_state_dict(back_state, hyper)
    # shards -> torch: a torch optimizer on our parameters, loaded from the consolidated dict
    mine = [p.clone().requires_grad_(i != FROZEN) for i, p in enumerate(params)]
    mine_opt = cls(mine, **kwargs)
    if rank == 0:
        mine_opt.load_state_dict(ours)
    rows: dict[str, Any] = {"got_dict": ours is not None}
    if rank == 0:
        rows["structure"], rows["state_error"] = state_error(ours, ref_sd)
        rows["round_trip"] = state_equal(mine_opt.state_dict(), as_torch_loads(ours))
        rows["scatter"] = state_equal(reloaded, ref_sd)
    more = range(STEPS, STEPS + MORE)
    train(sharded, state, params, mine_opt if rank == 0 else None, mine, more, rank, world, stage)
    train(back, back_state, back_params, ref_opt, ref, more, rank, world, stage)
    if rank != 0:  # only rank 0 has the consolidated dict: the others' torch copy is idle
        mine = ref
    errors = [
        max(rel_error(a, b.detach()), rel_error(c.detach(), b.detach())) / RTOL[d]
        for a, b, c, (_, d) in zip(params, ref, mine, SHAPES)
    ]
    errors += [rel_error(a, b.detach()) / RTOL[d] for a, b, (_, d) in zip(back_params, ref, SHAPES)]
    rows["continue_error"] = max(errors)
    return rows


def table(rank: int, world: int) -> list[tuple[str, str, int, dict[str, Any]]]:
    return [
        (name, f"{strategy}/{bucket}", stage, one_case(rank, world, name, strategy, stage, bucket))
        for name in OPTIMIZERS
        for strategy, stage, bucket in CONFIGS
    ]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_the_consolidated_state_is_torch_optims_and_loads_both_ways(run_world, world):
    """For each optimizer, plan and stage after 4 steps: the dict gathered on rank 0 has
    torch.optim's structure exactly (param groups, which parameters have entries, keys, dtypes,
    shapes, steps) and its values within float tolerance; torch.optim loads it (its state_dict
    is then the same dict, bitwise) and torch's own dict scatters into fresh shards exactly
    (consolidating them again gives it back bitwise); then 3 more steps of the torch optimizer
    loaded from ours, of ours, and of the shards loaded from torch all track torch."""
    results = run_world(table, world, timeout=150)
    for name, strategy, stage, rows in results[0]:
        where = f"{name}, {strategy}, stage {stage}"
        assert rows["structure"], f"{where}: not torch.optim's structure"
        assert rows["state_error"] <= 1, f"{where}: state error {rows['state_error']:.2f} x tol"
        assert rows["round_trip"], f"{where}: torch.optim did not keep the loaded dict as is"
        assert rows["scatter"], f"{where}: scattering torch's dict did not reproduce it"
        assert rows["continue_error"] <= 1, f"{where}: {rows['continue_error']:.2f} x tol"
        assert rows["got_dict"]
    for rank in range(1, world):
        assert not any(rows["got_dict"] for *_, rows in results[rank]), f"rank {rank} got one"
        assert all(rows["continue_error"] <= 1 for *_, rows in results[rank])


NAMES = ["a.w", "a.b", "conv", "frozen", "late", "scale", "out"]


def torch_form_errors(rank: int, world: int) -> dict[str, str]:
    """Calls that must fail on every rank alike, before any collective; and the FQN variant."""
    params = make_params()
    plan = plan_partition(params, world)
    sharded = shard(adam(1e-2), plan)
    state = train(sharded, sharded.init(params), params, None, [], range(2), rank, world, 1)
    named = consolidate_state_dict(state, names=NAMES, to=world - 1)
    ref = [p.clone().requires_grad_() for p in params]
    sgd_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9)
    for p, g in zip(ref, averaged(1, world)):
        p.grad = g
    sgd_opt.step()
    indexed = consolidate_state_dict(state, to=0)
    full = indexed if rank == 0 else None
    full = [full]
    torch.distributed.broadcast_object_list(full, src=0)  # the test's own plumbing
    torch_sd = full[0]
    wrong_shape = {**torch_sd, "state": {**torch_sd["state"], 0: {**torch_sd["state"][0]}}}
    wrong_shape["state"][0]["exp_avg"] = torch.zeros(5, 7)
    partial = {**torch_sd, "state": {k: v for k, v in torch_sd["state"].items() if k != 0}}

    def fresh() -> Any:
        return shard(adam(1e-2), plan).init(make_params())

    attempts: dict[str, Callable[[], Any]] = {
        "two optimizers": lambda: consolidate_state_dict(
            shard(chain(trace(0.9), trace(0.5)), plan).init(make_params())
        ),
        "bad to": lambda: consolidate_state_dict(state, to=world),
        "param groups": lambda: consolidate_state_dict(state, [{}, {}]),
        "names": lambda: consolidate_state_dict(state, names=["a"]),
        "sgd dict": lambda: load_torch_state_dict(fresh(), sgd_opt.state_dict()),
        "other model": lambda: load_torch_state_dict(
            fresh(), torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))]).state_dict()
        ),
        "wrong shape": lambda: load_torch_state_dict(fresh(), wrong_shape),
        "stepped": lambda: load_torch_state_dict(state, partial),
    }
    out = {}
    for what, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            out[what] = str(exc)
        else:
            out[what] = "no error"
    back = fresh()
    if named is not None:
        out["named keys"] = repr(list(named["state"]))
    full = [named]
    torch.distributed.broadcast_object_list(full, src=world - 1)
    load_torch_state_dict(back, full[0], names=NAMES)
    again = consolidate_state_dict(back, names=NAMES, to=world - 1)
    out["named round trip"] = repr(again is None or state_equal(again, full[0]))
    return out


def test_the_torch_form_refuses_what_it_cannot_represent_and_takes_names(run_world):
    results = run_world(torch_form_errors, 2)
    expected = {
        "two optimizers": "consolidate_state_dict: expected the state of one of the core "
        "optimizers",
        "bad to": "consolidate_state_dict: expected 0 <= to < 2, got 2",
        "param groups": "consolidate_state_dict: expected param_groups to be one mapping, or 1",
        "names": "consolidate_state_dict: expected names to be 7 strings",
        "sgd dict": "load_torch_state_dict: parameter 0 (group 0), keys: expected ['exp_avg', "
        "'exp_avg_sq', 'step'] (what a step makes), got ['momentum_buffer']",
        "other model": "load_torch_state_dict: expected param_groups with params [[0, 1, 2, 3, "
        "4, 5, 6]], got [[0]]",
        "wrong shape": "load_torch_state_dict: parameter 0 (group 0), entry 'exp_avg': expected "
        "shape (7, 5) (the parameter's), got (5, 7)",
    }
    for rank, out in enumerate(results):
        for what, fragment in expected.items():
            assert fragment in out[what], f"rank {rank}, {what}: {out[what]}"
        assert out["named round trip"] == "True", f"rank {rank}"
    assert "whose state here has count 2" in results[0]["stepped"]  # rank 0 owns tensor 0
    assert results[1]["named keys"] == repr([n for n in NAMES if n != "frozen"])
