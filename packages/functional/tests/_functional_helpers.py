"""Helpers shared by the functional tests: seeded parameters, exact gradients, comparisons."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

Shapes = Sequence[tuple[tuple[int, ...], torch.dtype]]

# A small mixed-dtype model whose shapes make flat plans cut tensors across ranks at W = 2, 3, 4
# (the test modules give tensors 3 and 4 their roles: frozen, gradient only at some steps).
# The names count_collectives records for the single-tensor collectives: torch 2.13 calls them
# all_gather_single / reduce_scatter_single, older releases all_gather_into_tensor /
# reduce_scatter_tensor.
GATHER = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
SCATTER = (
    "reduce_scatter_single" if hasattr(dist, "reduce_scatter_single") else "reduce_scatter_tensor"
)


MIXED_SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((7, 5), torch.float32),
    ((5,), torch.float32),
    ((3, 4, 2), torch.float64),
    ((4,), torch.float32),
    ((13,), torch.float32),
    ((1,), torch.float64),
    ((6, 6), torch.float32),
]


def seeded_params(shapes: Shapes) -> list[torch.Tensor]:
    """One tensor per ``(shape, dtype)``: float64 normal draws of seed 0, cast to the dtype."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(d) for s, d in shapes]


def sixty_fourths(
    shapes: Shapes, seed: int, skip: Callable[[int], bool]
) -> list[torch.Tensor | None]:
    """Gradients of ``seed``, multiples of 1/64 in [-1, 1] (so sums over ranks are exact); None
    for the indices ``skip`` names."""
    gen = torch.Generator().manual_seed(seed)
    out: list[torch.Tensor | None] = []
    for i, (shape, dtype) in enumerate(shapes):
        g = torch.randint(-64, 65, shape, generator=gen).to(dtype) / 64
        out.append(None if skip(i) else g)
    return out


def rank_average(
    local_grads: Callable[[int], list[torch.Tensor | None]], world: int
) -> list[torch.Tensor | None]:
    """The rank average of ``local_grads(rank)``, as the reduce-scatter computes it (sum, / W)."""
    per_rank = [local_grads(r) for r in range(world)]
    out: list[torch.Tensor | None] = []
    for i in range(len(per_rank[0])):
        gs = [g[i] for g in per_rank]
        out.append(None if gs[0] is None else torch.stack(gs).sum(0).div_(world))  # type: ignore[misc]
    return out


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| (in float64; a zero ``ref`` is judged on 1e-30)."""
    scale = max(ref.abs().max().item(), 1e-30)
    return (ours.double() - ref.double()).abs().max().item() / scale


def state_equal(a: dict[str, Any] | None, b: dict[str, Any] | None) -> bool:
    """Bitwise equality of two torch.optim state dicts (keys, dtypes, shapes, values), in the
    sense of dict equality: the order of keys does not matter."""
    assert a is not None
    assert b is not None
    if a["param_groups"] != b["param_groups"] or set(a["state"]) != set(b["state"]):
        return False
    for k, entry in a["state"].items():
        other = b["state"][k]
        if set(entry) != set(other):
            return False
        for key, x in entry.items():
            y = other[key]
            if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x.cpu(), y.cpu()):
                return False
    return True


def small_mlp() -> torch.nn.Module:
    """A seeded 6-16-12-3 tanh MLP (the mesh tests' model)."""
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 3)
    )


def mlp_batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch of 4 at ``step`` for :func:`small_mlp`."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def full_batch_adamw(world: int, steps: int) -> list[torch.Tensor]:
    """:func:`small_mlp` after ``steps`` of torch.optim.AdamW(lr=1e-2) on every rank's batch at
    once, in one process: what data-parallel training over ``world`` ranks must match."""
    model = small_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        xs, ys = zip(*(mlp_batch(step, r) for r in range(world)))
        torch.nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def tensor_parallel_mlp(dp: int = 2) -> tuple[Any, torch.nn.Module]:
    """A (dp, tp=2) mesh and :func:`small_mlp` with its first two linears tensor-parallel over
    "tp" (column-, then row-wise): four DTensor parameters."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp", "tp"))
    model = small_mlp()
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return mesh, model


def dtensor_type() -> type:
    """DTensor's class: public in torch.distributed.tensor from torch 2.5 on, private before."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor
    return DTensor


def full_tensors(params: Any) -> list[torch.Tensor]:
    """Each parameter whole: a DTensor's full tensor, any other detached."""
    DTensor = dtensor_type()
    return [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in params]


class CountingBackend:
    """A dynamo backend that counts the graphs it is given and runs them as traced (no C++
    compiler needed)."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        del example_inputs
        self.graphs += 1
        return gm.forward
