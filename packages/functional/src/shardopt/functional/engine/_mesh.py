"""Device meshes as process groups (flat sharding over a 1-D mesh, hybrid over a 2-D one) and
tensor-parallel DTensor parameters."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from shardopt.core.blocks import PyTree, local_tensor, tree_leaves
from shardopt.functional.engine._clip import TensorParallel
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = [
    "HYBRID_DIMS",
    "GlobalPlace",
    "MeshGroups",
    "global_places",
    "is_split",
    "local_tensors",
    "mesh_groups",
    "tensor_parallel",
]

HYBRID_DIMS = ("replicate", "shard")

# [Note: hybrid sharding]
# Where ``shard`` (and the drop-in ZeroRedundancyOptimizer) take a process group they also take a
# DeviceMesh. A 1-D mesh is its group. A 2-D mesh named ("replicate", "shard") is R replicas of
# an S-rank sharded optimizer (HSDP's layout, Megatron's ``num_distributed_optimizer_instances``):
# everything the engine does runs in the "shard" group, as if the world were S ranks (the plan's
# world size is S; a rank holds 1/S of the state, gathers parameters from the S ranks of its
# group, on the fast links when a group is one node), and one collective is added: once a
# bucket's reduce-scatter has averaged its gradients over the S ranks, its shard (1/S of the
# bucket) is all-reduced over the R ranks of the "replicate" group and divided by R, so every
# replica steps with the average over all R * S ranks. The links between replicas carry 1/S of
# the gradient bytes and no parameters. Replicas hold equal states and take equal steps, so
# nothing else crosses them. What must agree is settled over the whole world in one small
# collective (every rank's fingerprint includes the mesh): a rank holding another mesh fails
# there, on every rank, instead of waiting in a group its peers never enter.


@dataclass(frozen=True, slots=True)
class MeshGroups:
    """The groups a process group or mesh stands for: where the state is sharded (``shard``),
    across which replicas gradients are averaged (``replicate``: None without replicas), where
    inputs are agreed (``agree``), and a description for fingerprints."""

    shard: ProcessGroup
    replicate: ProcessGroup | None
    agree: ProcessGroup
    description: str


def mesh_groups(api: str, group: Any) -> MeshGroups:
    """The groups of ``group`` (None, a process group or a DeviceMesh; see [Note: hybrid
    sharding]); raises ValueError naming ``api`` for a mesh of another shape.

    Example:
        >>> mesh_groups("shard", None)
        MeshGroups(shard=None, replicate=None, agree=None, description='')
    """
    if not isinstance(group, DeviceMesh):
        return MeshGroups(group, None, group, "")
    names = tuple(group.mesh_dim_names or ())
    description = f"mesh {tuple(group.shape)} {names} {group.mesh.flatten().tolist()}"
    world = dist.group.WORLD if group.size() == dist.get_world_size() else None
    if group.ndim == 1:
        shard = group.get_group()
        return MeshGroups(shard, None, shard if world is None else world, description)
    if group.ndim == 2 and names == HYBRID_DIMS:
        shard, replicate = group.get_group("shard"), group.get_group("replicate")
        agree = world if world is not None else shard
        return MeshGroups(shard, replicate, agree, description)
    raise ValueError(
        f"{api}: expected a process group, a 1-D DeviceMesh or a 2-D one with dims "
        f"{HYBRID_DIMS}, got a {group.ndim}-D mesh with dims {names}"
    )


# [Note: DTensor parameters]
# A DTensor parameter (tensor parallelism: ``parallelize_module`` over another mesh dim) is
# planned, sharded, reduced and updated by its local tensor (core's ``local_tensor``: the
# DTensor's own storage), over the data-parallel group given to ``shard``: init re-points that
# local tensor into the flat buffer, gradients are read as the local tensors of the DTensor
# gradients (the parameter keeps its ``.grad``; DTensor's autograd already made a replicated
# parameter's gradient equal on its tensor-parallel ranks), and the elementwise update of a local
# shard is the update of that part of the full tensor. The one thing that is not elementwise, the
# norm of ``max_norm`` and ``skip_nonfinite``, sums the squares of tensor-parallel parts over
# their group too ([Note: tensor-parallel norms]).


def is_split(p: Any) -> bool:
    """Whether ``p`` is a DTensor sharded over its mesh (tensor parallelism): its local tensor is
    a part of it."""
    mesh: Any = getattr(p, "device_mesh", None)
    return mesh is not None and any(pl.is_shard() for pl in p.placements)


def tensor_parallel(params: Sequence[Any], param_buffers: ParamBuffers) -> TensorParallel | None:
    """Which of this rank's pieces belong to DTensors sharded over a tensor-parallel group,
    and that group; None without any (see [Note: tensor-parallel norms])."""
    groups, flags = set(), []
    for p in params:
        cut = is_split(p)
        if cut:
            mesh: Any = p.device_mesh
            if mesh.ndim != 1:
                raise ValueError(
                    f"shard: expected DTensor parameters on 1-D meshes, got one on {mesh}"
                )
            groups.add(mesh.get_group())
        flags.append(cut)
    if len(groups) > 1:
        raise ValueError("shard: expected the DTensor parameters on one tensor-parallel mesh")
    if not groups:
        return None
    return TensorParallel(groups.pop(), tuple(flags[p.tensor] for p in param_buffers.pieces))


class GlobalPlace(NamedTuple):
    """Where a DTensor parameter's local tensor lies in the full tensor: the full ``shape`` and
    the local tensor's ``offsets`` (see [Note: tensor-parallel checkpoints])."""

    shape: torch.Size
    offsets: torch.Size


def global_places(params: Sequence[Any]) -> tuple[GlobalPlace | None, ...] | None:
    """Per parameter, its :class:`GlobalPlace` if it is a DTensor whose local tensor is not the
    whole tensor, else None; None if no parameter is such a DTensor."""
    out: list[GlobalPlace | None] = []
    for p in params:
        local = local_tensor(p)
        if local is p or local.shape == p.shape:
            out.append(None)
            continue
        out.append(GlobalPlace(torch.Size(p.shape), torch.Size(_local_offsets(p))))
    return tuple(out) if any(x is not None for x in out) else None


def _local_offsets(p: Any) -> Sequence[int]:
    """Where a DTensor's local tensor starts in the full tensor: DTensor's own answer, as DCP
    asks it (``__create_chunk_list__``, torch >= 2.5), or the helper DCP used before it."""
    if hasattr(p, "__create_chunk_list__"):
        (chunk,) = p.__create_chunk_list__()
        return tuple(chunk.offsets)
    from torch.distributed._tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    return tuple(offsets)


def local_tensors(tree: PyTree) -> list[Any]:
    """The leaves of ``tree``, a DTensor as its local tensor ([Note: DTensor parameters])."""
    leaves = tree if type(tree) is list else tree_leaves(tree)
    if _PLAIN_OR_NONE.issuperset(map(type, leaves)):  # no DTensor: nothing per leaf in Python
        return list(leaves)
    return [x if x is None else local_tensor(x) for x in leaves]


_PLAIN_OR_NONE = frozenset((torch.Tensor, torch.nn.Parameter, type(None)))
