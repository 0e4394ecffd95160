"""Moving optimizer state to one rank: a small object gather, then flat tensors point to point."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.functional.engine import ProcessGroup, gather_object_to

__all__ = [
    "gather_objects",
    "on_device",
    "pack_tensors",
    "snapshot",
    "to_cpu",
    "unpack_tensor",
    "wait_all",
]

# [Note: consolidation without pickled tensors]
# torch's consolidate_state_dict pickles every rank's local state_dict and broadcasts the bytes
# from each rank to all ranks in turn: every byte is serialised, copied into a byte tensor, sent
# to W - 1 ranks (that all deserialise it) and deserialised into new tensors on the target, which
# then holds the pickled copy and the tensors at once. Here only the small metadata is pickled
# (one ``gather_object``: names, shapes, dtypes, offsets and non-tensor values such as step
# counts of some optimizers); the tensors travel as flat buffers, point to point to the target
# rank only, and the consolidated state's tensors are views of the received buffers: no
# serialisation, no copy on the target beyond receiving, nothing sent to the other ranks. The
# target's own entries are copies: the consolidated state is a snapshot of the moment, on CUDA
# and CPU alike (torch's, on CPU, shares its tensors with the live state, so that later steps,
# or an optimizer that loads the dict, change it).

ALIGN = 16  # bytes: every packed tensor starts at a multiple, so it can be viewed in its dtype


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """Makes ``device`` the current CUDA device (torch's object collectives use that one)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            yield
    else:
        yield


def gather_objects(obj: Any, *, to: int, group: ProcessGroup, device: torch.device) -> list | None:
    """Every rank's picklable ``obj``, in rank order, on group rank ``to``; None elsewhere."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    out: list[Any] | None = [None] * world if rank == to else None
    with on_device(device):
        gather_object_to(obj, out, to, group=group)
    return out


def wait_all(works: Sequence[Any]) -> None:
    """Waits for every work handle."""
    for work in works:
        work.wait()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_tensors(
    tensors: Sequence[torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, list[tuple[str, tuple[int, ...], int]]]:
    """One uint8 buffer holding ``tensors``' bytes, and each one's (dtype, shape, byte offset).

    Example:
        >>> buf, specs = pack_tensors([torch.ones(2), torch.tensor(3, dtype=torch.int64)], "cpu")
        >>> specs, unpack_tensor(buf, *specs[1])
        ([('float32', (2,), 0), ('int64', (), 16)], tensor(3))
    """
    specs, offset = [], 0
    for t in tensors:
        specs.append((str(t.dtype).removeprefix("torch."), tuple(t.shape), offset))
        offset += -(-_nbytes(t) // ALIGN) * ALIGN
    buf = torch.empty(offset, dtype=torch.uint8, device=device)
    with torch.no_grad():
        for t, (_, _, start) in zip(tensors, specs):
            if t.numel():
                buf[start : start + _nbytes(t)].view(t.dtype).copy_(t.reshape(-1))
    return buf, specs


def unpack_tensor(
    buf: torch.Tensor, dtype: str, shape: tuple[int, ...], offset: int
) -> torch.Tensor:
    """The tensor that :func:`pack_tensors` put at ``offset``, as a view of ``buf``."""
    torch_dtype = getattr(torch, dtype)
    numel = 1
    for n in shape:
        numel *= n
    nbytes = numel * torch_dtype.itemsize
    return buf[offset : offset + nbytes].view(torch_dtype).view(shape)


def snapshot(value: Any) -> Any:
    """A copy of ``value`` with its tensors copied to the CPU, through lists, tuples and dicts.

    Example:
        >>> t = torch.ones(2)
        >>> snapshot({"x": [t]})["x"][0] is t
        False
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, list):
        return [snapshot(v) for v in value]
    if isinstance(value, tuple):
        items = [snapshot(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    return value


def to_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU (themselves where they are there already), through
    lists, tuples and dicts."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, list):
        return [to_cpu(v) for v in value]
    if isinstance(value, tuple):
        items = [to_cpu(v) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: to_cpu(v) for k, v in value.items()}
    return value
