"""torch.distributed.checkpoint: save at one world size and plan, resume at another, atomically."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from shardopt.core import (
    DEFAULT_BUCKET_NUMEL,
    adam,
    adamw,
    apply_updates,
    multi_steps,
    plan_partition,
    sgd,
)
from shardopt.functional import (
    consolidate_state_dict,
    load_checkpoint,
    save_checkpoint,
    shard,
    torch_hyperparams,
)
from shardopt.functional.checkpoint._publish import mark

from _functional_helpers import rel_error, seeded_params, sixty_fourths, state_equal

F32, F64 = torch.float32, torch.float64
# Mixed dtypes, a 0-d parameter, and shapes that flat plans cut across ranks (so that saved
# tensors are written as several boxes per rank, see [Note: DCP pieces]). Tensor 3 is frozen.
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((7, 5), F32),
    ((5,), F32),
    ((3, 4, 2), F64),
    ((4,), F32),
    ((13,), F32),
    ((), F64),
    ((6, 6), F32),
]
NAMES = ["enc.weight", "enc.bias", "conv.weight", "frozen.bias", "head.weight", "scale", "out.w"]
FROZEN = 3
BEFORE, AFTER = 3, 3  # steps before the checkpoint, and after resuming from it
RTOL = {F32: 1e-6, F64: 1e-12}

# name: (our factory, torch class, torch kwargs). The torch runs use the kernels core's flat
# rules call on whole tensors (fused Adam/AdamW), so that whole-tensor updates are bitwise equal.
OPTIMIZERS: dict[str, tuple[Callable[[], Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "sgd": (lambda: sgd(0.25, momentum=0.5), torch.optim.SGD, {"lr": 0.25, "momentum": 0.5}),
    "adam": (lambda: adam(1e-2), torch.optim.Adam, {"lr": 1e-2, "fused": True}),
    "adamw_amsgrad": (
        lambda: adamw(1e-2, weight_decay=0.1, amsgrad=True),
        torch.optim.AdamW,
        {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "fused": True},
    ),
}

# Saved cases: (optimizer, plan strategy, stage) before the checkpoint.
SAVED = [("sgd", "flat", 1), ("sgd", "greedy", 2), ("adam", "greedy", 2)]
SAVED += [("adamw_amsgrad", "greedy", 1), ("adam", "flat", 1)]
# How each saved case resumes at each world size: (plan strategy, stage), flat <-> greedy.
RESUMED = {
    1: [("greedy", 2), ("flat", 1), ("greedy", 1), ("greedy", 2), ("flat", 2)],
    2: [("greedy", 2), ("flat", 1), ("greedy", 1), ("greedy", 2), ("greedy", 2)],
    3: [("flat", 2), ("flat", 1), ("greedy", 1), ("greedy", 2), ("flat", 1)],
    4: [("greedy", 1), ("flat", 2), ("greedy", 2), ("greedy", 1), ("flat", 2)],
}


# The bucket_numel of each saved case, and of each resumed one (case i at world W takes entry
# (i + W) % 5): one bucket per group, about one tensor per bucket, a few tensors, the default.
BUCKETS: list[int | None] = [None, 16, DEFAULT_BUCKET_NUMEL, 40, 8]


def resumed_bucket(world: int, i: int) -> int | None:
    return BUCKETS[(i + world) % len(BUCKETS)]


def initial_params() -> list[torch.Tensor]:
    return seeded_params(SHAPES)


def grads(step: int) -> list[torch.Tensor | None]:
    """The gradients of ``step``, the same on every rank: multiples of 1/64, so that the rank
    average (sum, then / W) is exactly them whatever the world size."""
    return sixty_fourths(SHAPES, 100 + step, lambda i: i == FROZEN)


def torch_reference(name: str, steps: int) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Single-process torch.optim, uninterrupted: parameters and state dict after ``steps``."""
    _, cls, kwargs = OPTIMIZERS[name]
    ref = [p.requires_grad_(i != FROZEN) for i, p in enumerate(initial_params())]
    opt = cls(ref, **kwargs)
    for step in range(steps):
        for p, g in zip(ref, grads(step)):
            p.grad = g
        opt.step()
    return [p.detach() for p in ref], opt.state_dict()


def make_sharded(
    name: str,
    params: list[torch.Tensor],
    world: int,
    strategy: str,
    stage: int,
    bucket: int | None = DEFAULT_BUCKET_NUMEL,
):
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(OPTIMIZERS[name][0](), plan, stage=stage)
    return sharded, sharded.init(params)


def save_cases(rank: int, world: int, root: str) -> list[dict[str, Any] | None]:
    """Trains every saved case for BEFORE steps, saves it with the model parameters, and returns
    (rank 0) its consolidated state, to compare with what the resumed runs load."""
    out = []
    for i, (name, strategy, stage) in enumerate(SAVED):
        params = initial_params()
        sharded, state = make_sharded(name, params, world, strategy, stage, BUCKETS[i])
        for step in range(BEFORE):
            state = sharded.step(params, grads(step), state)
        hyper = torch_hyperparams(OPTIMIZERS[name][1], **OPTIMIZERS[name][2])
        save_checkpoint(
            state,
            os.path.join(root, f"case{i}"),
            names=NAMES,
            param_groups=hyper,
            extra={"model": dict(zip(NAMES, params))},
        )
        out.append(consolidate_state_dict(state, hyper))
    return out


def resume_cases(
    rank: int, world: int, root: str, saved: list[dict[str, Any]]
) -> list[tuple[bool, bool, float]]:
    """Loads every case at this world size (another plan, another stage) into fresh zero
    parameters and state, and trains AFTER more steps. Per case: whether the loaded state equals
    the saved one bitwise, whether the parameters then equal the uninterrupted torch run's
    bitwise, and their largest relative error."""
    rows = []
    for i, ((name, _, _), (strategy, stage)) in enumerate(zip(SAVED, RESUMED[world])):
        params = [torch.zeros_like(p) for p in initial_params()]  # the checkpoint fills them
        sharded, state = make_sharded(
            name, params, world, strategy, stage, resumed_bucket(world, i)
        )
        path = os.path.join(root, f"case{i}")
        load_checkpoint(state, path, names=NAMES, extra={"model": dict(zip(NAMES, params))})
        hyper = torch_hyperparams(OPTIMIZERS[name][1], **OPTIMIZERS[name][2])
        loaded = consolidate_state_dict(state, hyper)
        for step in range(BEFORE, BEFORE + AFTER):
            state = sharded.step(params, grads(step), state)
        ref, _ = torch_reference(name, BEFORE + AFTER)
        errors = [rel_error(a, b) for a, b in zip(params, ref)]
        same = all(torch.equal(a, b) for a, b in zip(params, ref))
        rows.append((rank != 0 or state_equal(loaded, saved[i]), same, max(errors)))
    return rows


def bitwise_expected(world: int, i: int) -> bool:
    """Where resuming is bitwise equal to the uninterrupted torch run: SGD with lr 1/4 and
    momentum 1/2 on these gradients computes every product exactly, so each parameter update is
    one rounding whatever the split; Adam(W) is not exact, but on greedy plans (or one rank)
    every tensor is updated whole by torch's own fused kernel, before and after the checkpoint."""
    name, saved_strategy, _ = SAVED[i]
    strategy = RESUMED[world][i][0]
    whole = saved_strategy == "greedy" and (strategy == "greedy" or world == 1)
    return name == "sgd" or whole


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory) -> tuple[str, list[dict[str, Any]]]:
    root = str(tmp_path_factory.mktemp("dcp4"))
    from shardopt.testing import spawn

    saved = spawn(save_cases, 4, root, backend="gloo", timeout=120.0)[0]
    return root, saved


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_checkpoint_saved_at_4_ranks_resumes_at_1_2_3_like_an_uninterrupted_run(
    run_world, saved_at_4, world
):
    """Save at W=4 after 3 steps, load at W (another plan and stage, into zeroed parameters:
    the model's values come from the checkpoint's ``extra``), 3 more steps.

    The gradients are the same on every rank and multiples of 1/64, so every world size sees
    the same averaged gradients and an uninterrupted single-process torch.optim run is the
    reference. The loaded state is bitwise the saved one in every case; the parameters are then
    bitwise torch's where the arithmetic cannot depend on the split (see bitwise_expected), and
    within float tolerance where a flat plan cut Adam's tensors across ranks.
    """
    root, saved = saved_at_4
    results = run_world(resume_cases, world, root, saved)
    for rank, rows in enumerate(results):
        for i, (transferred, bitwise, error) in enumerate(rows):
            where = (
                f"rank {rank}, case {SAVED[i]}, {BUCKETS[i]} -> {RESUMED[world][i]}, "
                f"{resumed_bucket(world, i)}"
            )
            assert transferred, f"{where}: the loaded state differs from the saved one"
            if bitwise_expected(world, i):
                assert bitwise, f"{where}: not bitwise equal to torch (error {error:.2e})"
            assert error <= 1e-6, f"{where}: relative error {error:.2e}"


def test_a_checkpoint_saved_at_2_ranks_resumes_at_4(run_world, tmp_path):
    root = str(tmp_path)
    saved = run_world(save_cases, 2, root)[0]
    for rank, rows in enumerate(run_world(resume_cases, 4, root, saved)):
        for i, (transferred, bitwise, error) in enumerate(rows):
            where = (
                f"rank {rank}, case {SAVED[i]}, {BUCKETS[i]} -> {RESUMED[4][i]}, "
                f"{resumed_bucket(4, i)}"
            )
            assert transferred, f"{where}: the loaded state differs from the saved one"
            assert bitwise or not bitwise_expected(4, i), f"{where}: error {error:.2e}"
            assert error <= 1e-6, f"{where}: relative error {error:.2e}"


def test_the_checkpoint_is_torchs_fqn_layout_and_loads_into_plain_torch_optim(saved_at_4, tmp_path):
    """DCP's own converter turns the directory into a torch.save file whose ``optim`` entry a
    single-process torch.optim loads (keys are parameter names, tensors full-shape), giving
    exactly the state that consolidation gives."""
    root, saved = saved_at_4
    for i, (name, _, _) in enumerate(SAVED):
        dcp_to_torch_save(os.path.join(root, f"case{i}"), str(tmp_path / f"case{i}.pt"))
        data = torch.load(tmp_path / f"case{i}.pt", weights_only=False)
        assert sorted(data) == ["model", "optim"]
        assert sorted(data["model"]) == sorted(NAMES)
        params = [torch.nn.Parameter(data["model"][n]) for n in NAMES]
        _, cls, kwargs = OPTIMIZERS[name]
        opt = cls(params, **kwargs)
        opt.load_state_dict(data["optim"])
        loaded = opt.state_dict()
        if name == "sgd":  # SGD's count rides along as "step"; torch.optim.SGD ignores it
            assert all(entry.pop("step") == BEFORE for entry in loaded["state"].values())
        assert state_equal(loaded, saved[i]), f"case {SAVED[i]}"


def accumulate(rank: int, world: int, root: str, save: bool) -> list[torch.Tensor]:
    """``multi_steps(adam, 2)``, a state torch.optim has no keys for (accumulated gradients,
    a replicated micro-step counter): 3 micro-steps, save mid-window at W; or load at W,
    2 more micro-steps. Greedy plans, so every tensor is updated whole (see bitwise_expected)."""
    params = initial_params() if save else [torch.zeros_like(p) for p in initial_params()]
    sharded = shard(multi_steps(adam(1e-2), 2), plan_partition(params, world, strategy="greedy"))
    state = sharded.init(params)
    path = os.path.join(root, "accumulate")
    model = {"model": dict(zip(NAMES, params))}
    steps = range(3) if save else range(3, 5)
    if not save:
        load_checkpoint(state, path, extra=model)
    for step in steps:
        state = sharded.step(params, grads(step), state)
    if save:
        save_checkpoint(state, path, extra=model)
    return params


def test_a_transformation_without_torch_keys_resumes_mid_accumulation(run_world, tmp_path):
    """The generic path: fields keyed by their paths, the replicated counter saved once. The
    reference is the pure core transformation on one process, uninterrupted."""
    run_world(accumulate, 2, str(tmp_path), True)
    resumed = run_world(accumulate, 3, str(tmp_path), False)
    tx = multi_steps(adam(1e-2), 2)
    ref = initial_params()
    ref_state = tx.init(ref)
    for step in range(5):
        updates, ref_state = tx.update(grads(step), ref_state, ref)
        ref = apply_updates(ref, updates)
    for rank, params in enumerate(resumed):
        for i, (a, b) in enumerate(zip(params, ref)):
            assert torch.equal(a, b), f"rank {rank}, tensor {i}: {rel_error(a, b):.2e}"


class FailingWriter(FileSystemWriter):
    """Writes part of its files, then fails: a rank dying mid-save, as far as DCP can tell."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        super().write_data(plan, planner).wait()
        raise OSError("disk full (simulated)")


def failed_save(rank: int, world: int, root: str) -> tuple[str, list[str], list[str], str]:
    """A save whose rank 1 fails mid-write, then a good save, then one over it (refused unless
    ``overwrite``). Returns the error, the directory after the failure and at the end."""
    params = initial_params()
    sharded, state = make_sharded("adam", params, world, "flat", 1)
    state = sharded.step(params, grads(0), state)
    target = os.path.join(root, "ckpt")
    writer = FailingWriter if rank == 1 else FileSystemWriter
    try:
        save_checkpoint(state, target, writer=writer)
    except Exception as exc:  # shardopt's CheckpointError (DCP's CheckpointException is not one)
        error = type(exc).__name__
    else:
        error = "none"
    after_failure = sorted(os.listdir(root))
    torch.distributed.barrier()  # (before rank 0's next save takes its lock)
    save_checkpoint(state, target)
    try:
        save_checkpoint(state, target)
    except ValueError as exc:
        refused = str(exc)
    else:
        refused = "none"
    save_checkpoint(state, target, overwrite=True)
    return error, after_failure, sorted(os.listdir(root)), refused


def test_a_save_that_fails_on_one_rank_leaves_nothing_at_the_path(run_world, tmp_path):
    for rank, (error, after_failure, at_end, refused) in enumerate(
        run_world(failed_save, 2, str(tmp_path))
    ):
        assert error == "CheckpointError", f"rank {rank}"
        assert after_failure == [], f"rank {rank}: left {after_failure}"
        masked = [re.sub(r"-[0-9a-f]{16}$", "-*", n) for n in at_end]
        assert masked == ["ckpt", "ckpt.v-*"], f"rank {rank}: left {at_end}"
        assert "save_checkpoint: expected a path that does not exist" in refused, f"rank {rank}"


def load_errors(rank: int, world: int, root: str) -> list[str]:
    """Loads that must fail, on every rank alike and before any data is read."""
    params = initial_params()
    sharded, state = make_sharded("adam", params, world, "flat", 2)
    save_checkpoint(state, os.path.join(root, "fresh"), names=NAMES)  # no state yet
    state = sharded.step(params, grads(0), state)
    path = os.path.join(root, "adam")
    save_checkpoint(state, path, names=NAMES)
    fresh = [torch.zeros_like(p) for p in params]
    attempts = {
        "sgd state": lambda: load_checkpoint(
            make_sharded("sgd", fresh, world, "greedy", 1)[1], path, names=NAMES
        ),
        "amsgrad state": lambda: load_checkpoint(
            make_sharded("adamw_amsgrad", fresh, world, "greedy", 1)[1], path, names=NAMES
        ),
        "other names": lambda: load_checkpoint(
            make_sharded("adam", fresh, world, "flat", 1)[1], path
        ),
        "no checkpoint": lambda: load_checkpoint(
            make_sharded("adam", fresh, world, "flat", 1)[1], os.path.join(root, "none")
        ),
        "stepped state": lambda: load_checkpoint(state, os.path.join(root, "fresh"), names=NAMES),
    }
    messages = []
    for what, attempt in attempts.items():
        try:
            attempt()
        except ValueError as exc:
            messages.append(f"{what}: {exc}")
        else:
            messages.append(f"{what}: no error")
    return messages


def test_load_checkpoint_refuses_another_optimizer_names_or_path_on_every_rank(run_world, tmp_path):
    results = run_world(load_errors, 2, str(tmp_path))
    for rank, messages in enumerate(results):
        for message in messages:
            assert "load_checkpoint: expected" in message, f"rank {rank}: {message}"
    first = results[0]
    assert "state keys among those of this optimizer" in first[0]
    assert "keys ['step', 'exp_avg', 'exp_avg_sq', 'max_exp_avg_sq']" in first[1]
    assert "state keys among" in first[2]
    assert "a readable checkpoint" in first[3]
    assert "count 1" in first[4] or "valid input on every rank" in first[4]


class Crash(BaseException):
    """A process dying at this point (no except clause catches it)."""


def described(name: str, args: tuple[Any, ...]) -> str:
    """A filesystem call on base names, tokens masked: ``"rename ckpt -> ckpt.old-*"``."""
    paths = [os.path.basename(os.fspath(a)) for a in args if isinstance(a, (str, os.PathLike))]
    return f"{name} " + " -> ".join(re.sub(r"-[0-9a-f]{16}$", "-*", p) for p in paths)


@contextlib.contextmanager
def crash_at(k: int | str | None, calls: list[str]) -> Iterator[None]:
    """Records every filesystem rename, link and removal inside in ``calls``; the ``k``-th (from
    0), or the first described as ``k``, and every later one raise Crash instead of running: the
    process died there (None: none does)."""
    real = {
        "rename": os.rename,
        "replace": os.replace,
        "rmtree": shutil.rmtree,
        "symlink": os.symlink,
        "unlink": os.unlink,
    }
    dead = False
    removing = False  # inside an rmtree: its own unlinks are part of that one call

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            nonlocal dead, removing
            if removing:
                return real[name](*args, **kwargs)
            calls.append(described(name, args))
            dead = dead or k in (len(calls) - 1, calls[-1])
            if dead:
                raise Crash(calls[-1])
            removing = name == "rmtree"
            try:
                return real[name](*args, **kwargs)
            finally:
                removing = False

        return call

    with (
        mock.patch("os.rename", wrap("rename")),
        mock.patch("os.replace", wrap("replace")),
        mock.patch("shutil.rmtree", wrap("rmtree")),
        mock.patch("os.symlink", wrap("symlink")),
        mock.patch("os.unlink", wrap("unlink")),
    ):
        yield


COLLECTIVES = ("barrier", "broadcast")


@contextlib.contextmanager
def collectives_in(calls: list[str]) -> Iterator[None]:
    """Records the barriers and broadcasts inside (those _dcp makes: ``dist.<name>``)."""

    def recorder(name: str) -> Callable[..., Any]:
        real = getattr(torch.distributed, name)

        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            return real(*args, **kwargs)

        return call

    with (
        mock.patch("torch.distributed.barrier", recorder("barrier")),
        mock.patch("torch.distributed.broadcast", recorder("broadcast")),
    ):
        yield


def three_states() -> tuple[Any, list[torch.Tensor], list[Any]]:
    """(sharded, params, the states after 1, 2 and 3 steps): distinguishable states to save,
    each from its own run (a step may update its input state's buffers in place)."""
    states = []
    for steps in (1, 2, 3):
        params = initial_params()
        sharded, state = make_sharded("adam", params, 1, "flat", 1)
        for step in range(steps):
            state = sharded.step(params, grads(step), state)
        states.append(state)
    return sharded, params, states


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two sharded states (as torch.optim state dicts)."""
    return state_equal(consolidate_state_dict(a), consolidate_state_dict(b))


def which(sharded: Any, params: list[torch.Tensor], path: str, candidates: dict[str, Any]) -> str:
    """The name of the candidate state that ``load_checkpoint`` restores from ``path``, if
    ``torch.distributed.checkpoint`` reads ``path`` itself as the same checkpoint too."""
    got = sharded.init([torch.zeros_like(p) for p in params])
    try:
        load_checkpoint(got, path, names=NAMES)
    except ValueError as exc:
        return f"nothing ({exc})"
    name = next((name for name, s in candidates.items() if same(got, s)), "another state")
    return name if read_by_dcp(path, got) else f"{name}, but not by DCP at the path"


def read_by_dcp(path: str, state: Any) -> bool:
    """Whether DCP's own reader, pointed at ``path``, finds a complete checkpoint holding every
    state tensor of ``state`` (one rank: the sharded state is the whole state)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(os.path.dirname(path), "dcp-read.pt")
    try:
        dcp_to_torch_save(path, out)
        read = _tensors(torch.load(out, weights_only=False))
    except (Exception, torch.distributed.checkpoint.CheckpointException):  # (a BaseException)
        return False
    finally:
        if os.path.exists(out):
            os.remove(out)
    expected = [t for t in _tensors(consolidate_state_dict(state)["state"]) if t.dim() > 0]
    return bool(expected) and all(
        any(r.shape == t.shape and torch.equal(r, t) for r in read) for t in expected
    )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def crashed_save(path: str, state: Any, k: int | str) -> None:
    with contextlib.suppress(Crash), crash_at(k, []):
        save_checkpoint(state, path, names=NAMES, overwrite=True)


def seed_leftovers(path: str) -> None:
    """What crashes leave beside ``path``: a partial ``.v-*`` holding its marker (a crash
    mid-write: the marker is written first) and a ``.link-*`` to it (a crash before the commit),
    and an unlocked lock file (a crash before its removal)."""
    mark(f"{path}.v-{0xC:016x}", 0xC)
    os.symlink(f"{os.path.basename(path)}.v-{0xC:016x}", f"{path}.link-{0xD:016x}")
    with open(f"{path}.lock", "w") as f:
        f.write('{"lock": "shardopt checkpoint lock", "pid": 1, "host": "gone", "since": "-"}')


def beside(path: str) -> list[str]:
    """What is beside ``path`` but the version it points to."""
    parent, base = os.path.split(path)
    current = os.path.basename(os.path.realpath(path))
    return sorted(n for n in os.listdir(parent) if n.startswith(f"{base}.") and n != current)


def crash_once(sharded: Any, params: Any, s: list[Any], path: str, k: int) -> tuple[str, ...]:
    """State 2 saved over state 1 (a leftover of each kind beside) with a crash at call ``k``:
    what loads; then state 0 saved over it: what it leaves beside ``path``, what loads."""
    save_checkpoint(s[1], path, names=NAMES)
    seed_leftovers(path)
    crashed_save(path, s[2], k)
    got = which(sharded, params, path, {"old": s[1], "new": s[2]})
    save_checkpoint(s[0], path, names=NAMES, overwrite=True)
    return got, ", ".join(beside(path)), which(sharded, params, path, {"next": s[0]})


def crash_twice(sharded: Any, params: Any, s: list[Any], path: str, k: int, k2: int) -> str:
    """States 1 then 2 saved over state 0, crashed at calls ``k`` then ``k2``: the problem ("" if
    none) if what loads after either is not the last published state or the new one, or if the
    next save leaves anything beside ``path``."""
    named = {"s0": s[0], "s1": s[1], "s2": s[2]}
    save_checkpoint(s[0], path, names=NAMES)
    crashed_save(path, s[1], k)
    first = which(sharded, params, path, named)
    crashed_save(path, s[2], k2)
    then = which(sharded, params, path, named)
    save_checkpoint(s[0], path, names=NAMES, overwrite=True)
    if first in ("s0", "s1") and then in (first, "s2") and not beside(path):
        return ""
    return f"crashes at calls {k} then {k2}: {first} loads, then {then}; left {beside(path)}"


def crash_scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    """The calls of a save of state 2 over state 1 with a leftover of each kind beside it (its
    filesystem ``steps``, and their ``order`` with the collectives); then crashes at every step:
    a save crashed ``once`` per step, and two saves in a row crashed ``twice`` per pair."""
    sharded, params, s = three_states()
    order: list[str] = []
    path = os.path.join(root, "ckpt")
    save_checkpoint(s[1], path, names=NAMES)
    seed_leftovers(path)
    with crash_at(None, order), collectives_in(order):
        save_checkpoint(s[2], path, names=NAMES, overwrite=True)
    steps = [c for c in order if c not in COLLECTIVES]
    n = len(steps)
    once = [crash_once(sharded, params, s, os.path.join(root, f"once{k}"), k) for k in range(n)]
    twice = [
        crash_twice(sharded, params, s, os.path.join(root, f"twice{k}-{k2}"), k, k2)
        for k in range(n)
        for k2 in range(n)
    ]
    distinct = not any(same(s[i], s[j]) for i in range(3) for j in range(i))
    return {"order": order, "steps": steps, "once": once, "twice": twice, "distinct": distinct}


@pytest.fixture(scope="module")
def crashes(tmp_path_factory) -> dict[str, Any]:
    from shardopt.testing import spawn

    root = str(tmp_path_factory.mktemp("crashes"))
    return spawn(crash_scenarios, 1, root, backend="gloo", timeout=120.0)[0]


# The publish of [Note: atomic checkpoints] over a checkpoint with every kind of leftover beside
# it: per step, its filesystem call and what loads after a crash there (the call raising instead
# of running; "commit" is the commit point). The crashed save's version sorts before the
# superseded one (its token is 0...0c).
PUBLISH = {
    "link-to-the-new-version": ("symlink ckpt.v-* -> ckpt.link-*", "old"),
    "commit": ("replace ckpt.link-* -> ckpt", "old"),
    "remove-crashed-link": ("unlink ckpt.link-*", "new"),
    "remove-crashed-version": ("rmtree ckpt.v-*", "new"),
    "remove-superseded-version": ("rmtree ckpt.v-*", "new"),
    "release-the-lock": ("unlink ckpt.lock", "new"),
}


def publish_steps(crashes: dict[str, Any]) -> list[int]:
    return [k for k, call in enumerate(crashes["steps"]) if "ckpt" in call]


def test_the_crash_tests_cover_every_filesystem_call_of_a_save(crashes):
    """A save makes exactly PUBLISH's calls beside its path, which the test below is
    parametrized over (so a changed protocol cannot skip a step), and a crash is injected at
    each of its calls, DCP's own included, counted in an uncrashed save."""
    assert crashes["distinct"], "the saved states must differ, for the crash tests to mean much"
    assert [crashes["steps"][k] for k in publish_steps(crashes)] == [
        call for call, _ in PUBLISH.values()
    ]


@pytest.mark.parametrize("step", range(len(PUBLISH)), ids=list(PUBLISH))
def test_a_crash_at_any_publish_step_leaves_the_old_or_the_new_checkpoint(crashes, step):
    """The old one up to the commit (included: the rename did not run), the new one after; the
    next save then publishes and leaves nothing beside the path."""
    got, left, then = crashes["once"][publish_steps(crashes)[step]]
    assert got == list(PUBLISH.values())[step][1]
    assert (left, then) == ("", "next")


def test_a_crash_inside_dcps_writes_leaves_the_old_checkpoint(crashes):
    """At each of DCP's own calls (in the temporary directory, e.g. moving ``.metadata`` in)."""
    inside = [k for k in range(len(crashes["steps"])) if k not in publish_steps(crashes)]
    assert [crashes["once"][k] for k in inside] == [("old", "", "next")] * len(inside)


def test_two_crashed_saves_in_a_row_leave_the_last_published_or_the_new_checkpoint(crashes):
    """E.g. a crash in a publish's cleanup (its .old-* stays), then one between the next save's
    renames: the one .old-* there must be the last published checkpoint."""
    assert [problem for problem in crashes["twice"] if problem] == []


def test_rank_0_publishes_and_cleans_up_with_no_collective_in_between(crashes):
    """So the cleanup runs even if a peer died after the writes: the barrier after ``dcp.save``
    is the last collective before the publish, the agreement broadcast the first after it."""
    order = crashes["order"]
    publish = [i for i, call in enumerate(order) if "ckpt" in call]
    assert publish == list(range(publish[0], publish[-1] + 1)), order
    assert order[publish[0] - 1] == "barrier", order
    assert order[publish[-1] + 1 :] == ["broadcast"], order


# Names beside the path that are not shardopt's leftovers: other names, and the leftover names
# without the marker (an older shardopt's .tmp-* and .old-*, a .v-* that shardopt did not mark).
NOT_LEFTOVERS = ["ckpt2", "ckpt.tmp-x", f"other.old-{1:016x}", f"ckpt.tmp-{1:016x}.d"]
NOT_LEFTOVERS += [f"ckpt.tmp-{2:016x}", f"ckpt.old-{3:016x}", f"ckpt.v-{4:016x}"]


def crashed_saves_then_one(rank: int, world: int, root: str) -> dict[str, Any]:
    """Over state 0: a save killed at its first filesystem call (in DCP's writes), one killed
    at its commit, a save without overwrite, then a good one (with other names beside)."""
    sharded, params, s = three_states()
    path = os.path.join(root, "ckpt")
    save_checkpoint(s[0], path, names=NAMES)
    for name in NOT_LEFTOVERS:
        os.mkdir(os.path.join(root, name))
    crashed_save(path, s[1], 0)
    crashed_save(path, s[2], PUBLISH["commit"][0])
    after_crashes = sorted(os.listdir(root))
    loads = which(sharded, params, path, {"s0": s[0]})
    try:
        save_checkpoint(s[1], path, names=NAMES)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    save_checkpoint(s[1], path, names=NAMES, overwrite=True)
    then = which(sharded, params, path, {"s1": s[1]})
    return {"after_crashes": after_crashes, "loads": loads, "refused": refused, "then": then}


def test_the_next_save_removes_the_leftovers_of_crashed_saves_and_nothing_else(run_world, tmp_path):
    """A crash in DCP's writes leaves a partial version, one at the commit a complete version
    and its link: the path still holds the old checkpoint, and counts as existing."""
    r = run_world(crashed_saves_then_one, 1, str(tmp_path))[0]
    leftovers = [n for n in r["after_crashes"] if n not in NOT_LEFTOVERS]
    assert [re.sub(r"-[0-9a-f]{16}$", "-*", n) for n in leftovers] == [
        "ckpt",
        "ckpt.link-*",
        "ckpt.lock",
        "ckpt.v-*",
        "ckpt.v-*",
        "ckpt.v-*",
    ]
    assert r["loads"] == "s0"
    assert "save_checkpoint: expected a path that does not exist" in r["refused"]
    left = [n for n in os.listdir(tmp_path) if n not in NOT_LEFTOVERS]
    assert sorted(re.sub(r"-[0-9a-f]{16}$", "-*", n) for n in left) == ["ckpt", "ckpt.v-*"]
    assert set(NOT_LEFTOVERS) <= set(os.listdir(tmp_path))
    assert r["then"] == "s1"


def over_a_plain_directory(rank: int, world: int, root: str) -> tuple[str, str, list[str]]:
    """A checkpoint as a plain directory at the path (an older shardopt's, or a copy), saved
    over with ``overwrite=True``: the refusal, what loads then, and what is in the directory."""
    sharded, params, s = three_states()
    path = os.path.join(root, "ckpt")
    save_checkpoint(s[0], f"{path}-made", names=NAMES)
    shutil.copytree(f"{path}-made", path)
    inside = sorted(os.listdir(path))
    try:
        save_checkpoint(s[1], path, names=NAMES, overwrite=True)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    same_files = sorted(os.listdir(path)) == inside
    return refused, which(sharded, params, path, {"s0": s[0]}), same_files


def test_a_plain_directory_at_the_path_is_refused_and_still_loads(run_world, tmp_path):
    """shardopt cannot tell it from a user's own directory: it never deletes it (the directory
    keeps every file), and load_checkpoint still reads it."""
    refused, loads, same_files = run_world(over_a_plain_directory, 1, str(tmp_path))[0]
    assert "save_checkpoint: expected" in refused
    assert "got a directory of 3 entries ('.metadata', '.shardopt_checkpoint'" in refused
    assert loads == "s0"
    assert same_files
