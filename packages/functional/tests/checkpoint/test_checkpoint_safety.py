"""Checkpoints that cannot destroy or betray a user's data, tried as a careless and a hostile user.

Every case runs at W = 1 and 2. Crafted checkpoints are a good save edited on disk: an entry's
bytes replaced by a pickle that, if anything ran it, would create a marker file; or its chunks,
dtype or data file damaged. After each, the marker must not exist and the state must be as it
was before the load.
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    MetadataIndex,
)

from shardopt.core import adam, inject_hyperparams, plan_partition
from shardopt.functional import CheckpointError, load_checkpoint, save_checkpoint, shard
from shardopt.functional.checkpoint._safe_load import safe_metadata
from shardopt.testing import World

SHAPES = [(4, 3), (5,), (2, 2)]
NAMES = ["w", "b", "m"]


def _trained(world: World, group: Any = None, size: int | None = None, seed: float = 1.0):
    """(sharded, params, state) of an injected-lr Adam with float32 masters of bfloat16
    parameters, after one step (every kind of entry: state, masters, hyperparameters)."""
    params = [torch.full(s, seed, dtype=torch.bfloat16) for s in SHAPES]
    plan = plan_partition(params, size or world.world_size, align=1)
    tx = inject_hyperparams(adam, lr=0.125)
    sharded = shard(tx, plan, master_dtype=torch.float32, process_group=group)
    grads = [torch.full(s, 0.5 * seed, dtype=torch.bfloat16) for s in SHAPES]
    return sharded, params, sharded.step(params, grads, sharded.init(params))


def _tensors(state: Any) -> list[torch.Tensor]:
    """Every tensor a load may write: field buffers, masters, hyperparameters."""
    out = [b for f in state.fields for b in f.buffers if b is not None]
    out += [m for m in state.master.fulls() if m is not None]
    return out + [v for v in _hyper(state).values() if isinstance(v, torch.Tensor)]


def _hyper(state: Any) -> dict[str, Any]:
    from shardopt.functional.checkpoint._hyperparams import saved_hyperparams

    return dict(saved_hyperparams(state))


def _snapshot(state: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    return [t.clone() for t in _tensors(state)], _hyper(state)


def _unchanged(state: Any, snap: tuple[list[torch.Tensor], dict[str, Any]]) -> bool:
    now = _tensors(state)
    return (
        len(now) == len(snap[0])
        and all(map(torch.equal, now, snap[0]))
        and (_hyper(state) == snap[1])
    )


def _shared_dir(world: World, tmp_path: Any, name: str) -> str:
    path = os.path.join(str(tmp_path), name)
    if world.rank == 0:
        os.makedirs(path, exist_ok=True)
    dist.barrier()
    return path


def _every_case(
    world: World, tmp_path: Any, cases: list[str], run: Callable[[str, str], None]
) -> None:
    """Runs ``run(case, root)`` for each case in one world, each in a folder of its own, and
    fails naming every case that failed on this rank (one world per table and world size: a
    world costs more than a case)."""
    failed = {}
    cwd = os.getcwd()
    for i, case in enumerate(cases):
        root = _shared_dir(world, tmp_path, f"case-{i}")
        try:
            run(case, root)
        except Exception as exc:  # AssertionError included: the next case still runs
            failed[case] = f"{type(exc).__name__}: {exc}"
        finally:
            os.chdir(cwd)
        dist.barrier()
    assert not failed, f"rank {world.rank}: " + "; ".join(f"[{c}] {m}" for c, m in failed.items())


# ---- 1. Delete only what shardopt wrote ----------------------------------------------------


def _user_dir(root: str) -> None:
    os.makedirs(os.path.join(root, "mine"))
    for name in ("thesis.tex", "data.bin"):
        with open(os.path.join(root, "mine", name), "w") as f:
            f.write(name)


def _user_file(root: str) -> None:
    with open(os.path.join(root, "notes.txt"), "w") as f:
        f.write("keep me")


def _user_link(root: str) -> None:
    _user_dir(root)
    os.symlink(os.path.join(root, "mine"), os.path.join(root, "latest"))


FOREIGN: dict[str, tuple[Callable[[str], None], str, str]] = {  # made by, path, its words
    "a directory of the user": (_user_dir, "mine", "got a directory of 2 entries ('data.bin'"),
    "the current directory": (_user_dir, ".", "got a directory of 2 entries ('data.bin'"),
    "a regular file": (_user_file, "notes.txt", "got a regular file of 7 bytes"),
    "a link to the user's directory": (_user_link, "latest", "got a symbolic link to '/"),
}


def _listing(root: str) -> dict[str, bytes]:
    out = {}
    for parent, _, files in os.walk(root):
        for name in files:
            with open(os.path.join(parent, name), "rb") as f:
                out[os.path.relpath(os.path.join(parent, name), root)] = f.read()
    return out


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_path_shardopt_did_not_write_is_refused_on_every_rank_and_kept(
    world: World, n: int, tmp_path: Any
) -> None:
    def run(case: str, root: str) -> None:
        name, overwrite = case.rsplit(", overwrite=", 1)
        make, where, says = FOREIGN[name]
        if world.rank == 0:
            make(root)
        dist.barrier()
        if where == ".":
            os.chdir(os.path.join(root, "mine"))  # save_checkpoint(state, ".")
            path = "."
        else:
            path = os.path.join(root, where)
        before = _listing(root)
        _, _, state = _trained(world)
        with pytest.raises(ValueError) as info:
            save_checkpoint(state, path, names=NAMES, overwrite=overwrite == "True")
        message = str(info.value)
        expected = f"save_checkpoint: expected '{os.path.abspath(path)}' to be"
        assert message.startswith(expected), message
        assert says in message, message
        assert "shardopt deletes only what it wrote" in message, message
        dist.barrier()
        assert _listing(root) == before
        assert not any(".v-" in name or name.endswith(".lock") for name in os.listdir(root))

    cases = [f"{name}, overwrite={o}" for name in FOREIGN for o in (True, False)]
    _every_case(world, tmp_path, cases, run)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_save_into_missing_directories_makes_them(world: World, n: int, tmp_path: Any) -> None:
    root = str(tmp_path)
    path = os.path.join(root, "runs", "a", "ckpt")
    _, _, state = _trained(world)
    save_checkpoint(state, path, names=NAMES)
    assert _complete(path) is None


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_checkpoint_of_the_format_before_the_marker_loads_and_is_replaced(
    world: World, n: int, tmp_path: Any
) -> None:
    """The format before: the link and its version, without the marker file."""
    root = _shared_dir(world, tmp_path, "root")
    path = os.path.join(root, "ckpt")
    _, _, state = _trained(world)
    save_checkpoint(state, path, names=NAMES)
    old = os.path.realpath(path)
    dist.barrier()
    if world.rank == 0:
        os.remove(os.path.join(old, ".shardopt_checkpoint"))
    dist.barrier()
    fresh = _trained(world, seed=5.0)[2]
    load_checkpoint(fresh, path, names=NAMES)
    assert [t.tolist() for t in _tensors(fresh)] == [t.tolist() for t in _tensors(state)]
    save_checkpoint(state, path, names=NAMES, overwrite=True)
    assert os.path.realpath(path) != old
    assert not os.path.exists(old)  # the version the link named: removed once superseded
    assert _complete(path) is None


LOOK_ALIKES = {  # leftover names that shardopt did not mark: never removed
    "ckpt.v-00000000000000aa": "a directory named like a version, without the marker",
    "ckpt.link-00000000000000bb": "a regular file named like a link",
    "ckpt.tmp-00000000000000cc": "an older shardopt's name",
    "ckpt.old-00000000000000dd": "an older shardopt's name",
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_names_like_leftovers_without_the_marker_survive_saves_over_the_path(
    world: World, n: int, tmp_path: Any
) -> None:
    root = _shared_dir(world, tmp_path, "root")
    path = os.path.join(root, "ckpt")
    if world.rank == 0:
        for name in LOOK_ALIKES:
            if "link" in name:
                with open(os.path.join(root, name), "w") as f:
                    f.write("user data")
            else:
                os.makedirs(os.path.join(root, name, "inside"))
    dist.barrier()
    _, _, state = _trained(world)
    for _ in range(2):
        save_checkpoint(state, path, names=NAMES, overwrite=True)
    names = set(os.listdir(root))
    assert set(LOOK_ALIKES) <= names
    assert os.path.isdir(os.path.join(root, "ckpt.v-00000000000000aa", "inside"))
    assert len([n for n in names if n.startswith("ckpt.v-")]) == 2  # the look-alike, the current


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_users_file_at_the_lock_name_is_refused_and_kept(
    world: World, n: int, tmp_path: Any
) -> None:
    root = _shared_dir(world, tmp_path, "root")
    path = os.path.join(root, "ckpt")
    if world.rank == 0:
        with open(f"{path}.lock", "w") as f:
            f.write("my lock notes")
    dist.barrier()
    _, _, state = _trained(world)
    with pytest.raises(ValueError, match=r"to be absent or shardopt's lock file, got a file of 13"):
        save_checkpoint(state, path, names=NAMES)
    with open(f"{path}.lock") as f:
        assert f.read() == "my lock notes"
    assert not os.path.lexists(path)


# ---- 2. Concurrent saves of independent jobs ----------------------------------------------


def _concurrently(run_world: Callable[..., list[Any]], jobs: list[tuple[Any, ...]]) -> list[Any]:
    """Runs each job (``fn, world_size, *args``) as its own world (independent process groups,
    stores and processes), all at once; their results, in order."""
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = run_world(*jobs[i])
        except BaseException as exc:  # (reported below)
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return results


def _job_state(world_size: int, job: int) -> Any:
    return _trained(_World(world_size), seed=1.0 + job)[2]


class _World:
    def __init__(self, world_size: int) -> None:
        self.world_size = world_size


def _complete(path: str) -> str | None:
    """Why the checkpoint at ``path`` is not complete (None: it is): the version it points to
    has readable metadata and every byte that the metadata names. A version removed while
    being checked was superseded: the check moves to the new one."""
    why = "never looked"
    for _ in range(20):
        version = os.path.realpath(path)
        why = _missing(version)
        if why is None or os.path.realpath(path) == version:
            return why
    return why


def _missing(version: str) -> str | None:
    try:
        with open(os.path.join(version, ".metadata"), "rb") as f:
            md = safe_metadata(f.read(), ".metadata")
        for index, info in md.storage_data.items():
            size = os.path.getsize(os.path.join(version, info.relative_path))
            if size < info.offset + info.length:
                return f"{info.relative_path} cut short ({index.fqn})"
    except (OSError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def _tag(job: int, round_: int) -> torch.Tensor:
    return torch.tensor([job, round_], dtype=torch.int64)


def racing_job(rank: int, world_size: int, root: str, job: int, rounds: int) -> list[Any]:
    """One job's saves (``overwrite=True``) to ``root/ckpt``, each tagged (job, round): per
    round, whether it returned OK (and then why the path is not complete, None if it is) or the
    error, and when it returned."""
    path = os.path.join(root, "ckpt")
    state = _job_state(world_size, job)
    outcomes = []
    for r in range(rounds):
        try:
            save_checkpoint(state, path, names=NAMES, overwrite=True, extra={"tag": _tag(job, r)})
        except ValueError as exc:
            outcomes.append(("lost", r, time.time(), str(exc)))
            continue
        outcomes.append(("ok", r, time.time(), _complete(path)))
    return outcomes


def loaded_tag(rank: int, world_size: int, path: str) -> list[int]:
    tag = torch.zeros(2, dtype=torch.int64)
    load_checkpoint(_job_state(world_size, 0), path, names=NAMES, extra={"tag": tag})
    return tag.tolist()


@pytest.mark.parametrize("size", [1, 2], ids=["W1", "W2"])
def test_two_jobs_racing_on_one_path_never_return_ok_without_a_complete_checkpoint(
    run_world: Callable[..., list[Any]], size: int, tmp_path: Any
) -> None:
    """Two jobs of ``size`` ranks (two worlds) save to one path 12 times each, at once: a save
    returns OK only with a complete checkpoint at the path, else raises the lock's error, on
    every rank of its job; at the end the path holds what the last save that returned OK
    saved."""
    root = str(tmp_path)
    jobs = [(racing_job, size, root, job, 12) for job in range(2)]
    results = _concurrently(run_world, jobs)
    for job, ranks in enumerate(results):
        kinds = [[o[:2] for o in r] for r in ranks]
        assert all(k == kinds[0] for k in kinds), f"job {job}: its ranks disagree: {kinds}"
        assert all(o[3] is None for r in ranks for o in r if o[0] == "ok"), f"job {job}"
        ok = [o for o in ranks[0] if o[0] == "ok"]
        assert [o for o in ok if o[3] is not None] == [], f"job {job}: OK without a checkpoint"
        lost = [o[3] for o in ranks[0] if o[0] == "lost"]
        assert [m for m in lost if "expected no other save writing to" not in m] == []
    oks = [(o[2], job, o[1]) for job, ranks in enumerate(results) for o in ranks[0] if o[0] == "ok"]
    assert oks, "no save succeeded"
    assert run_world(loaded_tag, 1, os.path.join(root, "ckpt"))[0] == list(max(oks)[1:])
    assert sorted(os.listdir(root))[:1] == ["ckpt"]
    assert len([n for n in os.listdir(root) if ".v-" in n]) == 1  # nothing else left


class _Waiting(FileSystemWriter):
    """Writes, then waits (holding the lock) until the other job has tried to save."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        root = os.path.dirname(os.path.dirname(os.fspath(self.path)))
        open(os.path.join(root, "flags", "writing"), "w").close()
        deadline = time.monotonic() + 30
        while not os.path.exists(os.path.join(root, "flags", "tried")):
            assert time.monotonic() < deadline, "the other job never tried"
            time.sleep(0.01)
        return super().write_data(plan, planner)


def holding_job(rank: int, world_size: int, root: str) -> str:
    state = _job_state(world_size, 0)
    path = os.path.join(root, "ck", "ckpt")
    save_checkpoint(state, path, names=NAMES, writer=_Waiting, extra={"tag": _tag(0, 0)})
    return "ok"


def trying_job(rank: int, world_size: int, root: str) -> str:
    state = _job_state(world_size, 1)
    while not os.path.exists(os.path.join(root, "flags", "writing")):
        time.sleep(0.01)
    try:
        path = os.path.join(root, "ck", "ckpt")
        save_checkpoint(state, path, names=NAMES, overwrite=True, extra={"tag": _tag(1, 0)})
        error = "no error"
    except ValueError as exc:
        error = str(exc)
    dist.barrier()
    if rank == 0:
        open(os.path.join(root, "flags", "tried"), "w").close()
    return error


@pytest.mark.parametrize("size", [1, 2], ids=["W1", "W2"])
def test_a_save_while_another_job_writes_fails_naming_the_holder_and_removes_nothing(
    run_world: Callable[..., list[Any]], size: int, tmp_path: Any
) -> None:
    """Job 0 holds the lock, mid-write, until job 1 has tried (``overwrite=True``) and failed
    on each of its ranks; job 0's save then completes and is what the path holds."""
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "flags"))
    os.makedirs(os.path.join(root, "ck"))
    held, tried = _concurrently(run_world, [(holding_job, size, root), (trying_job, size, root)])
    path = os.path.join(root, "ck", "ckpt")
    assert held == ["ok"] * size
    for error in tried:
        assert error.startswith(f"save_checkpoint: expected no other save writing to '{path}'")
        assert "held by pid " in error, error
        assert "since" in error, error
    assert _complete(path) is None
    assert run_world(loaded_tag, 1, path)[0] == [0, 0]
    assert sorted(os.listdir(os.path.join(root, "ck")))[0] == "ckpt"
    assert not os.path.exists(f"{path}.lock")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_lock_left_by_a_dead_save_is_stale_and_taken_over(
    world: World, n: int, tmp_path: Any
) -> None:
    root = _shared_dir(world, tmp_path, "root")
    path = os.path.join(root, "ckpt")
    if world.rank == 0:  # what a save killed while holding the lock leaves: its record, unlocked
        with open(f"{path}.lock", "w") as f:
            f.write('{"lock": "shardopt checkpoint lock", "pid": 999999, "host": "h", "since": 0}')
    dist.barrier()
    _, _, state = _trained(world)
    save_checkpoint(state, path, names=NAMES)
    assert _complete(path) is None
    assert not os.path.exists(f"{path}.lock")


# ---- 3. Loading never executes code from the files ----------------------------------------


class Payload:
    """Unpickling it creates the file ``marker``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def _metadata(version: str) -> Any:
    with open(os.path.join(version, ".metadata"), "rb") as f:
        return pickle.load(f)  # (the test's own good file)


def _write_metadata(version: str, md: Any) -> None:
    with open(os.path.join(version, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _plant(version: str, fqn: str, payload: Any, *, as_bytes: bool) -> None:
    """Replaces every saved item of ``fqn`` by ``torch.save(payload)`` in a file of its own;
    ``as_bytes``: the metadata calls it a pickled value (else it keeps its tensor metadata)."""
    md = _metadata(version)
    buf = io.BytesIO()
    torch.save(payload, buf)
    with open(os.path.join(version, "planted.distcp"), "wb") as f:
        f.write(buf.getvalue())
    indices = [i for i in md.storage_data if i.fqn == fqn]
    assert indices, f"no {fqn} in {sorted({i.fqn for i in md.storage_data})}"
    for i in indices:
        del md.storage_data[i]
    if as_bytes:
        md.state_dict_metadata[fqn] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(fqn)] = _StorageInfo("planted.distcp", 0, len(buf.getvalue()))
    else:
        for c in md.state_dict_metadata[fqn].chunks:
            index = MetadataIndex(fqn, c.offsets)
            md.storage_data[index] = _StorageInfo("planted.distcp", 0, len(buf.getvalue()))
    _write_metadata(version, md)


def _evil_metadata(version: str, marker: str) -> None:
    with open(os.path.join(version, ".metadata"), "wb") as f:
        pickle.dump(Payload(marker), f)


def _evil_inside_metadata(version: str, marker: str) -> None:
    md = _metadata(version)
    md.planner_data = {"x": Payload(marker)}
    _write_metadata(version, md)


CRAFTED: dict[str, tuple[Callable[[str, str], None], str]] = {  # how, and the error's words
    ".metadata is a payload": (_evil_metadata, "got the global builtins.exec"),
    ".metadata holds a payload": (_evil_inside_metadata, "got the global builtins.exec"),
    "hyperparameter lr": (
        lambda v, m: _plant(v, "optim.hyperparams.lr", Payload(m), as_bytes=True),
        "expected optim.hyperparams.lr to hold tensors or plain values only",
    ),
    "master weights, as a pickled value": (
        lambda v, m: _plant(v, "optim.master_weights.w", Payload(m), as_bytes=True),
        "expected optim.master_weights.w to be a tensor, got BytesStorageMetadata",
    ),
    "master weights, in the tensor's bytes": (
        lambda v, m: _plant(v, "optim.master_weights.w", Payload(m), as_bytes=False),
        "expected optim.master_weights.w to hold tensors or plain values only",
    ),
    "optimizer state, in the tensor's bytes": (
        lambda v, m: _plant(v, "optim.state.w.exp_avg", Payload(m), as_bytes=False),
        "expected optim.state.w.exp_avg to hold tensors or plain values only",
    ),
    "extra value": (
        lambda v, m: _plant(v, "epoch", Payload(m), as_bytes=True),
        "expected epoch to hold tensors or plain values only",
    ),
    "extra tensor": (
        lambda v, m: _plant(v, "model.w", Payload(m), as_bytes=True),
        "expected model.w to be a tensor, got BytesStorageMetadata",
    ),
}


def _saved(world: World, root: str) -> tuple[Any, str, str]:
    """(a fresh state to load into, the saved path, its version directory)."""
    _sharded, params, state = _trained(world)
    path = os.path.join(root, "ckpt")
    save_checkpoint(state, path, names=NAMES, extra={"epoch": 3, "model": dict(zip(NAMES, params))})
    fresh = _trained(world, seed=5.0)[2]
    return fresh, path, os.path.realpath(path)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_crafted_checkpoint_runs_no_code_and_is_refused_naming_the_entry(
    world: World, n: int, tmp_path: Any
) -> None:
    def run(case: str, root: str) -> None:
        fresh, path, version = _saved(world, root)
        marker = os.path.join(root, "PWNED")
        craft, says = CRAFTED[case]
        if world.rank == 0:
            craft(version, marker)
        dist.barrier()
        snap = _snapshot(fresh)
        model = {name: torch.zeros(s, dtype=torch.bfloat16) for name, s in zip(NAMES, SHAPES)}
        extra = {"epoch": 0, "model": model}
        with pytest.raises(Exception) as info:
            load_checkpoint(fresh, path, names=NAMES, extra=extra)
        assert info.type in (ValueError, CheckpointError), info.value
        assert str(info.value).startswith("load_checkpoint: "), str(info.value)
        assert says in str(info.value), str(info.value)
        assert not os.path.exists(marker)
        assert _unchanged(fresh, snap)
        assert extra["epoch"] == 0
        assert all(not t.any() for t in model.values())

    _every_case(world, tmp_path, list(CRAFTED), run)


# ---- 4. A load loads everything or changes nothing ----------------------------------------


def _half_chunks(version: str, fqn: str) -> None:
    md = _metadata(version)
    entry = md.state_dict_metadata[fqn]
    first = entry.chunks[0]
    rows = max(1, first.sizes[0] // 2) if len(first.sizes) else 1
    entry.chunks = [ChunkStorageMetadata(first.offsets, torch.Size([rows, *first.sizes[1:]]))]
    _write_metadata(version, md)


def _as_bool(version: str, fqn: str, *, in_metadata: bool) -> None:
    """``fqn``'s saved chunks as bool tensors (7.0 would load as 1.0); the metadata's dtype too
    (``in_metadata``) or only the data."""
    md = _metadata(version)
    blobs = []
    for index in [i for i in md.storage_data if i.fqn == fqn]:
        info = md.storage_data[index]
        with open(os.path.join(version, info.relative_path), "rb") as f:
            f.seek(info.offset)
            tensor = torch.load(io.BytesIO(f.read(info.length)), weights_only=True)
        buf = io.BytesIO()
        torch.save(tensor.bool(), buf)
        blobs.append((index, buf.getvalue()))
    with open(os.path.join(version, "bool.distcp"), "wb") as f:
        offset = 0
        for index, blob in blobs:
            f.write(blob)
            md.storage_data[index] = _StorageInfo("bool.distcp", offset, len(blob))
            offset += len(blob)
    if in_metadata:
        md.state_dict_metadata[fqn].properties.dtype = torch.bool
    _write_metadata(version, md)


def _truncated(version: str) -> None:
    for name in os.listdir(version):
        if name.endswith(".distcp"):
            size = os.path.getsize(os.path.join(version, name))
            os.truncate(os.path.join(version, name), size // 2)


def _malformed(version: str) -> None:
    md = _metadata(version)
    md.state_dict_metadata[7] = "not metadata"
    _write_metadata(version, md)


DAMAGED: dict[str, tuple[Callable[[str], None], type, str]] = {
    "chunks covering half of exp_avg": (
        lambda v: _half_chunks(v, "optim.state.w.exp_avg"),
        CheckpointError,
        "expected optim.state.w.exp_avg to be saved whole, got chunks covering",
    ),
    "exp_avg saved as bool": (
        lambda v: _as_bool(v, "optim.state.w.exp_avg", in_metadata=True),
        CheckpointError,
        "expected optim.state.w.exp_avg of dtype torch.float32, got torch.bool",
    ),
    "exp_avg's data bool, its metadata float32": (
        lambda v: _as_bool(v, "optim.state.w.exp_avg", in_metadata=False),
        CheckpointError,
        "to hold a tensor of torch.float32 as its metadata says, got torch.bool",
    ),
    "truncated data files": (_truncated, CheckpointError, "(a truncated file)"),
    "an entry of malformed metadata": (
        _malformed,
        ValueError,
        "expected each entry to be a key with DCP's tensor or bytes metadata, got 7: str",
    ),
}


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_damaged_checkpoint_raises_and_leaves_the_state_as_it_was(
    world: World, n: int, tmp_path: Any
) -> None:
    def run(case: str, root: str) -> None:
        fresh, path, version = _saved(world, root)
        damage, kind, says = DAMAGED[case]
        if world.rank == 0:
            damage(version)
        dist.barrier()
        snap = _snapshot(fresh)
        try:
            load_checkpoint(fresh, path, names=NAMES)
        except Exception as exc:  # CheckpointError is an Exception (DCP's own is not)
            error: Exception | None = exc
        else:
            error = None
        assert type(error) is kind, repr(error)
        assert str(error).startswith("load_checkpoint: "), str(error)
        assert says in str(error), str(error)
        assert _unchanged(fresh, snap)

    _every_case(world, tmp_path, list(DAMAGED), run)


def _read_as(mode: str) -> None:
    """Makes this rank's loads read each item whole into memory, or through a file slice."""
    from shardopt.functional.checkpoint import _safe_load

    _safe_load.WHOLE_BYTES = 1 << 62 if mode == "in memory" else 0


READS = ["in memory", "as a file slice"]


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_truncated_file_read_either_way_raises_and_leaves_the_state(
    world: World, n: int, tmp_path: Any
) -> None:
    def run(mode: str, root: str) -> None:
        _read_as(mode)
        fresh, path, version = _saved(world, root)
        if world.rank == 0:
            _truncated(version)
        dist.barrier()
        snap = _snapshot(fresh)
        with pytest.raises(CheckpointError, match=r"\(a truncated file\)"):
            load_checkpoint(fresh, path, names=NAMES)
        assert _unchanged(fresh, snap)

    _every_case(world, tmp_path, READS, run)


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_good_checkpoint_still_loads_every_entry(world: World, n: int, tmp_path: Any) -> None:
    """The control of the cases above: the undamaged save loads, changing the state."""

    def run(mode: str, root: str) -> None:
        _read_as(mode)
        fresh, path, _ = _saved(world, root)
        snap = _snapshot(fresh)
        model = {name: torch.zeros(s, dtype=torch.bfloat16) for name, s in zip(NAMES, SHAPES)}
        extra = {"epoch": 0, "model": model}
        load_checkpoint(fresh, path, names=NAMES, extra=extra)
        assert not _unchanged(fresh, snap)
        _, params, saved = _trained(world)
        assert [t.tolist() for t in _tensors(fresh)] == [t.tolist() for t in _tensors(saved)]
        assert extra["epoch"] == 3
        assert all(torch.equal(model[name], p) for name, p in zip(NAMES, params))

    _every_case(world, tmp_path, READS, run)


# ---- 5. Failures reach users as an Exception naming the API ------------------------------


class _FailingWriter(FileSystemWriter):
    def write_data(self, plan: Any, planner: Any) -> Any:
        raise OSError("disk full (a stand-in)")


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.world("n", backend="gloo", timeout=60)
def test_a_failed_write_raises_checkpoint_error_an_exception_naming_the_api(
    world: World, n: int, tmp_path: Any
) -> None:
    root = _shared_dir(world, tmp_path, "root")
    _, _, state = _trained(world)
    writer = _FailingWriter if world.rank == n - 1 else FileSystemWriter
    with pytest.raises(CheckpointError) as info:
        save_checkpoint(state, os.path.join(root, "ckpt"), names=NAMES, writer=writer)
    assert isinstance(info.value, Exception)
    assert str(info.value).startswith(f"save_checkpoint: failed on rank(s) [{n - 1}]; rank")
    assert "OSError: disk full (a stand-in)" in str(info.value)
    dist.barrier()
    assert os.listdir(root) == []
