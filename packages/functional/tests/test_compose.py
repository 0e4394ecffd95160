"""Composed transformations under shard: exact against one process fed the mean gradient, or
refused at init on every rank (core's [Note: kinds] and [Note: reductions across shards])."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardopt.core import (
    Transformation,
    apply_updates,
    chain,
    clip_by_global_norm,
    masked,
    muon,
    partition,
    plan_partition,
    scale,
    trace,
)
from shardopt.core.blocks import Kind, stateless, tensor_norms, tree_map, with_kind
from shardopt.functional import shard
from shardopt.testing import World

STEPS = 3
SHAPES = [(6, 5), (7,), (3, 4), (1,), (9, 2)]  # cut across ranks by flat plans at W = 2 and 3


def params_() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def grads_of(step: int, rank: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in SHAPES]


def elementwise(tx: Transformation, name: str) -> Transformation:
    return with_kind(tx, Kind.ELEMENTWISE, name)


def momentum(lr: float) -> Transformation:
    return chain(elementwise(trace(0.9), "trace"), elementwise(scale(-lr), "scale"))


def trust_ratio() -> Transformation:
    """A user's LAMB-style trust ratio written with the reduction blocks: each update scaled by
    ||p|| / ||u|| of its whole tensor."""

    def apply(updates: Any, params: Any) -> Any:
        p_norms, u_norms = tensor_norms(params, updates)  # one all-reduce for both

        def ratio(u: Any, pn: Any, un: Any) -> Any:
            if u is None:
                return None
            trust = torch.where((pn > 0) & (un > 0), pn / un, torch.ones_like(pn))
            return u * trust.to(u.dtype)

        return tree_map(ratio, updates, p_norms, u_norms)

    return with_kind(stateless(apply), Kind.PER_TENSOR, "trust_ratio")


def by_dim(p: torch.Tensor) -> str:
    return "matrix" if p.dim() == 2 else "vector"


CASES: dict[str, Callable[[], Transformation]] = {
    "partition by dim()": lambda: partition(
        {"matrix": momentum(0.1), "vector": elementwise(scale(-0.01), "scale")},
        lambda ps: tree_map(by_dim, ps),
    ),
    "masked by a static tree": lambda: chain(
        masked(elementwise(scale(0.0), "scale"), [False, True, False, True, False]),
        momentum(0.1),
    ),
    "masked by dim()": lambda: chain(
        masked(elementwise(scale(0.0), "scale"), lambda ps: [p.dim() == 1 for p in ps]),
        momentum(0.1),
    ),
    "clip_by_global_norm then momentum": lambda: chain(clip_by_global_norm(0.5), momentum(0.1)),
    "trust ratio then momentum": lambda: chain(trust_ratio(), momentum(0.1)),
    "partition by dim() of clip and trust ratio": lambda: partition(
        {
            "matrix": chain(trust_ratio(), momentum(0.1)),
            "vector": chain(clip_by_global_norm(0.1), momentum(0.1)),
        },
        lambda ps: tree_map(by_dim, ps),
    ),
}


def assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Within 1e-6 of each tensor's norm: the reductions travel as float32 partials."""
    for t, (a, b) in enumerate(zip(ours, ref)):
        error = float((a - b).norm() / b.norm())
        assert error <= 1e-6, f"tensor {t}: relative error {error:.2e}"


def one_process(tx: Transformation, world: int) -> list[torch.Tensor]:
    params = params_()
    state = tx.init(params)
    for step in range(STEPS):
        mean = [sum(gs) / world for gs in zip(*(grads_of(step, r) for r in range(world)))]
        updates, state = tx.update(mean, state, params)
        params = apply_updates(params, updates)
    return params


def sharded(tx: Transformation, world: World, strategy: str, stage: int) -> list[torch.Tensor]:
    params = params_()
    plan = plan_partition(params, world.world_size, strategy=strategy, bucket_numel=16)
    sharding = shard(tx, plan, stage=stage)
    state = sharding.init(params)
    for step in range(STEPS):
        state = sharding.step(params, grads_of(step, world.rank), state)
    return params


def failures(world: World, strategy: str, stage: int) -> dict[str, str]:
    """Every case of CASES stepped in this world (one world for the table: a world costs more
    to start than its steps); the cases whose parameters are not within 1e-6."""
    out = {}
    for case in CASES:
        ours = sharded(CASES[case](), world, strategy, stage)
        try:
            assert_close(ours, one_process(CASES[case](), world.world_size))
        except AssertionError as exc:
            out[case] = str(exc)
    return out


@pytest.mark.parametrize("strategy", ["flat", "greedy"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.world(2, timeout=120)
def test_every_composed_chain_sharded_at_w2_equals_one_process_fed_the_mean_gradient(
    world: World, strategy: str, stage: int
) -> None:
    assert failures(world, strategy, stage) == {}


@pytest.mark.world(3, timeout=120)
def test_every_composed_chain_sharded_flat_at_w3_equals_one_process_fed_the_mean_gradient(
    world: World,
) -> None:
    assert failures(world, "flat", 2) == {}


def undeclared_trust_ratio() -> Transformation:
    def apply(updates: Any, params: Any) -> Any:
        return [u / u.norm() for u in updates]  # a slice's norm, not the tensor's

    return stateless(apply)


@pytest.mark.world(2, timeout=120)
def test_an_undeclared_per_tensor_transformation_is_refused_at_init_on_every_rank(
    world: World,
) -> None:
    params = params_()
    plan = plan_partition(params, world.world_size, strategy="flat")
    with pytest.raises(
        ValueError,
        match=r"got undeclared_trust_ratio, which declares none and whose update of one "
        r"element reads other elements of the tensor",
    ):
        shard(chain(undeclared_trust_ratio(), momentum(0.1)), plan).init(params)


@pytest.mark.world(2, timeout=120)
def test_a_shaped_transformation_on_a_flat_plan_is_refused_naming_it(world: World) -> None:
    params = [torch.randn(4, 4) for _ in range(2)]
    plan = plan_partition(params, world.world_size, strategy="flat")
    with pytest.raises(ValueError, match=r"for muon, which needs each tensor in its shape"):
        shard(muon(lr=0.02), plan).init(params)


@pytest.mark.world(2, timeout=120)
def test_a_per_tensor_chain_adds_one_small_all_reduce_per_reduction_point(
    world: World,
) -> None:
    from shardopt.functional.engine import _scope

    params = params_()
    plan = plan_partition(params, world.world_size, strategy="flat", bucket_numel=16)
    sharding = shard(chain(trust_ratio(), momentum(0.1)), plan)
    state = sharding.init(params)
    sent: list[int] = []
    real = _scope.all_reduce_op

    def counted(tensor: torch.Tensor, op: Any, *, group: Any = None) -> Any:
        sent.append(tensor.numel() * tensor.element_size())
        return real(tensor, op, group=group)

    _scope.all_reduce_op = counted  # type: ignore[assignment]
    try:
        state = sharding.step(params, grads_of(0, world.rank), state)
    finally:
        _scope.all_reduce_op = real  # type: ignore[assignment]
    assert len(sent) == 1  # ||p|| and ||u|| of one point travel together
    assert sent[0] <= 8 * len(SHAPES) + 8, sent  # a float32 per tensor and tree, for each


@pytest.mark.world(2, timeout=120)
def test_an_elementwise_chain_adds_no_collective_of_the_scope(world: World) -> None:
    params = params_()
    plan = plan_partition(params, world.world_size, strategy="flat", bucket_numel=16)
    sharding = shard(momentum(0.1), plan)
    state = sharding.init(params)
    state = sharding.step(params, grads_of(0, world.rank), state)
    assert state.param_buffers.scope.reducer.calls == 0


@pytest.mark.world(4, timeout=120)
def test_a_reducing_chain_on_a_hybrid_mesh_equals_one_process_fed_the_mean_gradient(
    world: World,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    case = "partition by dim() of clip and trust ratio"
    params = params_()
    plan = plan_partition(params, 2, strategy="flat", bucket_numel=16)  # the shard dim's size
    sharding = shard(CASES[case](), plan, process_group=mesh, stage=2)
    state = sharding.init(params)
    for step in range(STEPS):
        state = sharding.step(params, grads_of(step, world.rank), state)
    assert_close(params, one_process(CASES[case](), world.world_size))


# Tensor parallelism: (dp=2, tp=2), with three of the five tensors DTensors split over "tp" (by
# rows, by columns, by rows) and two replicated; the reductions count a split tensor's parts over
# "tp" too, and a replicated one once ([Note: reductions over tensor-parallel tensors]).
TP_PLACEMENTS = ["rows", "replicate", "columns", "replicate", "rows"]


def _tensor_parallel(tensors: list[torch.Tensor], tp: Any) -> list[Any]:
    try:
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import Replicate, Shard, distribute_tensor
    kinds = {"rows": Shard(0), "columns": Shard(1), "replicate": Replicate()}
    with warnings.catch_warnings():  # torch 2.4, of its random ops, which we do not use
        warnings.filterwarnings("ignore", "DTensor random operators", UserWarning)
        return [distribute_tensor(t, tp, [kinds[k]]) for t, k in zip(tensors, TP_PLACEMENTS)]


def tensor_parallel_failures(world: World, strategy: str, stage: int) -> dict[str, str]:
    """Every case of CASES over (dp=2, tp=2) DTensors, against one process fed the mean of the
    two data-parallel ranks' gradients; the cases whose full parameters are not within 1e-6."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp = mesh.get_local_rank("dp")
    out = {}
    for case in CASES:
        params = _tensor_parallel(params_(), mesh["tp"])
        assert sum(p.to_local().shape != p.shape for p in params) == 3
        plan = plan_partition(params, 2, strategy=strategy, bucket_numel=16)
        sharding = shard(CASES[case](), plan, process_group=mesh["dp"], stage=stage)
        state = sharding.init(params)
        for step in range(STEPS):
            grads = _tensor_parallel(grads_of(step, dp), mesh["tp"])
            state = sharding.step(params, grads, state)
        try:
            assert_close([p.full_tensor() for p in params], one_process(CASES[case](), 2))
        except AssertionError as exc:
            out[case] = str(exc)
    return out


@pytest.mark.parametrize(("strategy", "stage"), [("flat", 2), ("greedy", 1)])
@pytest.mark.world(4, timeout=180)
def test_every_composed_chain_over_tensor_parallel_dtensors_equals_one_process(
    world: World, strategy: str, stage: int
) -> None:
    assert tensor_parallel_failures(world, strategy, stage) == {}


@pytest.mark.world(4, timeout=120)
def test_row_norms_of_tensors_split_by_tensor_parallelism_are_refused_on_every_rank(
    world: World,
) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from shardopt.core import adaptive_grad_clip

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    params = _tensor_parallel(params_(), mesh["tp"])
    plan = plan_partition(params, 2, strategy="flat", bucket_numel=16)
    sharding = shard(chain(adaptive_grad_clip(0.1), momentum(0.1)), plan, process_group=mesh["dp"])
    state = sharding.init(params)
    grads = _tensor_parallel(grads_of(0, mesh.get_local_rank("dp")), mesh["tp"])
    with pytest.raises(ValueError, match=r"got row sums \(row_norm\), whose rows tensor"):
        sharding.step(params, grads, state)
