"""Device meshes: a 1-D mesh is its group; a 2-D ("replicate", "shard") mesh shards the state
over "shard" and averages gradients across replicas, matching one process on the full batch."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from shardopt.core import adamw, plan_partition
from shardopt.functional import (
    load_checkpoint,
    register_grad_hooks,
    register_param_hooks,
    replica_traffic,
    save_checkpoint,
    shard,
    shard_cost,
    wait_params,
)
from shardopt.testing import count_collectives

from _functional_helpers import (
    dtensor_type,
    full_batch_adamw,
    full_tensors,
    mlp_batch,
    small_mlp,
    tensor_parallel_mlp,
)

DTensor = dtensor_type()
STEPS = 10


def make_mesh(kind: str, world: int) -> Any:
    if kind == "1d":
        return init_device_mesh("cpu", (world,))
    return init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))


def train_on_mesh(
    rank: int, world: int, kind: str, stage: int, strategy: str, hooks: bool
) -> tuple[list[torch.Tensor], int, int]:
    """(final parameters, this rank's state elements, the model's elements)."""
    mesh = make_mesh(kind, world)
    shards = world if kind == "1d" else world // 2
    model = small_mlp()
    params = list(model.parameters())
    plan = plan_partition(params, shards, strategy=strategy, bucket_numel=100)
    sharded = shard(adamw(1e-2), plan, process_group=mesh, stage=stage)
    state = sharded.init(params)
    if hooks:
        register_grad_hooks(params, state)
    for step in range(STEPS):
        x, y = mlp_batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    leaves = torch.utils._pytree.tree_leaves(state.inner)
    held = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0)
    return [p.detach() for p in params], held, sum(p.numel() for p in params)


@pytest.mark.parametrize(
    ("kind", "stage", "strategy", "hooks"),
    [
        ("2d", 1, "flat", False),
        ("2d", 2, "flat", True),
        ("2d", 2, "greedy", False),
        ("2d", 1, "greedy", True),
        ("1d", 2, "flat", True),
    ],
)
def test_a_mesh_matches_one_process_on_the_full_batch(run_world, kind, stage, strategy, hooks):
    expected = full_batch_adamw(4, STEPS)
    results = run_world(train_on_mesh, 4, kind, stage, strategy, hooks)
    for params, _, _ in results:
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
    # Two moments of 1/S of the model per rank: the ranks of a replica hold the model's state
    # once between them (S = 2 on the hybrid mesh: ranks 0-1 and 2-3; S = 4 on the 1-D mesh).
    held, total = [h for _, h, _ in results], results[0][2]
    replicas = [held] if kind == "1d" else [held[:2], held[2:]]
    assert all(sum(r) == 2 * total for r in replicas), (held, total)


def bytes_per_dim(
    rank: int, world: int, stage: int, comm: torch.dtype | None
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(the bytes handed to collectives in the "shard" group over one step and their calls, the
    same in the "replicate" group, and the predictions of both): (all-reduce, reduce-scatter,
    all-gather, calls) each, as ``CollectiveLog.totals`` counts them."""
    mesh = make_mesh("2d", world)
    model = small_mlp()
    params = list(model.parameters())
    plan = plan_partition(params, 2, bucket_numel=100)
    sharded = shard(
        adamw(1e-2), plan, process_group=mesh, stage=stage, algorithm="collective", comm_dtype=comm
    )
    state = sharded.init(params)
    x, y = mlp_batch(0, rank)
    nn.functional.mse_loss(model(x), y).backward()
    with count_collectives() as log:
        sharded.step(params, None, state)
    inner = log.in_group(mesh.get_group("shard")).totals()
    across = log.in_group(mesh.get_group("replicate")).totals()
    _, traffic = shard_cost(plan, stage=stage, algorithm="collective", comm_dtype=comm)
    rank_in_shard, replicas = mesh.get_local_rank("shard"), mesh.size(0)
    predicted = replica_traffic(plan, rank_in_shard, replicas, comm_dtype=comm)
    predicted_across = dataclasses.astuple(predicted)
    return tuple(inner), tuple(across), dataclasses.astuple(traffic), predicted_across


@pytest.mark.parametrize("comm", [None, torch.bfloat16], ids=["own-dtype", "bfloat16-wire"])
@pytest.mark.parametrize("stage", [1, 2])
def test_bytes_per_mesh_dim_equal_the_prediction(run_world, stage, comm):
    for inner, across, predicted_inner, predicted_across in run_world(
        bytes_per_dim, 4, stage, comm
    ):
        assert inner == predicted_inner
        assert across == predicted_across
        assert sum(across[:3]) > 0


def mismatched_meshes(rank: int, world: int) -> str:
    """Every rank builds both meshes; rank 0 passes the 1-D one, the others the 2-D one."""
    flat, hybrid = make_mesh("1d", world), make_mesh("2d", world)
    params = list(small_mlp().parameters())
    mesh, shards = (flat, 4) if rank == 0 else (hybrid, 2)
    try:
        shard(adamw(), plan_partition(params, shards), process_group=mesh).init(params)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_mismatched_meshes_fail_on_every_rank_with_a_clear_error(run_world):
    for message in run_world(mismatched_meshes, 4, timeout=60.0):
        assert message.startswith("shard: expected the same parameters, plan, options")


def three_dims(rank: int, world: int) -> str:
    mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("a", "replicate", "shard"))
    try:
        shard(adamw(), plan_partition([torch.zeros(2)], 2), process_group=mesh)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_mesh_of_another_shape_is_refused_by_name(run_world):
    for message in run_world(three_dims, 4):
        assert message == (
            "shard: expected a process group, a 1-D DeviceMesh or a 2-D one with dims "
            "('replicate', 'shard'), got a 3-D mesh with dims ('a', 'replicate', 'shard')"
        )


def train_tensor_parallel(
    rank: int, world: int, stage: int, strategy: str, hooks: str, max_norm: float | None = None
) -> list[torch.Tensor]:
    """(dp=2, tp=2): the first two layers tensor-parallel over "tp" (column- then row-wise),
    shard over "dp"; the full parameters after STEPS steps."""
    mesh, model = tensor_parallel_mlp()
    params = list(model.parameters())
    assert sum(isinstance(p, DTensor) for p in params) == 4
    plan = plan_partition(params, 2, strategy=strategy, bucket_numel=100)
    sharded = shard(adamw(1e-2), plan, process_group=mesh["dp"], stage=stage, max_norm=max_norm)
    state = sharded.init(params)
    if hooks in ("grad", "both"):
        register_grad_hooks(params, state)
    if hooks == "both":
        register_param_hooks(model, state)
    dp = mesh.get_local_rank("dp")
    for step in range(STEPS):
        x, y = mlp_batch(step, dp)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    wait_params(state)
    return full_tensors(params)


@pytest.mark.parametrize(
    ("stage", "strategy", "hooks"),
    [(1, "flat", "none"), (2, "flat", "both"), (2, "greedy", "none"), (1, "greedy", "grad")],
)
def test_tensor_parallel_dtensor_params_shard_over_dp_and_match_one_process(
    run_world, stage, strategy, hooks
):
    expected = full_batch_adamw(2, STEPS)
    for params in run_world(train_tensor_parallel, 4, stage, strategy, hooks):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


def clipped_full_batch_adamw(world: int, steps: int, max_norm: float) -> list[torch.Tensor]:
    """full_batch_adamw with torch's clip_grad_norm_ before each step."""
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        xs, ys = zip(*(mlp_batch(step, r) for r in range(world)))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        assert norm > max_norm  # clipping takes effect at every step
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize("stage", [1, 2])
def test_clipping_with_tensor_parallel_params_uses_the_norm_of_the_full_gradient(run_world, stage):
    expected = clipped_full_batch_adamw(2, STEPS, 0.05)
    for params in run_world(train_tensor_parallel, 4, stage, "flat", "grad", 0.05):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


# Checkpoints of tensor-parallel and hybrid states (see [Note: tensor-parallel checkpoints]): a
# state saved in one layout, loaded in another and saved again gives bitwise the same checkpoint.


def read_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint, whole, read in this (non-distributed) process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    out = {
        k: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in md.items()
        if isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP says it loads in one process: it is meant to
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        reader = dcp.FileSystemReader(path)
        if "no_dist" in inspect.signature(dcp.load).parameters:
            dcp.load(out, storage_reader=reader, no_dist=True)
        else:  # torch 2.4: only its private loader reads without a process group
            dcp.state_dict_loader._load_state_dict(out, storage_reader=reader, no_dist=True)
    return out


def assert_same_checkpoints(a: str, b: str) -> None:
    first, second = read_checkpoint(a), read_checkpoint(b)
    assert sorted(first) == sorted(second)
    assert any(k.endswith("exp_avg") for k in first)
    for key, value in first.items():
        assert torch.equal(value, second[key]), key


def tensor_parallel_state(dp: int, steps: int, strategy: str) -> tuple[Any, list[str], Any]:
    """A (dp, tp=2) sharded AdamW state after ``steps`` steps, its names and the dp mesh."""
    mesh, model = tensor_parallel_mlp(dp)
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    plan = plan_partition(params, dp, strategy=strategy, bucket_numel=100)
    sharded = shard(
        adamw(1e-2), plan, process_group=mesh["dp"], stage=2 if strategy == "flat" else 1
    )
    state = sharded.init(params)
    register_grad_hooks(params, state)
    for step in range(steps):
        x, y = mlp_batch(step, mesh.get_local_rank("dp"))
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return state, names, mesh["dp"]


def save_tensor_parallel(rank: int, world: int, path: str, strategy: str) -> None:
    state, names, group = tensor_parallel_state(world // 2, 3, strategy)
    save_checkpoint(state, path, names=names, process_group=group)


def load_and_save_tensor_parallel(
    rank: int, world: int, source: str, path: str, strategy: str
) -> None:
    state, names, group = tensor_parallel_state(world // 2, 0, strategy)
    load_checkpoint(state, source, names=names, process_group=group)
    save_checkpoint(state, path, names=names, process_group=group)


@pytest.mark.parametrize("strategy", ["flat", "greedy"])  # stage 2 flat, stage 1 greedy
def test_a_tensor_parallel_checkpoint_of_dp2_tp2_loads_bitwise_at_dp1_tp2(
    run_world, tmp_path, strategy
):
    saved, again = str(tmp_path / "dp2"), str(tmp_path / "dp1")
    run_world(save_tensor_parallel, 4, saved, strategy)
    run_world(load_and_save_tensor_parallel, 2, saved, again, strategy)
    assert_same_checkpoints(saved, again)
    entries = read_checkpoint(saved)
    assert entries["optim.state.0.weight.exp_avg"].shape == (16, 6)  # the full tensor
    assert entries["optim.state.2.weight.exp_avg"].shape == (12, 16)


def hybrid_round_trip(rank: int, world: int, base: str) -> None:
    """Hybrid 2x2 trains and saves; a 1-D 4 loads it and saves; a hybrid 2x2 loads that."""
    model = small_mlp()
    params = list(model.parameters())
    layouts = {"hybrid": (make_mesh("2d", world), 2), "1d": (make_mesh("1d", world), world)}

    def fresh(kind: str) -> Any:
        mesh, shards = layouts[kind]
        return shard(
            adamw(1e-2), plan_partition(params, shards, bucket_numel=100), process_group=mesh
        )

    sharded = fresh("hybrid")
    state = sharded.init(params)
    for step in range(3):
        x, y = mlp_batch(step, rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    save_checkpoint(state, f"{base}/a", process_group=layouts["hybrid"][0])
    for kind, source, target in (("1d", "a", "b"), ("hybrid", "b", "c")):
        state = fresh(kind).init(params)
        load_checkpoint(state, f"{base}/{source}", process_group=layouts[kind][0])
        save_checkpoint(state, f"{base}/{target}", process_group=layouts[kind][0])


def test_a_hybrid_checkpoint_loads_bitwise_as_1d_and_back(run_world, tmp_path):
    run_world(hybrid_round_trip, 4, str(tmp_path))
    assert_same_checkpoints(str(tmp_path / "a"), str(tmp_path / "b"))
    assert_same_checkpoints(str(tmp_path / "a"), str(tmp_path / "c"))


def partial_mesh(rank: int, world: int, path: str) -> str:
    """A (dp=1, tp=2) state on ranks 0 and 1 of 4: save_checkpoint's error there."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = DeviceMesh("cpu", [0, 1])  # made by every rank, used by ranks 0 and 1
    alone, _ = dist.new_subgroups(1)  # every rank its own data-parallel group
    if rank > 1:
        return "not in the mesh"
    model = small_mlp()
    parallelize_module(model, tp, {"0": ColwiseParallel()})
    params = list(model.parameters())
    state = shard(adamw(), plan_partition(params, 1), process_group=alone).init(params)
    try:
        save_checkpoint(state, path, process_group=alone)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_tensor_parallel_state_not_spanning_the_world_is_refused_by_its_ranks(
    run_world, tmp_path
):
    messages = run_world(partial_mesh, 4, str(tmp_path / "ckpt"))
    assert messages[2:] == ["not in the mesh"] * 2
    for message in messages[:2]:
        assert message.startswith("save_checkpoint: expected a tensor-parallel or hybrid state")
        assert "got 2 ranks" in message
    assert not (tmp_path / "ckpt").exists()


def muon_on_tensor_parallel(rank: int, world: int) -> str:
    from shardopt.core import muon, newton_schulz_flops, partition

    mesh, model = tensor_parallel_mlp()
    params = list(model.parameters())
    tx = partition(
        {"muon": muon(), "adamw": adamw()},
        lambda ps: ["muon" if p.dim() == 2 else "adamw" for p in ps],
    )
    cost = lambda t: newton_schulz_flops(t.shape)  # noqa: E731
    plan = plan_partition(params, 2, strategy="greedy", cost=cost)
    try:
        shard(tx, plan, process_group=mesh["dp"]).init(params)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_muon_on_matrices_split_by_tensor_parallelism_is_refused_on_every_rank(run_world):
    """Newton-Schulz of a local shard is not a shard of the matrix's: refused, not diverged."""
    for message in run_world(muon_on_tensor_parallel, 4):
        assert message.startswith(
            "shard: expected every tensor updated by a transformation that needs it whole to be "
            "whole on its rank, got tensors [0, 2] split by tensor parallelism"
        )
