"""Consolidation's gathers: every rank's state of each parameter brought whole to one rank."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from shardopt.core import Piece, Plan
from shardopt.functional.checkpoint._checkpoint_keys import (
    FieldKeys,
    ListField,
    has_state,
    piece_slots,
    piece_value,
)
from shardopt.functional.engine._collectives import ProcessGroup, all_reduce_op, comm_device
from shardopt.functional.engine._rooted import gather_to
from shardopt.functional.engine._state import FieldGranularity, ShardedState

__all__ = [
    "empty_entries",
    "gather_elementwise",
    "gather_scalars",
    "gather_shaped",
    "merge_codes",
    "shaped_dtypes",
    "tensor_locations",
]

# [Note: consolidation by gathers]
# Rank ``to`` must end up holding the S bytes of the result; the aim is to hold little besides. It
# allocates every entry first (each tensor contiguous, with a storage of its own), then fills the
# ELEMENTWISE ones one field of one plan group at a time. Rank r's field buffer of a group is its
# compact shard (``shard_numels[r]`` elements, [Note: buffer storage]), and ``Plan.pieces(r)`` says
# which entry each of its elements belongs to (padding belongs to none). Shards travel in windows of
# 1 / (2 W) of the group's largest shard: each of 2 W gathers brings one window of every rank's
# shard into a staging buffer of W windows (half a shard), whose rows are copied into the entries. A
# gather needs equal sizes on every rank, and greedy shards are unequal, so each rank pads its shard
# with zeros to the largest (``max(shard_numels)``, never more), copying only the one window that
# runs past its end; the padding of a row belongs to no piece and is never read. Why windows: gloo's
# gather stages its whole result in a hidden buffer before copying it into the outputs (measured:
# the peak is twice the output), so one gather per field would hold the whole field twice besides S;
# with windows, staging and gloo's copy of it hold one shard (<= S / W; gloo frees its copy on its
# own thread, at times a window late): the peak is S plus one field shard (NCCL's gather writes into
# the outputs: S plus half a shard). The cost, 2 W gathers per field and plan group instead of one,
# is small next to the bytes at the world sizes gloo runs (measured at W = 2 and 4: faster than
# point-to-point sends to ``to`` one rank at a time). Why not views into a gathered buffer: pickle
# (``broadcast_object_list``) and ``torch.save`` of one entry would write the view's whole storage.
# PER_PIECE values (counts, NAdam's mu_product) travel first, as one (fields x tensors) float64
# matrix per rank, each rank filling the columns of the tensors whose first element it owns (float64
# holds float32 counts exactly); rank ``to`` reads column t from that owner, and the counts decide
# which parameters get an entry. The gathers run on the CPU under gloo (it has no CUDA gather) and
# on the CUDA device under NCCL ([Note: collective algorithms]); nothing is pickled. Shaped states
# (Adafactor's row_var, col_var, variance: [Note: shaped state]) travel last, per state and dtype,
# each rank's tensors end to end through the same windows; one small all-reduce of their dtype
# codes first tells every rank every size. The fields of a sharded partition's labels (lists per
# label, [Note: labels of a sharded partition]) travel alike, per field and plan group, each
# rank's values end to end; the plan and the recorded labels give every size. Every check
# runs before the first gather, on every rank alike, so a bad argument raises everywhere.


def tensor_locations(plan: Plan) -> list[tuple[int, int]]:
    """(plan group, offset in its flat buffer) of every plan tensor."""
    where = [(0, 0)] * len(plan.tensors)
    for g, grp in enumerate(plan.groups):
        for t, offset in zip(grp.tensors, grp.offsets):
            where[t] = (g, offset)
    return where


def gather_rows(rows: torch.Tensor, to: int, group: ProcessGroup) -> torch.Tensor | None:
    """``rows`` of every rank, stacked on rank ``to`` (None elsewhere): one gather."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    send = rows.to(comm_device(group)).contiguous()
    if world == 1:
        return send.unsqueeze(0)
    out = send.new_empty((world, *send.shape)) if rank == to else None
    gather_to(send, None if out is None else list(out.unbind(0)), to, group=group)
    return out


def windows(
    buf: torch.Tensor, numel: int, to: int, group: ProcessGroup
) -> Iterator[tuple[int, int, torch.Tensor]]:
    """On rank ``to``: (rank r, offset lo, elements ``[lo, lo + len)`` of r's ``buf`` padded with
    zeros to ``numel``, the largest ``buf`` of any rank), covering every rank's ``buf``, each
    valid until the next is asked for; elsewhere nothing. Collective (2 W gathers of equal
    sizes, see [Note: consolidation by gathers]): every rank must exhaust it."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    flat = buf.to(comm_device(group)).reshape(-1)
    if world == 1:
        yield 0, 0, flat
        return
    chunk = max(1, -(-numel // (2 * world)))
    staging = flat.new_empty(world * chunk) if rank == to else None
    for lo in range(0, numel, chunk):
        n = min(chunk, numel - lo)
        send = flat[lo : lo + n]
        if send.numel() < n:  # past the end of this rank's shard: pad (one window at most)
            send = torch.cat([send, flat.new_zeros(n - send.numel())])
        rows = None if staging is None else staging[: world * n].view(world, -1)
        gather_to(send, None if rows is None else list(rows.unbind(0)), to, group=group)
        for r, row in enumerate(rows if rows is not None else ()):
            yield r, lo, row


def empty_entries(
    state: ShardedState,
    keys: FieldKeys,
    scalars: Mapping[str, torch.Tensor],
    codes: torch.Tensor,
    device: torch.device,
) -> dict[int, dict[str, torch.Tensor]]:
    """Rank ``to``'s entry of every plan tensor that has one: PER_PIECE values set, ELEMENTWISE
    and shaped tensors allocated on ``device`` (for the gathers to fill)."""
    plan = state.param_buffers.plan
    where = tensor_locations(plan)
    out: dict[int, dict[str, torch.Tensor]] = {}
    for t, spec in enumerate(plan.tensors):
        count = scalars[keys.count.path][t] if keys.count is not None else None
        if spec.numel == 0 or not keys.covers(t) or not has_state(keys, count):
            continue
        g = where[t][0]
        entry = {}
        for field, key, in_torch in keys.entries:
            if not in_torch:
                continue
            dtype = field.dtypes[g] if isinstance(field, ListField) else field.buffers[g].dtype
            if field.granularity is FieldGranularity.PER_PIECE:
                entry[key] = scalars[field.path][t].to(dtype, copy=True)
            else:
                entry[key] = torch.empty(spec.shape, dtype=dtype, device=device)
        shapes = keys.shapes(spec.shape, torch.float32)
        for i, shaped in enumerate(keys.shaped):
            if codes[i, t] >= 0:
                dtype = _DTYPES[int(codes[i, t])]
                entry[shaped.key] = torch.empty(shapes[shaped.key], dtype=dtype, device=device)
        out[t] = entry
    return out


# The dtypes a shaped state may have, coded by index for the all-reduce of [Note: shaped state].
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def shaped_dtypes(api: str, keys: FieldKeys, state: ShardedState) -> torch.Tensor:
    """(shaped states x plan tensors): the dtype code of each tensor's shaped state on this rank,
    -1 where it has none here; checks each against its expected shape (local)."""
    plan = state.param_buffers.plan
    codes = torch.full((len(keys.shaped), len(plan.tensors)), -1, dtype=torch.int64)
    for k, piece in enumerate(state.param_buffers.pieces):
        spec = plan.tensors[piece.tensor]
        shapes = keys.shapes(spec.shape, torch.float32) if keys.shaped else {}
        for i, shaped in enumerate(keys.shaped):
            t = shaped.tensors[k]
            if t is None:
                continue
            if t.dtype not in _DTYPES or tuple(t.shape) != shapes.get(shaped.key):
                raise ValueError(
                    f"{api}: expected {shaped.key} of parameter {piece.tensor} to be a floating "
                    f"tensor of shape {shapes.get(shaped.key)}, got {t.dtype} {tuple(t.shape)}"
                )
            codes[i, piece.tensor] = _DTYPES.index(t.dtype)
    return codes


def merge_codes(local: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """Every rank's codes of :func:`shaped_dtypes` merged (each tensor has one owner)."""
    merged = local.to(comm_device(group))
    all_reduce_op(merged, dist.ReduceOp.MAX, group=group)
    return merged.cpu()


def gather_shaped(
    state: ShardedState,
    keys: FieldKeys,
    codes: torch.Tensor,
    entries: Mapping[int, Mapping[str, torch.Tensor]] | None,
    to: int,
    group: ProcessGroup,
) -> None:
    """Fills the shaped tensors of ``entries`` (rank ``to``'s; None elsewhere) from their owners:
    per shaped state and dtype, each rank's tensors end to end, by the windowed gathers of
    [Note: consolidation by gathers] (their sizes known everywhere from ``codes``)."""
    plan = state.param_buffers.plan
    owned = [plan.pieces(r) for r in range(plan.world_size)]
    shapes = [keys.shapes(spec.shape, torch.float32) for spec in plan.tensors]
    targets = entries if entries is not None else {}
    for i, shaped in enumerate(keys.shaped):
        numels = [math.prod(s.get(shaped.key, ())) for s in shapes]
        for c, dtype in enumerate(_DTYPES):
            runs = [_end_to_end([p for p in ps if codes[i, p.tensor] == c], numels) for ps in owned]
            size = max(sum(p.numel for p in run) for run in runs)
            if size == 0:
                continue
            local = [
                t.reshape(-1)
                for t, p in zip(shaped.tensors, state.param_buffers.pieces)
                if t is not None and codes[i, p.tensor] == c
            ]
            buf = torch.cat(local) if local else torch.empty(0, dtype=dtype)
            copy_pieces(windows(buf, size, to, group), runs, shaped.key, targets)


def _end_to_end(pieces: Sequence[Piece], numels: Sequence[int]) -> list[Piece]:
    """Pieces placing the whole tensors of ``pieces`` (``numels[t]`` elements each) end to end."""
    out, offset = [], 0
    for p in pieces:
        if numels[p.tensor]:
            out.append(Piece(p.tensor, 0, numels[p.tensor], p.group, offset))
        offset += numels[p.tensor]
    return out


def gather_elementwise(
    state: ShardedState,
    keys: FieldKeys,
    entries: Mapping[int, Mapping[str, torch.Tensor]] | None,
    to: int,
    group: ProcessGroup,
) -> None:
    """Fills the ELEMENTWISE tensors of ``entries`` (rank ``to``'s; None elsewhere) from every
    rank's field shards, one field of one plan group at a time."""
    plan = state.param_buffers.plan
    fields = [
        (f, key)
        for f, key, t in keys.entries
        if t and f.granularity is FieldGranularity.ELEMENTWISE
    ]
    targets = entries if entries is not None else {}
    listed = any(isinstance(f, ListField) for f, _ in fields)  # their sizes: every rank's
    needed = entries is not None or listed
    owned = [plan.pieces(r) for r in range(plan.world_size)] if needed else []
    for g in range(len(plan.groups)):
        pieces = [[p for p in mine if p.group == g] for mine in owned]
        for f, key in fields:
            if isinstance(f, ListField):
                _gather_listed(state, keys, f, key, g, pieces, targets, to, group)
            else:
                numel = max(plan.groups[g].shard_numels)
                copy_pieces(windows(f.buffers[g], numel, to, group), pieces, key, targets)


def _gather_listed(
    state: ShardedState,
    keys: FieldKeys,
    field: ListField,
    key: str,
    g: int,
    pieces: Sequence[Sequence[Piece]],
    targets: Mapping[int, Mapping[str, torch.Tensor]],
    to: int,
    group: ProcessGroup,
) -> None:
    """A label's list field of group ``g``: each rank's values end to end, through the same
    windows ([Note: labels of a sharded partition]); ``pieces[r]``: rank r's pieces of ``g``."""
    runs = [_end_to_end_runs([p for p in ps if keys.covers(p.tensor)]) for ps in pieces]
    numel = max(sum(p.numel for p in run) for run in runs)
    local = [
        v.reshape(-1)
        for v, p in zip(field.tensors, state.param_buffers.pieces)
        if v is not None and p.group == g
    ]
    buf = torch.cat(local) if local else torch.empty(0, dtype=field.dtypes[g])
    if numel:
        copy_pieces(windows(buf, numel, to, group), runs, key, targets)


def _end_to_end_runs(pieces: Sequence[Piece]) -> list[Piece]:
    """``pieces`` with offsets placing them end to end (a label's list values concatenated)."""
    out, offset = [], 0
    for p in pieces:
        out.append(Piece(p.tensor, p.start, p.stop, p.group, offset))
        offset += p.numel
    return out


def copy_pieces(
    windows: Iterator[tuple[int, int, torch.Tensor]],
    pieces: Sequence[Sequence[Piece]],
    key: str,
    targets: Mapping[int, Mapping[str, torch.Tensor]],
) -> None:
    """Copies what each (rank r, offset lo, window of r's shard) holds of ``pieces[r]`` into
    ``targets[t][key]`` (a function of its own: the last window is freed when it returns)."""
    for r, lo, window in windows:
        hi = lo + window.numel()
        for p in pieces[r]:
            entry = targets.get(p.tensor)
            a, b = max(p.offset, lo), min(p.offset + p.stop - p.start, hi)
            if entry is not None and a < b:
                dst = entry[key].view(-1)
                dst[p.start + a - p.offset : p.start + b - p.offset].copy_(window[a - lo : b - lo])


def gather_scalars(
    state: ShardedState, keys: FieldKeys, to: int, group: ProcessGroup
) -> dict[str, torch.Tensor]:
    """On ``to``: each PER_PIECE field's value per plan tensor, from the rank owning its start."""
    param_buffers, plan = state.param_buffers, state.param_buffers.plan
    fields = [f for f, _, _ in keys.entries if f.granularity is FieldGranularity.PER_PIECE]
    if not fields:
        return {}
    rows = torch.zeros(len(fields), len(plan.tensors), dtype=torch.float64)
    slots = piece_slots(param_buffers)
    for k, piece in enumerate(param_buffers.pieces):
        if piece.start == 0 and keys.covers(piece.tensor):
            for i, f in enumerate(fields):
                rows[i, piece.tensor] = piece_value(f, param_buffers, k, slots).item()
    gathered = gather_rows(rows, to, group)
    if gathered is None:
        return {}
    gathered = gathered.cpu()
    owners = [plan.tensor_pieces(t)[0][0] if s.numel else 0 for t, s in enumerate(plan.tensors)]
    picked = gathered[torch.tensor(owners), :, torch.arange(len(plan.tensors))]  # (tensors, F)
    return {f.path: picked[:, i] for i, f in enumerate(fields)}
