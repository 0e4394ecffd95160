"""torch.distributed.checkpoint save and load of a sharded state: resharding, written atomically."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.device_mesh import DeviceMesh

from shardopt.core import Plan
from shardopt.functional._state import FieldKind, ShardedState
from shardopt.functional.checkpoint._checkpoint_keys import (
    FieldKeys,
    ListField,
    has_state,
    keys_of,
    outside_tensors,
    piece_slots,
    piece_value,
    sanitised_key,
    state_keys,
)
from shardopt.functional.checkpoint._dcp_pieces import piece_tensor
from shardopt.functional.checkpoint._hyperparams import (
    checked_hyperparams,
    hyperparam_placeholders,
    saved_hyperparams,
    write_hyperparams,
)
from shardopt.functional.checkpoint._publish import (
    agree_on_rank0,
    publish,
    published,
    shared_token,
)
from shardopt.functional.checkpoint._torch_format import Hyperparams, param_group_dicts, param_keys
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._failure import (
    completed,
    fails_together,
    raised_on_every_rank,
)
from shardopt.functional.engine._mesh import GlobalPlace, mesh_groups
from shardopt.functional.engine._validate import agree_across_ranks, fingerprint, plan_fields

__all__ = ["OPTIM_KEY", "load_checkpoint", "save_checkpoint"]

OPTIM_KEY = "optim"
HYPERPARAMS = f"{OPTIM_KEY}.hyperparams."  # [Note: hyperparameters of a sharded state]


def _places(state: ShardedState) -> Sequence[GlobalPlace | None]:
    """Each plan tensor's place in its full DTensor, or None (see [Note: tensor-parallel
    checkpoints])."""
    layout = state.layout
    return layout.global_places or (None,) * len(layout.plan.tensors)


def _optim_dict(
    state: ShardedState,
    keysets: Sequence[FieldKeys],
    names: Sequence[str],
    present: Callable[[FieldKeys, int, int], bool],
    masters: Callable[[int], bool],
    fulls: Sequence[torch.Tensor | None],
) -> dict[str, Any]:
    """This rank's DCP dict: ``{"state": {name: {key: tensor}}, "master_weights": {name:
    tensor}, "replicated": {path: tensor}}`` for the tensors ``present(keys, t, k)`` says; the
    master weights are views of ``fulls`` (``state.master.fulls()``: float32 per group)."""
    layout, plan = state.layout, state.layout.plan
    slots = piece_slots(layout)
    places = _places(state)
    entries: dict[str, dict[str, torch.Tensor]] = {}
    master_weights: dict[str, torch.Tensor] = {}
    for k, piece in enumerate(layout.pieces):
        t, shape, place = piece.tensor, plan.tensors[piece.tensor].shape, places[piece.tensor]
        master = fulls[piece.group]
        if master is not None and masters(t):
            flat = master[piece.offset : piece.offset + piece.numel]
            master_weights[names[t]] = piece_tensor(shape, piece, flat, place)
        keys = keys_of(keysets, t)
        if keys is None or not present(keys, t, k):
            continue
        entry = entries.setdefault(names[t], {})
        for field, key, _ in keys.entries:
            if field.kind is FieldKind.PER_PIECE:
                entry[key] = piece_value(field, layout, k, slots)
            else:
                entry[key] = piece_tensor(shape, piece, piece_value(field, layout, k, slots), place)
        for shaped in keys.shaped:  # whole on their owner: plain tensors ([Note: shaped state])
            if (whole := shaped.tensors[k]) is not None:
                entry[shaped.key] = whole
    replicated = {sanitised_key(p): x for p, x, shared in outside_tensors(state) if shared}
    return {"state": entries, "master_weights": master_weights, "replicated": replicated}


def _checkpoint_group(api: str, state: ShardedState, group: Any) -> ProcessGroup:
    """The group that saves or loads ``state``: the default group for tensor-parallel and hybrid
    states ([Note: tensor-parallel checkpoints]). Raises ValueError, on every calling rank alike
    and before any collective, if their ranks do not span the world."""
    layout, shard_group = state.layout, mesh_groups(api, group).shard
    if layout.global_places is None and layout.replicate is None:
        return shard_group
    replicas = 1 if layout.replicate is None else dist.get_world_size(layout.replicate)
    split = layout.tensor_parallel
    tp = 1 if split is None else dist.get_world_size(split.group)
    spans = dist.get_world_size(shard_group) * replicas * tp
    if spans != dist.get_world_size():  # the same on every calling rank: no collective needed
        raise ValueError(
            f"{api}: expected a tensor-parallel or hybrid state whose ranks span the world "
            f"(all {dist.get_world_size()} ranks save and load it together), got "
            f"{spans} ranks (data-parallel x replicas x tensor-parallel)"
        )
    return dist.group.WORLD


def _keysets(
    api: str, state: ShardedState, extra: Any
) -> tuple[tuple[FieldKeys, ...], str | BaseException | None]:
    """The state's keys and the first problem of the input (for the agreement), if any."""
    try:
        keysets = state_keys(state, api)
    except ValueError as exc:  # the same structure everywhere, but ride the agreement anyway
        return (), exc
    return keysets, _common_checks(state, keysets, extra)


def _common_checks(state: ShardedState, keysets: Sequence[FieldKeys], extra: Any) -> str | None:
    listed = {s.path for keys in keysets for s in keys.shaped}
    listed |= {f.path for keys in keysets for f, _, _ in keys.entries if isinstance(f, ListField)}
    per_piece = [
        path
        for path, _, replicated in outside_tensors(state)
        if not replicated and path.rsplit("[", 1)[0] not in listed
    ]
    if per_piece:
        return f"every per-parameter tensor of the state in a field, got others at {per_piece}"
    if any(keys.shaped for keys in keysets) and state.layout.global_places is not None:
        return "no shaped state (Adafactor's row_var, col_var) with DTensor parameters"
    if extra is not None and (not isinstance(extra, Mapping) or OPTIM_KEY in extra):
        return f"extra to be a mapping without the key {OPTIM_KEY!r}, got {type(extra).__name__}"
    return None


@fails_together("save_checkpoint")
def save_checkpoint(
    state: ShardedState,
    path: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    param_groups: Hyperparams = None,
    extra: Mapping[str, Any] | None = None,
    group: ProcessGroup | DeviceMesh = None,
    overwrite: bool = False,
    writer: Callable[[str], StorageWriter] | None = None,
) -> None:
    """Saves the optimizer state with ``torch.distributed.checkpoint``, atomically, at ``path``.

    Every rank of ``group`` calls it. The state goes under ``optim.state.<name>.<key>`` at each
    parameter's full shape, with torch.optim's keys for the core optimizers (see
    [Note: checkpoint formats], [Note: DCP pieces]); only parameters with state are saved, as
    in torch. :func:`load_checkpoint` reads it at any world size and plan.

    Args:
        state: this rank's sharded state (any core transformation).
        path: the checkpoint directory; it appears only once complete
            (see [Note: atomic checkpoints]).
        names: one name per plan tensor (e.g. ``[n for n, _ in model.named_parameters()]``);
            None: the indices ``"0"``, ``"1"``, ...
        param_groups: hyperparameters recorded in ``optim.param_groups`` (as in
            :func:`consolidate_state_dict`); not needed to load.
        extra: more DCP state (e.g. ``{"model": model.state_dict()}``) saved alongside.
        group: the process group (or DeviceMesh) of the sharded optimizer; a state with
            tensor-parallel parameters or replicas is saved by every rank of the default
            group (see [Note: tensor-parallel checkpoints]).
        overwrite: replace an existing checkpoint at ``path`` (else it is an error).
        writer: makes the storage writer for a directory (default ``FileSystemWriter``).

    Example:
        >>> import torch, torch.distributed as dist, tempfile, os
        >>> from shardopt.core import adam, plan_partition
        >>> from shardopt.functional import shard
        >>> tmp = tempfile.mkdtemp()
        >>> store = dist.FileStore(os.path.join(tmp, "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> params = [torch.ones(3), torch.ones(2)]
        >>> sharded = shard(adam(0.1), plan_partition(params, 1))
        >>> state = sharded.step(params, [torch.ones(3), None], sharded.init(params))
        >>> save_checkpoint(state, os.path.join(tmp, "ckpt"), names=["w", "b"])
        >>> fresh = sharded.init([torch.ones(3), torch.ones(2)])
        >>> load_checkpoint(fresh, os.path.join(tmp, "ckpt"), names=["w", "b"])
        >>> fresh.inner[0].count
        [tensor(1.), tensor(0.)]
        >>> dist.destroy_process_group()
    """
    api = "save_checkpoint"
    state.layout.wait_params()  # [Note: deferred parameter sync]
    group = _checkpoint_group(api, state, group)
    plan, rank = state.layout.plan, dist.get_rank(group)
    key_of = [str(k) for k in param_keys(api, plan, names)]
    groups = param_group_dicts(api, plan, param_groups, key_of)
    target = os.path.abspath(os.fspath(path))
    keysets, error = _keysets(api, state, extra)
    if error is None and rank == 0 and published(target) is not None and not overwrite:
        error = f"a path that does not exist (or overwrite=True), got {target!r}"
    agree_across_ranks(
        api,
        error,
        fingerprint(plan, (target, key_of)),
        group,
        lambda: {"path": target, "param keys": key_of, "plan": plan_fields(plan)},
    )
    token = shared_token(group)
    tmp = f"{target}.v-{token:016x}"  # the new version ([Note: atomic checkpoints])
    slots = piece_slots(state.layout)

    def present(keys: FieldKeys, t: int, k: int) -> bool:
        count = keys.count
        return has_state(
            keys, None if count is None else piece_value(count, state.layout, k, slots)
        )

    optim = _optim_dict(state, keysets, key_of, present, lambda t: True, state.master.fulls())
    hyperparams = saved_hyperparams(state)
    if hyperparams:
        optim["hyperparams"] = hyperparams
    sd = {OPTIM_KEY: {**optim, "param_groups": groups}, **(extra or {})}
    try:
        dcp.save(sd, storage_writer=(writer or FileSystemWriter)(tmp), process_group=group)
    except dcp.CheckpointException as exc:  # raised on every rank alike: clean up, then all
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        completed(dist.barrier(group=group, async_op=True))
        raised_on_every_rank(exc)
        raise
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    completed(dist.barrier(group=group, async_op=True))
    failure: BaseException | None = None
    if rank == 0:
        try:
            publish(tmp, target, token)
        except OSError as exc:
            failure = exc
            shutil.rmtree(tmp, ignore_errors=True)  # still there: the commit did not happen
    agree_on_rank0(api, failure, group)


def _check_metadata(
    api: str, state: ShardedState, keysets: Sequence[FieldKeys], names: Sequence[str], md: Any
) -> tuple[str | None, list[bool], list[bool]]:
    """(the first problem of the checkpoint for ``state``, whether each tensor has state in it,
    whether it has master weights); the same on every rank (plan and file are)."""
    plan: Plan = state.layout.plan
    places = _places(state)
    saved = md.state_dict_metadata
    prefix = f"{OPTIM_KEY}.state."
    wants = [
        _wanted(keys_of(keysets, t), spec.shape, places[t]) for t, spec in enumerate(plan.tensors)
    ]
    expected = {f"{prefix}{n}.{key}" for n, want in zip(names, wants) for key in want}
    unknown = sorted(k for k in saved if k.startswith(prefix) and k not in expected)
    if unknown:
        return f"state keys among those of this optimizer and plan, got {unknown[:4]}", [], []
    present, masters = [], []
    for t, spec in enumerate(plan.tensors):
        base, want = f"{prefix}{names[t]}.", wants[t]
        have = [key for key in want if base + key in saved]
        present.append(bool(have) and spec.numel > 0)
        masters.append(f"{OPTIM_KEY}.master_weights.{names[t]}" in saved)
        if have and len(have) != len(want):
            return f"keys {list(want)} for parameter {names[t]!r}, got {have}", [], []
        for key, shape in want.items() if have else ():
            item = saved[base + key]
            if not isinstance(item, TensorStorageMetadata) or item.size != shape:
                got = getattr(item, "size", type(item).__name__)
                return f"{base + key} of shape {tuple(shape)}, got {got}", [], []
    for path, _, replicated in outside_tensors(state):
        if replicated and f"{OPTIM_KEY}.replicated.{sanitised_key(path)}" not in saved:
            return f"the replicated state {path} in the checkpoint, got none", [], []
    return None, present, masters


def _wanted(
    keys: FieldKeys | None, shape: tuple[int, ...], place: GlobalPlace | None
) -> dict[str, torch.Size]:
    """The saved keys of a parameter of ``shape`` (at ``place``), with their shapes."""
    if keys is None:
        return {}
    full = shape if place is None else place.shape
    want = {
        key: torch.Size(() if field.kind is FieldKind.PER_PIECE else full)
        for field, key, _ in keys.entries
    }
    want.update({key: torch.Size(s) for key, s in keys.shapes(shape, torch.float32).items()})
    return want


@fails_together("load_checkpoint")
def load_checkpoint(
    state: ShardedState,
    path: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    extra: MutableMapping[str, Any] | None = None,
    group: ProcessGroup | DeviceMesh = None,
) -> None:
    """Loads a :func:`save_checkpoint` directory into ``state`` in place, at any world size or plan.

    Every rank of ``group`` calls it; each reads only the boxes of its own pieces (DCP reshards
    by overlap). Parameters without state in the checkpoint keep theirs, which must be fresh
    (count 0). Master weights come from the checkpoint, or else from the current parameters
    (load the model first). ``extra`` (e.g. ``{"model": model.state_dict()}``) is loaded in
    place too. Everything is checked against the checkpoint's metadata on every rank before
    any data is read, and every rank raises the same error on a mismatch. Injected
    hyperparameters in the checkpoint are read and checked first, and set with the rest (see
    [Note: hyperparameters of a sharded state]).

    Example:
        see :func:`save_checkpoint`.
    """
    api = "load_checkpoint"
    layout, plan = state.layout, state.layout.plan
    layout.wait_params()  # [Note: deferred parameter sync]
    group = _checkpoint_group(api, state, group)
    key_of = [str(k) for k in param_keys(api, plan, names)]
    asked = os.path.abspath(os.fspath(path))
    source = published(asked) or asked  # after a crash mid-publish: [Note: atomic checkpoints]
    keysets, error = _keysets(api, state, extra)
    present: list[bool] = []
    masters: list[bool] = []
    hyperparams: dict[str, Any] = {}
    if error is None:
        try:
            md = FileSystemReader(source).read_metadata()
        except (OSError, ValueError, RuntimeError) as exc:
            md, error = None, f"a readable checkpoint at {source!r}, got {type(exc).__name__}"
        if md is not None:
            error, present, masters = _check_metadata(api, state, keysets, key_of, md)
            saved = {
                k[len(HYPERPARAMS) :] for k in md.state_dict_metadata if k.startswith(HYPERPARAMS)
            }
            hyperparams = hyperparam_placeholders(state, saved)
    if error is None:
        error = _fresh_where_absent(state, keysets, key_of, present)
    agree_across_ranks(
        api,
        error,
        fingerprint(plan, (asked, key_of)),
        group,
        lambda: {"saved keys": asked, "param keys": key_of, "plan": plan_fields(plan)},
    )
    if hyperparams:  # the same keys on every rank (same checkpoint, same transformation)
        hyper_sd = {OPTIM_KEY: {"hyperparams": hyperparams}}
        dcp.load(hyper_sd, storage_reader=FileSystemReader(source), process_group=group)
        hyperparams = hyper_sd[OPTIM_KEY]["hyperparams"]
    writes = checked_hyperparams(api, state, hyperparams, every=False)  # alike on every rank
    fulls = state.master.fulls()  # float32 masters, loaded in place ([Note: master weights])
    optim = _optim_dict(
        state, keysets, key_of, lambda _, t, k: present[t], masters.__getitem__, fulls
    )
    sd = {OPTIM_KEY: optim, **(extra or {})}
    dcp.load(sd, storage_reader=FileSystemReader(source), process_group=group)
    write_hyperparams(writes)
    if extra is not None:
        extra.update({k: sd[k] for k in extra})
    with torch.no_grad():
        for piece, view in zip(layout.pieces, layout.param_views()):
            master = fulls[piece.group]
            if master is not None and not masters[piece.tensor]:
                master[piece.offset : piece.offset + piece.numel].copy_(view)
    state.master.load_all(fulls)  # remainders: their split, parameters included


def _fresh_where_absent(
    state: ShardedState,
    keysets: Sequence[FieldKeys],
    names: Sequence[str],
    present: Sequence[bool],
) -> str | None:
    slots = piece_slots(state.layout)
    for k, piece in enumerate(state.layout.pieces):
        keys = keys_of(keysets, piece.tensor)
        if keys is None or keys.count is None or present[piece.tensor]:
            continue
        count = piece_value(keys.count, state.layout, k, slots).item()
        if count != 0:
            return (
                f"state in the checkpoint for parameter {names[piece.tensor]!r}, whose state "
                f"here has count {count:g} (load into a fresh state)"
            )
    return None
