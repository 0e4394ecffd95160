"""No hang, no silent divergence: every cross-rank mismatch raises a named error on every rank.

Each case gives the last rank ("odd") other input than the rest, or gives every rank an input
that only the owner of some parameter would notice. Every rank must raise within a few seconds,
with a message naming the API the user called. Each case runs in a fresh gloo group with a short
timeout, so a case that hangs fails with a timeout instead of stalling the suite.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.core import adam, adamw, plan_partition
from shardopt.functional import consolidate_state_dict, shard
from shardopt.optim import ZeroRedundancyOptimizer as Zero

SECONDS = 5.0  # every rank must have raised within this
Case = Callable[[bool, dict[str, Any], Any], Any]


def params(shapes: tuple[tuple[int, ...], ...] = ((4, 3), (3,), (5,)), dtype: Any = None) -> list:
    gen = torch.Generator().manual_seed(0)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen, dtype=dtype or torch.float32))
        for s in shapes
    ]


def zero(odd: bool, kw: dict[str, Any], pg: Any, **changes: Any) -> Zero:
    """A ZeroRedundancyOptimizer over :func:`params` with ``kw``; ``changes`` on the odd rank."""
    args = {"params": params(), "optimizer_class": torch.optim.Adam, "lr": 0.1, **kw}
    if odd:
        args.update(changes)
    return Zero(args.pop("params"), args.pop("optimizer_class"), process_group=pg, **args)


def stepped(kw: dict[str, Any], pg: Any) -> Zero:
    opt = zero(False, kw, pg)
    for p in opt._all_params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def sparse_grads(kw: dict[str, Any], pg: Any) -> None:
    opt = zero(False, kw, pg)
    for p in opt._all_params:
        p.grad = torch.ones_like(p).to_sparse()
    opt.step()


ZERO_CASES: dict[str, Case] = {
    "empty_params": lambda odd, kw, pg: zero(odd, kw, pg, params=[]),
    "params_not_a_list": lambda odd, kw, pg: zero(odd, kw, pg, params=torch.zeros(3)),
    "mixed_dtypes_on_one_rank": lambda odd, kw, pg: zero(
        odd, kw, pg, params=[*params(), torch.nn.Parameter(torch.zeros(2, dtype=torch.float64))]
    ),
    "float64_on_one_rank": lambda odd, kw, pg: zero(
        odd, kw, pg, params=params(dtype=torch.float64)
    ),
    "shapes": lambda odd, kw, pg: zero(odd, kw, pg, params=params(((4, 3), (3,), (6,)))),
    "param_count": lambda odd, kw, pg: zero(odd, kw, pg, params=params()[:2]),
    "lr": lambda odd, kw, pg: zero(odd, kw, pg, lr=0.2),
    "betas": lambda odd, kw, pg: zero(odd, kw, pg, betas=(0.8, 0.999)),
    "weight_decay": lambda odd, kw, pg: zero(odd, kw, pg, weight_decay=0.01),
    "invalid_lr_on_one_rank": lambda odd, kw, pg: zero(odd, kw, pg, lr=-1.0),
    "adamw_against_adam": lambda odd, kw, pg: zero(odd, kw, pg, optimizer_class=torch.optim.AdamW),
    "sgd_against_adam": lambda odd, kw, pg: zero(odd, kw, pg, optimizer_class=torch.optim.SGD),
    "partition": lambda odd, kw, pg: zero(
        odd, kw, pg, partition="greedy" if kw.get("partition") == "flat" else "flat"
    ),
    "bucket_view": lambda odd, kw, pg: zero(
        odd, kw, pg, parameters_as_bucket_view=not kw.get("parameters_as_bucket_view", False)
    ),
    "extra_param_group": lambda odd, kw, pg: zero(
        odd, kw, pg, params=[{"params": params()[:2]}, {"params": params()[2:]}]
    ),
    "add_param_group_shapes": lambda odd, kw, pg: zero(False, kw, pg).add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(3 if odd else 4))]}
    ),
    "add_param_group_lr": lambda odd, kw, pg: zero(False, kw, pg).add_param_group(
        {"params": [torch.nn.Parameter(torch.zeros(4))], "lr": 0.3 if odd else 0.1}
    ),
    "add_param_group_on_one_rank_while_others_consolidate": lambda odd, kw, pg: (
        zero(False, kw, pg).add_param_group({"params": [torch.nn.Parameter(torch.zeros(4))]})
        if odd
        else zero(False, kw, pg).consolidate_state_dict(to=0)
    ),
    "consolidate_to": lambda odd, kw, pg: stepped(kw, pg).consolidate_state_dict(to=int(odd)),
    "consolidate_to_out_of_range_on_one_rank": lambda odd, kw, pg: stepped(
        kw, pg
    ).consolidate_state_dict(to=7 if odd else 0),
    "sparse_grads_on_every_rank": lambda odd, kw, pg: sparse_grads(kw, pg),
}
ZERO_CONFIGS = {
    "greedy": {},
    "greedy_bucket_view": {"parameters_as_bucket_view": True},
    "flat": {"partition": "flat"},
}


def sharded(odd: bool, kw: dict[str, Any], pg: Any, **changes: Any) -> Any:
    """shard(...).init over a plan of :func:`params`; ``changes`` on the odd rank: ``tx``,
    ``stage``, ``shapes``, ``strategy``, or ``init`` (the params given to init)."""
    args = {"tx": adam(0.1), "shapes": ((4, 3), (3,), (5,)), "strategy": "flat", **kw}
    if odd:
        args.update(changes)
    ps = params(args["shapes"])
    plan = plan_partition(ps, dist.get_world_size(pg), strategy=args["strategy"])
    fn = shard(args["tx"], plan, process_group=pg, stage=args.get("stage", 1))
    state = fn.init(args.get("init", ps))
    return fn, ps, state


def wrong_grads(kw: dict[str, Any], pg: Any, grad: Callable[[torch.Tensor], Any]) -> None:
    fn, ps, state = sharded(False, kw, pg)
    fn.step(ps, [grad(p) for p in ps], state)


def consolidate_to(odd: bool, kw: dict[str, Any], pg: Any, to: int) -> None:
    fn, ps, state = sharded(False, kw, pg)
    state = fn.step(ps, [torch.ones_like(p) for p in ps], state)
    consolidate_state_dict(state, to=to if odd else 0, process_group=pg)


SHARD_CASES: dict[str, Case] = {
    "param_count": lambda odd, kw, pg: sharded(odd, kw, pg, init=params()[:2]),
    "float64_params_against_the_plan": lambda odd, kw, pg: sharded(
        odd, kw, pg, init=params(dtype=torch.float64)
    ),
    "non_leaf_params": lambda odd, kw, pg: sharded(odd, kw, pg, init=[p * 1 for p in params()]),
    "plan_shapes": lambda odd, kw, pg: sharded(odd, kw, pg, shapes=((4, 3), (3,), (6,))),
    "strategy": lambda odd, kw, pg: sharded(odd, kw, pg, strategy="greedy"),
    "lr": lambda odd, kw, pg: sharded(odd, kw, pg, tx=adam(0.2)),
    "betas": lambda odd, kw, pg: sharded(odd, kw, pg, tx=adam(0.1, betas=(0.8, 0.999))),
    "eps": lambda odd, kw, pg: sharded(odd, kw, pg, tx=adam(0.1, eps=1e-6)),
    "adamw_against_adam": lambda odd, kw, pg: sharded(odd, kw, pg, tx=adamw(0.1)),
    "stage": lambda odd, kw, pg: sharded(odd, kw, pg, stage=3 - kw["stage"]),
    "consolidate_to": lambda odd, kw, pg: consolidate_to(odd, kw, pg, 1),
    "consolidate_to_out_of_range_on_one_rank": lambda odd, kw, pg: consolidate_to(odd, kw, pg, 9),
    "sparse_grads_on_every_rank": lambda odd, kw, pg: wrong_grads(kw, pg, lambda p: p.to_sparse()),
    "wrong_grad_shapes_on_every_rank": lambda odd, kw, pg: wrong_grads(
        kw, pg, lambda p: torch.ones(p.numel() + 1)
    ),
}
SHARD_CONFIGS = {"stage1": {"stage": 1}, "stage2": {"stage": 2}}


def run_cases(rank: int, world: int, api: str, config: str) -> dict[str, tuple[str, float]]:
    """Per case: (``"TypeName: message"`` of what this rank raised, or ``"no error"``; seconds)."""
    cases, kw = (
        (ZERO_CASES, ZERO_CONFIGS[config])
        if api == "zero"
        else (SHARD_CASES, SHARD_CONFIGS[config])
    )
    out = {}
    for name, case in cases.items():
        pg = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=2 * SECONDS))
        start = time.perf_counter()
        try:
            case(rank == world - 1, dict(kw), pg)
            outcome = "no error"
        except Exception as exc:
            outcome = f"{type(exc).__name__}: {exc}"
        out[name] = (outcome, time.perf_counter() - start)
    return out


NAMES = {"zero": ("ZeroRedundancyOptimizer",), "shard": ("shard", "consolidate_state_dict")}


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize(
    ("api", "config"),
    [("zero", c) for c in ZERO_CONFIGS] + [("shard", c) for c in SHARD_CONFIGS],
)
def test_every_mismatch_raises_a_named_error_on_every_rank_within_seconds(
    run_world: Any, api: str, config: str, world: int
) -> None:
    results = run_world(run_cases, world, api, config, timeout=240.0)
    bad = []
    for name in results[0]:
        for rank, per_rank in enumerate(results):
            outcome, seconds = per_rank[name]
            named = any(f"{n}" in outcome for n in NAMES[api])
            if outcome == "no error" or not named or "imeout" in outcome or seconds > SECONDS:
                bad.append(f"{name} rank {rank} ({seconds:.1f} s): {outcome[:300]}")
    assert not bad, "\n".join(bad)
