"""torch.distributed.checkpoint save and load of a sharded state: resharding, written atomically."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter, StorageWriter
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import DeviceMesh

from shardopt.core import Plan
from shardopt.functional.checkpoint._checkpoint_keys import (
    FieldKeys,
    has_state,
    piece_slots,
    piece_value,
)
from shardopt.functional.checkpoint._dcp_dict import (
    HYPERPARAMS,
    OPTIM_KEY,
    check_metadata,
    checkpoint_group,
    fresh_where_absent,
    optim_dict,
    state_keysets,
)
from shardopt.functional.checkpoint._errors import dcp_failure
from shardopt.functional.checkpoint._hyperparams import (
    checked_hyperparams,
    hyperparam_placeholders,
    saved_hyperparams,
    typed_like,
    write_hyperparams,
)
from shardopt.functional.checkpoint._incoming import (
    NONNEGATIVE_KEYS,
    EntrySpec,
    Expected,
    check_entries,
)
from shardopt.functional.checkpoint._lock import SaveLock
from shardopt.functional.checkpoint._publish import (
    agree_on_rank0,
    from_rank0,
    mark,
    publish,
    published,
    refusal,
    shared_token,
)
from shardopt.functional.checkpoint._safe_load import (
    SafeReader,
    StagedPlanner,
    UnsafeCheckpointError,
)
from shardopt.functional.checkpoint._torch_format import Hyperparams, param_group_dicts, param_keys
from shardopt.functional.engine._collectives import ProcessGroup
from shardopt.functional.engine._failure import completed, fails_together
from shardopt.functional.engine._renamed import renamed_keyword
from shardopt.functional.engine._state import ShardedState
from shardopt.functional.engine._validate import agree_across_ranks, fingerprint, plan_fields

__all__ = ["OPTIM_KEY", "load_checkpoint", "save_checkpoint"]


@renamed_keyword("save_checkpoint", "group", "process_group")
@fails_together("save_checkpoint")
def save_checkpoint(
    state: ShardedState,
    path: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    param_groups: Hyperparams = None,
    extra: Mapping[str, Any] | None = None,
    process_group: ProcessGroup | DeviceMesh = None,
    overwrite: bool = False,
    writer: Callable[[str], StorageWriter] | None = None,
) -> None:
    """Saves the optimizer state with ``torch.distributed.checkpoint``, atomically, at ``path``.

    Every rank of ``process_group`` calls it. The state goes under ``optim.state.<name>.<key>`` at
    each parameter's full shape, with torch.optim's keys for the core optimizers (see
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
        process_group: the process group (or DeviceMesh) of the sharded optimizer; a state with
            tensor-parallel parameters or replicas is saved by every rank of the default
            group (see [Note: tensor-parallel checkpoints]).
        overwrite: replace an existing checkpoint at ``path`` (else it is an error). Only a
            checkpoint that shardopt wrote is ever replaced: anything else at ``path`` (a
            directory, a file, another link) is refused whatever ``overwrite`` says.
        writer: makes the storage writer for a directory (default ``FileSystemWriter``).

    Raises:
        ValueError: on every rank, before anything is written: bad input, ``path`` not
            shardopt's, or another save of any job writing to ``path`` now (its lock, see
            [Note: checkpoint lock]), e.g. ``save_checkpoint: expected no other save writing
            to '/ckpt' at the same time, got its lock '/ckpt.lock' held by pid 4242 on host
            'node3' since 2026-11-27T06:00:00+00:00; retry once that save is done``.
        CheckpointError: on every rank, when a rank's writes or the publish failed (``path``
            keeps what it held).

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
    state.param_buffers.wait_params()  # [Note: deferred parameter sync]
    process_group = checkpoint_group(api, state, process_group)
    plan, rank = state.param_buffers.plan, dist.get_rank(process_group)
    key_of = [str(k) for k in param_keys(api, plan, names)]
    groups = param_group_dicts(api, plan, param_groups, key_of)
    target = os.path.abspath(os.fspath(path))
    keysets, error = state_keysets(api, state, extra)
    lock = SaveLock(target) if rank == 0 else None  # [Note: checkpoint lock]
    try:
        verdict = None
        if lock is not None and error is None:
            verdict = lock.acquire() or refusal(target, overwrite)
        verdict = from_rank0(verdict, process_group)  # every rank names the path and what is there
        agree_across_ranks(
            api,
            error if error is not None else verdict,
            fingerprint(plan, (target, key_of)),
            process_group,
            lambda: {"path": target, "param keys": key_of, "plan": plan_fields(plan)},
        )
        sd = {OPTIM_KEY: {**_saved(state, keysets, key_of), "param_groups": groups}}
        _write(api, {**sd, **(extra or {})}, target, writer, process_group, lock)
    finally:
        if lock is not None:
            lock.release()


def _saved(state: ShardedState, keysets: Sequence[FieldKeys], key_of: list[str]) -> dict[str, Any]:
    """The ``optim`` entry that :func:`save_checkpoint` writes."""
    slots = piece_slots(state.param_buffers)

    def present(keys: FieldKeys, t: int, k: int) -> bool:
        count = keys.count
        return has_state(
            keys, None if count is None else piece_value(count, state.param_buffers, k, slots)
        )

    optim = optim_dict(state, keysets, key_of, present, lambda t: True, state.master.fulls())
    hyperparams = saved_hyperparams(state)
    if hyperparams:
        optim["hyperparams"] = hyperparams
    return optim


def _write(
    api: str,
    sd: dict[str, Any],
    target: str,
    writer: Callable[[str], StorageWriter] | None,
    group: ProcessGroup,
    lock: SaveLock | None,
) -> None:
    """Writes ``sd`` into a new version and publishes it ([Note: atomic checkpoints]); ``lock``:
    rank 0's, held."""
    token = shared_token(group)
    tmp = f"{target}.v-{token:016x}"  # the new version
    if lock is not None:
        mark(tmp, token)
    try:
        dcp.save(sd, storage_writer=(writer or FileSystemWriter)(tmp), process_group=group)
    except dcp.CheckpointException as exc:  # raised on every rank alike: clean up, then all
        if lock is not None:
            shutil.rmtree(tmp, ignore_errors=True)
            lock.release()
        completed(dist.barrier(group=group, async_op=True))
        raise dcp_failure(api, exc) from exc
    except BaseException:
        if lock is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    completed(dist.barrier(group=group, async_op=True))
    failure: BaseException | None = None
    if lock is not None:
        try:
            publish(tmp, target)
        except OSError as exc:
            failure = exc
            if os.path.realpath(target) != os.path.realpath(tmp):  # the commit did not happen
                shutil.rmtree(tmp, ignore_errors=True)
        lock.release()
    agree_on_rank0(api, failure, group)


@renamed_keyword("load_checkpoint", "group", "process_group")
@fails_together("load_checkpoint")
def load_checkpoint(
    state: ShardedState,
    path: str | os.PathLike[str],
    *,
    names: Sequence[str] | None = None,
    extra: MutableMapping[str, Any] | None = None,
    process_group: ProcessGroup | DeviceMesh = None,
    allow_nonfinite: bool = False,
) -> None:
    """Loads a :func:`save_checkpoint` directory into ``state`` in place, at any world size or plan.

    Every rank of ``process_group`` calls it; each reads only the boxes of its own pieces (DCP
    reshards by overlap). Parameters without state in the checkpoint keep theirs, which must be
    fresh (count 0). Master weights come from the checkpoint, or else from the current parameters
    (load the model first). ``extra`` (e.g. ``{"model": model.state_dict()}``) is loaded in
    place too. Everything is checked against the checkpoint's metadata on every rank before
    any data is read, and every rank raises the same error on a mismatch. Injected
    hyperparameters in the checkpoint are read and checked first, and set with the rest (see
    [Note: hyperparameters of a sharded state]). No code from the files runs, and the state
    (``extra`` too) is written only once every rank has read and checked all of it: a failed
    load changes nothing (see [Note: safe loads]). The state read is checked before it is
    written ([Note: incoming state]): step counts and second moments >= 0, everything finite
    (``allow_nonfinite=True`` loads NaN and inf values, a diverged run reloaded on purpose).

    Raises:
        ValueError: on every rank, before any data is read: the checkpoint does not fit the
            state, or its ``.metadata`` is refused (it names another global than DCP's
            metadata classes, or is malformed).
        CheckpointError: on every rank, when a rank's reads fail or an entry is refused (a
            crafted or truncated entry, chunks that do not cover a tensor exactly once, another
            dtype), naming the entry.
        ValueError: on every rank, after reading and before writing: a value out of its domain
            (a negative step or second moment, NaN or inf), naming the parameter and entry.

    Example:
        see :func:`save_checkpoint`.
    """
    api = "load_checkpoint"
    param_buffers, plan = state.param_buffers, state.param_buffers.plan
    param_buffers.wait_params()  # [Note: deferred parameter sync]
    process_group = checkpoint_group(api, state, process_group)
    key_of = [str(k) for k in param_keys(api, plan, names)]
    asked = os.path.abspath(os.fspath(path))
    source = published(asked) or asked  # after a crash mid-publish: [Note: atomic checkpoints]
    reader = SafeReader(source, api)  # [Note: safe loads]
    keysets, error = state_keysets(api, state, extra)
    present: list[bool] = []
    masters: list[bool] = []
    hyperparams: dict[str, Any] = {}
    if error is None:
        try:
            md = reader.read_metadata()
        except (OSError, ValueError, RuntimeError) as exc:
            why = f": {exc}" if isinstance(exc, UnsafeCheckpointError) else ""
            md, error = None, f"a readable checkpoint at {source!r}, got {type(exc).__name__}{why}"
        if md is not None:
            error, present, masters = check_metadata(api, state, keysets, key_of, md)
            saved = {
                k[len(HYPERPARAMS) :] for k in md.state_dict_metadata if k.startswith(HYPERPARAMS)
            }
            hyperparams = hyperparam_placeholders(state, saved)
    if error is None:
        error = fresh_where_absent(state, keysets, key_of, present)
    agree_across_ranks(
        api,
        error,
        fingerprint(plan, (asked, key_of)),
        process_group,
        lambda: {"saved keys": asked, "param keys": key_of, "plan": plan_fields(plan)},
    )
    if hyperparams:  # the same keys on every rank (same checkpoint, same transformation)
        hyper_sd = {OPTIM_KEY: {"hyperparams": hyperparams}}
        _read(api, hyper_sd, reader, process_group)
        hyperparams = typed_like(api, state, hyper_sd[OPTIM_KEY]["hyperparams"])
    writes = checked_hyperparams(api, state, hyperparams, every=False)  # alike on every rank
    fulls = state.master.fulls()  # float32 masters, loaded in place ([Note: master weights])
    optim = optim_dict(
        state, keysets, key_of, lambda _, t, k: present[t], masters.__getitem__, fulls
    )
    stateful = {k: v for k, v in (extra or {}).items() if isinstance(v, Stateful)}
    sd = {OPTIM_KEY: optim, **(extra or {}), **{k: v.state_dict() for k, v in stateful.items()}}
    # everything read and checked, then written: all or nothing
    index_of = {name: t for t, name in enumerate(key_of)}

    def check(got: list[tuple[str, torch.Tensor]]) -> str | None:
        return _domain_refusal(plan, index_of, got, allow_nonfinite)

    _read(api, sd, reader, process_group, check)
    write_hyperparams(writes)
    if extra is not None:
        for k, v in stateful.items():
            v.load_state_dict(sd[k])
        extra.update({k: sd[k] for k in extra if k not in stateful})
    with torch.no_grad():
        for piece, view in zip(param_buffers.pieces, param_buffers.param_views()):
            master = fulls[piece.group]
            if master is not None and not masters[piece.tensor]:
                master[piece.offset : piece.offset + piece.numel].copy_(view)
    state.master.load_all(fulls)  # remainders: their split, parameters included


def _domain_refusal(
    plan: Plan, names: dict[str, int], staged: list[tuple[str, torch.Tensor]], nonfinite: bool
) -> str | None:
    """load_checkpoint's check of the state it read ([Note: incoming state]): the chunks'
    shapes and dtypes are the metadata's, checked already; their values here."""
    prefix, items = f"{OPTIM_KEY}.state.", []
    for fqn, part in staged:
        if not fqn.startswith(prefix):
            continue
        name, key = fqn[len(prefix) :].rsplit(".", 1)
        t = names.get(name, -1)
        group = plan.tensors[t].param_group if t >= 0 else -1
        bound = key in NONNEGATIVE_KEYS
        made = {
            key: Expected(tuple(part.shape), part.dtype, count=key == "step", nonnegative=bound)
        }
        items.append((EntrySpec(name, group, tuple(part.shape), part.dtype, made), {key: part}))
    return check_entries("load_checkpoint", items, allow_nonfinite=nonfinite)


def _read(
    api: str,
    sd: dict[str, Any],
    reader: SafeReader,
    group: ProcessGroup,
    check: Callable[[list[tuple[str, torch.Tensor]]], str | None] | None = None,
) -> None:
    """Loads ``sd`` in place from ``reader``'s checkpoint, only once every rank read all of it
    (see [Note: safe loads]) and ``check`` found nothing wrong in what it read, on any rank;
    raises CheckpointError (a failed read) or ValueError (``check``'s) on every rank otherwise."""
    planner = StagedPlanner(api, f"{OPTIM_KEY}.")
    try:
        dcp.load(sd, storage_reader=reader, planner=planner, process_group=group)
    except dcp.CheckpointException as exc:  # raised on every rank alike
        raise dcp_failure(api, exc) from exc
    if check is not None:  # [Note: incoming state]
        problem = check(planner.staged())
        agree_across_ranks(api, None if problem is None else ValueError(problem), 0, group)
    with torch.no_grad():
        planner.commit(sd)
