"""Sharded state dicts: each rank's slices of the optimizer state plus the plan, saved per rank."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from shardopt.core import Plan
from shardopt.functional.checkpoint._checkpoint_keys import (
    field_keys,
    outside_tensors,
    piece_slots,
    piece_value,
)
from shardopt.functional.checkpoint._hyperparams import (
    checked_hyperparams,
    saved_hyperparams,
    write_hyperparams,
)
from shardopt.functional.checkpoint._incoming import (
    NONNEGATIVE_KEYS,
    EntrySpec,
    Expected,
    check_entries,
)
from shardopt.functional.engine._state import ShardedState, StateField
from shardopt.functional.engine._validate import agree_across_ranks

__all__ = ["SHARDED_FORMAT", "load_sharded_state_dict", "sharded_state_dict"]

SHARDED_FORMAT = "shardopt.sharded_state_dict/1"

# [Note: checkpoint formats]
# A sharded optimizer state can be written in three forms; pick by who reads it back:
#
# 1. Sharded state dict (``sharded_state_dict`` / ``load_sharded_state_dict``): every rank's own
#    flat buffers, as they are in memory (one tensor per field and plan group, the per-piece
#    counts, master weights, replicated leaves), plus the plan as plain data and the rank. No
#    communication, no copies: ``torch.save`` it to one file per rank. It reloads only into the
#    same plan at the same rank (checked, with a clear error otherwise). Use it for frequent,
#    cheap restarts of the same job. Works for any core transformation. Injected hyperparameters
#    are saved too ([Note: hyperparameters of a sharded state]).
# 2. torch.optim format (``consolidate_state_dict`` / ``load_torch_state_dict``): exactly what
#    ``torch.optim.<Class>(params).state_dict()`` returns, on one rank, built by one gather of
#    the flat field buffers per plan group and one of the per-piece values (no pickled objects
#    on the wire). It moves to and from plain torch.optim, single-process tools, other
#    frameworks; reloading it at any world size and plan is a local slice on every rank. Use it
#    to export, to inspect, or for small models: rank ``to`` holds the whole state. Only the ten
#    core optimizers' states have torch keys (see [Note: torch state keys]); master weights are
#    not part of it (torch.optim has none).
# 3. torch.distributed.checkpoint (``save_checkpoint`` / ``load_checkpoint``): a DCP directory in
#    torch's FQN key-value layout, ``optim.state.<param name>.<torch key>`` with full-shape
#    tensors, every rank writing only the boxes of its own pieces (see [Note: DCP pieces]);
#    DCP's ``dcp_to_torch_save`` turns it into a file torch.optim loads. SGD's count rides
#    along as "step" (torch.optim.SGD ignores it); other transformations' fields are keyed by
#    their paths, for every parameter. Master weights go under ``optim.master_weights``.
#    DCP reshards on load: any world size, any plan (flat or greedy), and the model's own state
#    dict can go in the same checkpoint (``extra``). Writes are atomic (a temporary directory
#    renamed into place, [Note: atomic checkpoints]). Use it for large models and restarts at
#    another world size. Injected hyperparameters go under ``optim.hyperparams``.
#
# All three hold the optimizer state only. Parameters come from the model's state dict (save it
# alongside: ``extra={"model": model.state_dict()}`` in form 3); load them before the optimizer
# state, so that master weights re-initialised from the parameters (form 2, or form 3 without
# them) see the loaded values. Checkpoints are taken between steps: stage 2's gradient shards
# and the last step's statistics are not state.


def sharded_state_dict(state: ShardedState) -> dict[str, Any]:
    """This rank's optimizer state as a plain dict: its flat buffers plus the plan.

    See [Note: checkpoint formats] (form 1). The tensors are the live buffers, not copies
    (but for masters kept as remainders, given as float32 copies: [Note: master remainders]):
    ``torch.save`` the dict (or clone it) before the next step.

    Returns:
        ``{"format", "plan": plan.to_dict(), "rank", "fields": {path: {"kind", "buffers"}},
        "master": [tensor or None per group], "replicated": {path: tensor}, "hyperparams":
        {key: value}}`` (``hyperparams``: those of ``inject_hyperparams``, see
        [Note: hyperparameters of a sharded state]).

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import adam, plan_partition
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> params = [torch.ones(3), torch.ones(2)]
        >>> sharded = shard(adam(0.1), plan_partition(params, 1))
        >>> state = sharded.step(params, [torch.ones(3), None], sharded.init(params))
        >>> sd = sharded_state_dict(state)
        >>> sorted(sd["fields"]), sd["fields"]["[0].count"]["buffers"][0]
        (['[0].count', '[0].mu', '[0].nu'], tensor([1., 0.]))
        >>> dist.destroy_process_group()
    """
    param_buffers = state.param_buffers
    param_buffers.wait_params()  # [Note: deferred parameter sync]
    return {
        "format": SHARDED_FORMAT,
        "plan": param_buffers.plan.to_dict(),
        "rank": param_buffers.rank,
        "fields": {
            f.path: {"kind": f.granularity.value, "buffers": list(f.buffers)} for f in state.fields
        },
        "master": list(state.master.fulls()),  # float32 ([Note: master remainders]: copies)
        "replicated": {path: t for path, t, _ in outside_tensors(state)},
        "hyperparams": saved_hyperparams(state),
    }


def load_sharded_state_dict(
    state: ShardedState, sd: Mapping[str, Any], *, allow_nonfinite: bool = False
) -> None:
    """Copies a :func:`sharded_state_dict` of the same plan and rank into ``state``, in place.

    Everything is checked before anything is written: the format, the plan (equal to
    ``state``'s), the rank, the field paths, kinds, sizes and dtypes, the master weights, the
    injected hyperparameters (set into the state's dict, see
    [Note: hyperparameters of a sharded state]), and each parameter's values ([Note: incoming
    state]: step counts and second moments >= 0, everything finite; ``allow_nonfinite=True``
    loads NaN and inf values, a diverged run reloaded on purpose). Every rank of the state's
    group calls it, each with its own dict: a refusal on one rank is raised on every rank
    ([Note: cross-rank validation]: one small all-gather), and nothing is written anywhere.

    Raises:
        ValueError: on any mismatch, e.g. ``load_sharded_state_dict: expected the state dict of
            rank 1, got rank 0``.

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import adam, plan_partition
        >>> from shardopt.functional import shard
        >>> path = os.path.join(tempfile.mkdtemp(), "store")
        >>> dist.init_process_group("gloo", store=dist.FileStore(path, 1), rank=0, world_size=1)
        >>> params = [torch.ones(3)]
        >>> sharded = shard(adam(0.1), plan_partition(params, 1))
        >>> state = sharded.step(params, [torch.ones(3)], sharded.init(params))
        >>> saved = {k: v for k, v in sharded_state_dict(state).items()}
        >>> saved["fields"] = {p: {**f, "buffers": [b.clone() for b in f["buffers"]]}
        ...                    for p, f in saved["fields"].items()}
        >>> fresh = sharded.init([torch.ones(3)])
        >>> load_sharded_state_dict(fresh, saved)
        >>> fresh.fields[0].buffers[0]
        tensor([1.])
        >>> dist.destroy_process_group()
    """
    api = "load_sharded_state_dict"
    fulls = state.master.fulls()  # float32 masters, filled by the pairs, then loaded
    failure: ValueError | None = None
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    writes: Any = None
    try:  # every check on every rank, then the agreement, then the writes
        pairs = _check_sharded(api, state, sd, fulls)
        refusal = check_entries(api, _piece_items(state, sd), allow_nonfinite=allow_nonfinite)
        if refusal is not None:
            raise ValueError(refusal)
        writes = checked_hyperparams(api, state, sd.get("hyperparams", {}), every=True)
    except ValueError as exc:
        failure = exc
    agree_across_ranks(api, failure, 0, state.param_buffers.group)
    with torch.no_grad():
        for dst, src in pairs:
            dst.copy_(src)
    state.master.load_all(fulls)
    write_hyperparams(writes)


def _piece_items(state: ShardedState, sd: Mapping[str, Any]) -> list[tuple[EntrySpec, Any]]:
    """Each piece's incoming values (form checked already) under their keys, with what the
    optimizer makes for them: one entry per piece of this rank ([Note: incoming state])."""
    param_buffers, plan = state.param_buffers, state.param_buffers.plan
    keys = field_keys(state, "load_sharded_state_dict")
    slots = piece_slots(param_buffers)
    incoming = [
        (StateField(f.path, f.granularity, tuple(sd["fields"][f.path]["buffers"])), key)
        for f, key, _ in keys.entries
        if isinstance(f, StateField)
    ]
    items = []
    for k, piece in enumerate(param_buffers.pieces):
        entry = {key: piece_value(f, param_buffers, k, slots) for f, key in incoming}
        made = {
            key: Expected(
                tuple(v.shape), v.dtype, count=key == "step", nonnegative=key in NONNEGATIVE_KEYS
            )
            for key, v in entry.items()
        }
        spec = plan.tensors[piece.tensor]
        shape = (piece.numel,)
        items.append(
            (EntrySpec(piece.tensor, spec.param_group, shape, spec.torch_dtype, made), entry)
        )
    return items


def _check_sharded(
    api: str, state: ShardedState, sd: Mapping[str, Any], fulls: Sequence[torch.Tensor | None]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The (destination, source) tensor pairs of a load, once everything is checked (the
    masters' destinations are ``fulls``, float32 per group)."""
    if not isinstance(sd, Mapping) or sd.get("format") != SHARDED_FORMAT:
        got = sd.get("format") if isinstance(sd, Mapping) else type(sd).__name__
        raise ValueError(f"{api}: expected a dict of format {SHARDED_FORMAT!r}, got {got!r}")
    param_buffers = state.param_buffers
    try:
        plan = Plan.from_dict(sd["plan"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{api}: expected a valid plan in the state dict, got: {exc}") from None
    if plan != param_buffers.plan:
        raise ValueError(
            f"{api}: expected the state dict of the same plan ({param_buffers.plan!r}), got "
            f"{plan!r}; use load_checkpoint or load_torch_state_dict to change plans"
        )
    if sd.get("rank") != param_buffers.rank:
        raise ValueError(
            f"{api}: expected the state dict of rank {param_buffers.rank}, got rank "
            f"{sd.get('rank')!r}"
        )
    fields = sd.get("fields")
    mine = {f.path: f for f in state.fields}
    if not isinstance(fields, Mapping) or set(fields) != set(mine):
        got = sorted(fields) if isinstance(fields, Mapping) else fields
        raise ValueError(f"{api}: expected fields {sorted(mine)}, got {got}")
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
    for path, field in mine.items():
        entry = fields[path]
        if entry.get("kind") != field.granularity.value:
            raise ValueError(
                f"{api}: expected field {path} of kind {field.granularity.value}, "
                f"got {entry.get('kind')!r}"
            )
        pairs += _tensor_pairs(api, f"fields[{path!r}]", field.buffers, entry.get("buffers"))
    pairs += _tensor_pairs(api, "master", fulls, sd.get("master"))
    outside = {path: t for path, t, _ in outside_tensors(state)}
    replicated = sd.get("replicated")
    if not isinstance(replicated, Mapping) or set(replicated) != set(outside):
        got = sorted(replicated) if isinstance(replicated, Mapping) else replicated
        raise ValueError(f"{api}: expected replicated leaves {sorted(outside)}, got {got}")
    for path, dst in outside.items():
        pairs += _tensor_pairs(api, f"replicated[{path!r}]", [dst], [replicated[path]])
    return pairs


def _tensor_pairs(
    api: str, what: str, mine: Any, theirs: Any
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if not isinstance(theirs, (list, tuple)) or len(theirs) != len(mine):
        raise ValueError(f"{api}: expected {what} to be a list of {len(mine)}, got {theirs!r}")
    out = []
    for g, (dst, src) in enumerate(zip(mine, theirs)):
        if dst is None and src is None:
            continue
        if dst is None or not isinstance(src, torch.Tensor):
            want = "None" if dst is None else "a tensor"
            raise ValueError(f"{api}: expected {what}[{g}] to be {want}, got {type(src).__name__}")
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(
                f"{api}: expected {what}[{g}] of shape {tuple(dst.shape)} and {dst.dtype}, "
                f"got {tuple(src.shape)} and {src.dtype}"
            )
        out.append((dst, src))
    return out
