"""Consolidating the state entries of any torch.optim class: through consolidation's gathers."""

from __future__ import annotations

import pickle
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from shardopt.functional.engine._collectives import ProcessGroup, all_gather_rows, comm_device
from shardopt.functional.engine._rooted import gather_to

__all__ = ["gather_entries", "pack_tensors", "to_cpu", "unpack_tensor"]

# [Note: entries by gathers]
# A local optimizer of any torch.optim class (the greedy drop-in's) holds, per parameter it
# owns, an entry of named values: tensors of any shape and dtype, and plain values (a step count,
# a flag). ``gather_entries`` brings every rank's entries to rank ``to`` through the transport of
# [Note: consolidation by gathers], so that the greedy and the flat partitions consolidate alike:
# - the structure (entry keys, each tensor's dtype, shape and byte offset, the plain values) is
#   small: pickled to bytes, it travels in one gather; no tensor is pickled;
# - every rank packs its tensors' bytes end to end into one byte buffer, each tensor at a 16-byte
#   aligned offset; one all-gather of two sizes per rank tells every rank every size, and the
#   largest buffer is the common size of the windowed gathers (8 W of them, each padded where a
#   rank's buffer is shorter);
# - rank ``to`` allocates one buffer of each other rank's exact size, and each window's gather
#   writes every rank's row straight into its place there (a row past the end of a shorter
#   buffer lands in a scratch of one window, then its valid part is copied): no staging, no copy
#   of the result. The entries are views of those buffers, as the point-to-point receives of
#   before gave: so ``torch.save`` of one entry alone writes its rank's whole buffer. Rank
#   ``to``'s own entries are copied to the CPU: the result is a snapshot.
# Peak on rank ``to``: the result plus one window per rank (gloo's gather keeps a hidden copy of
# its output: 1/8 of the largest rank's buffer, against 1/2 for consolidation's 2 W windows,
# whose rows are copied on into entries of their own); on the others, their packed buffer.

ALIGN = 16  # bytes: every packed tensor starts at a multiple, so it can be viewed in its dtype

Spec = tuple[str, tuple[int, ...], int]  # a packed tensor's (dtype name, shape, byte offset)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _packable(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.layout == torch.strided and not value.is_nested


def pack_tensors(
    tensors: Sequence[torch.Tensor], device: torch.device | str
) -> tuple[torch.Tensor, list[Spec]]:
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
    return buf[offset : offset + numel * torch_dtype.itemsize].view(torch_dtype).view(shape)


def to_cpu(value: Any, *, copy: bool = False) -> Any:
    """``value`` with its tensors on the CPU, through lists, tuples and dicts: copies with
    ``copy`` (a snapshot), else the tensors themselves where they are there already.

    Example:
        >>> t = torch.ones(2)
        >>> to_cpu({"x": [t]})["x"][0] is t, to_cpu({"x": [t]}, copy=True)["x"][0] is t
        (True, False)
    """
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True) if copy else value.cpu()
    if isinstance(value, list):
        return [to_cpu(v, copy=copy) for v in value]
    if isinstance(value, tuple):
        items = [to_cpu(v, copy=copy) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, dict):
        return {k: to_cpu(v, copy=copy) for k, v in value.items()}
    return value


def _structure(
    entries: Mapping[int, Mapping[str, Any]],
) -> tuple[list[torch.Tensor], list[tuple[int, list[tuple[str, int | None, Any]]]]]:
    """The tensors of ``entries`` in order, and per entry (index, [(key, tensor position or None,
    plain value or None)])."""
    tensors: list[torch.Tensor] = []
    param_buffers = []
    for index, entry in entries.items():
        items: list[tuple[str, int | None, Any]] = []
        for key, value in entry.items():
            if _packable(value):
                items.append((key, len(tensors), None))
                tensors.append(value.detach())
            else:
                items.append((key, None, value))
        param_buffers.append((index, items))
    return tensors, param_buffers


def _windows_into(
    buf: torch.Tensor,
    size: int,
    into: Sequence[torch.Tensor] | None,
    to: int,
    group: ProcessGroup,
    count: int | None = None,
) -> None:
    """Gathers every rank's ``buf`` (at most ``size`` bytes; padded) into ``into[r]`` on rank
    ``to`` (exactly rank r's bytes; None elsewhere), in ``count`` windows (8 W by default), each
    gathered straight into its place (see [Note: entries by gathers]). Collective."""
    world = dist.get_world_size(group)
    chunk = max(1, -(-size // (count or 8 * world)))
    pad = buf.new_empty(min(chunk, size))  # the target's own input and output, or a tail's
    for lo in range(0, size, chunk):
        n = min(chunk, size - lo)
        send = buf[lo : lo + n] if lo + n <= buf.numel() else _padded(buf, lo, n, pad)
        rows, tails = None, []
        if into is not None:
            rows = []
            for r, out in enumerate(into):
                if r == to:
                    rows.append(send)  # its own row: gathered onto itself
                elif lo + n <= out.numel():
                    rows.append(out[lo : lo + n])
                else:  # past the end of r's bytes: received into a scratch, the rest copied
                    rows.append(buf.new_empty(n))
                    tails.append((out[lo:], rows[-1]))
        gather_to(send, rows, to, group=group)
        for out, row in tails:
            out.copy_(row[: out.numel()])


def _padded(buf: torch.Tensor, lo: int, n: int, pad: torch.Tensor) -> torch.Tensor:
    """``buf[lo : lo + n]`` padded to ``n`` bytes, in ``pad``."""
    part = buf[lo : lo + n]
    out = pad[:n]
    out[: part.numel()].copy_(part)
    return out


def _unpacked(meta: Any, buf: torch.Tensor) -> dict[int, dict[str, Any]]:
    """One rank's entries from its metadata, the tensors as views of its received ``buf``."""
    param_buffers, specs = meta
    return {
        index: {
            key: value if pos is None else unpack_tensor(buf, *specs[pos])
            for key, pos, value in items
        }
        for index, items in param_buffers
    }


def gather_entries(
    entries: Mapping[int, Mapping[str, Any]], *, to: int, group: ProcessGroup = None
) -> dict[int, dict[str, Any]] | None:
    """Every rank's ``entries`` (index -> {key: tensor or plain value}) merged on group rank
    ``to``, on the CPU; None on the other ranks. Collective; see [Note: entries by gathers].

    Example:
        >>> import os, tempfile, torch.distributed as dist
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> gather_entries({3: {"step": 1, "exp_avg": torch.ones(2)}}, to=0)
        {3: {'step': 1, 'exp_avg': tensor([1., 1.])}}
        >>> dist.destroy_process_group()
    """
    rank, device = dist.get_rank(group), comm_device(group)
    # The target copies its own entries while the others pack theirs.
    mine = {i: to_cpu(dict(entry), copy=True) for i, entry in entries.items()} if rank == to else {}
    tensors, param_buffers = _structure(entries) if rank != to else ([], [])
    buf, specs = pack_tensors(tensors, device)
    meta = pickle.dumps((param_buffers, specs)) if rank != to else b""
    meta_buf = torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device) if meta else buf[:0]
    sizes = torch.tensor([meta_buf.numel(), buf.numel()], dtype=torch.int64, device=device)
    sizes = all_gather_rows(sizes, group=group).cpu()  # every rank's (metadata, data) bytes
    metas = into = None
    if rank == to:
        metas = [buf.new_empty(int(n)) for n in sizes[:, 0]]
        into = [buf.new_empty(int(n)) for n in sizes[:, 1]]
    _windows_into(meta_buf, int(sizes[:, 0].max()), metas, to, group, count=1)
    _windows_into(buf, int(sizes[:, 1].max()), into, to, group)
    if metas is None or into is None:
        return None
    out = mine
    for r, (m, received) in enumerate(zip(metas, into)):
        if r != to:
            out.update(_unpacked(pickle.loads(m.cpu().numpy().tobytes()), received.cpu()))
    return out
