"""torch.distributed.checkpoint: save at one world size and plan, resume at another, atomically."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
import torch
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
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
    except BaseException as exc:  # DCP reports write failures as CheckpointException
        error = type(exc).__name__
    else:
        error = "none"
    after_failure = sorted(os.listdir(root))
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
        assert error == "CheckpointException", f"rank {rank}"
        assert after_failure == [], f"rank {rank}: left {after_failure}"
        assert at_end == ["ckpt"], f"rank {rank}: left {at_end}"
        assert "save_checkpoint: expected a path that does not exist" in refused or rank != 0
        assert "save_checkpoint: expected valid input on every rank" in refused or rank == 0


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
    """A process dying at this point (nothing after it runs, no except clause catches it)."""


@contextlib.contextmanager
def crash_at(k: int | None, calls: list[str]) -> Iterator[None]:
    """Records every filesystem rename and removal inside in ``calls``; the ``k``-th (from 0)
    raises Crash instead of running (None: none does)."""
    real = {"rename": os.rename, "replace": os.replace, "rmtree": shutil.rmtree}

    def wrap(name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            calls.append(name)
            if len(calls) - 1 == k:
                raise Crash(name)
            return real[name](*args, **kwargs)

        return call

    with (
        mock.patch("os.rename", wrap("rename")),
        mock.patch("os.replace", wrap("replace")),
        mock.patch("shutil.rmtree", wrap("rmtree")),
    ):
        yield


def saved_states(root: str) -> tuple[Any, Any, Any, list[torch.Tensor]]:
    """(sharded, state after 1 step, state after 2 steps, params): two distinguishable states."""
    params = initial_params()
    sharded, state = make_sharded("adam", params, 1, "flat", 1)
    one = sharded.step(params, grads(0), state)
    two = sharded.step(params, grads(1), one)
    return sharded, one, two, params


def same(a: Any, b: Any) -> bool:
    """Bitwise equality of two sharded states (as torch.optim state dicts)."""
    return state_equal(consolidate_state_dict(a), consolidate_state_dict(b))


def loaded(sharded: Any, params: list[torch.Tensor], path: str) -> Any:
    fresh = sharded.init([torch.zeros_like(p) for p in params])
    load_checkpoint(fresh, path, names=NAMES)
    return fresh


def crash_every_step(rank: int, world: int, root: str) -> list[str]:
    """Saves state one, then over it state two with a crash at each filesystem step in turn;
    after each crash what loads must be one or two, and the next save must leave no leftover."""
    sharded, one, two, params = saved_states(root)
    clean: list[str] = []  # the steps of a save over a checkpoint (a leftover beside it too)
    save_checkpoint(one, os.path.join(root, "count"), names=NAMES)
    os.mkdir(os.path.join(root, "count.tmp-00000000000000ff"))
    with crash_at(None, clean):
        save_checkpoint(two, os.path.join(root, "count"), names=NAMES, overwrite=True)
    problems = [] if len(clean) >= 4 else [f"an uncrashed save made only the steps {clean}"]
    for k in range(len(clean)):
        path = os.path.join(root, f"crash{k}")
        save_checkpoint(one, path, names=NAMES)
        os.mkdir(f"{path}.tmp-00000000000000ff")  # a crashed save's leftover
        # DCP turns a crash inside its own writes into a CheckpointException on every rank
        with contextlib.suppress(Crash, CheckpointException), crash_at(k, []):
            save_checkpoint(two, path, names=NAMES, overwrite=True)
            problems.append(f"step {k}: no crash")
        got = loaded(sharded, params, path)
        if not (same(got, one) or same(got, two)):
            problems.append(f"step {k} ({clean[k]}): loaded neither the old nor the new state")
        save_checkpoint(one, path, names=NAMES, overwrite=True)
        left = sorted(n for n in os.listdir(root) if n.startswith(f"crash{k}."))
        if left or not same(loaded(sharded, params, path), one):
            problems.append(f"step {k}: the next save left {left} or did not publish")
    return problems


def test_a_crash_at_any_step_of_a_save_leaves_the_old_or_the_new_checkpoint(run_world, tmp_path):
    (problems,) = run_world(crash_every_step, 1, str(tmp_path))
    assert problems == []


def crash_between_renames(rank: int, world: int, root: str) -> tuple[bool, bool, list[str]]:
    """The one crash that leaves nothing at the path: after the old checkpoint moved aside."""
    sharded, one, two, params = saved_states(root)
    path = os.path.join(root, "ckpt")
    save_checkpoint(one, path, names=NAMES)
    calls: list[str] = []
    real_rename = os.rename

    def rename(src: Any, dst: Any) -> None:
        calls.append(os.fspath(dst))
        if os.fspath(dst) == path:  # the commit: crash just before it
            raise Crash(dst)
        real_rename(src, dst)

    with contextlib.suppress(Crash), mock.patch("os.rename", rename):
        save_checkpoint(two, path, names=NAMES, overwrite=True)
    gone = not os.path.lexists(path)
    old_state = same(loaded(sharded, params, path), one)
    try:
        save_checkpoint(two, path, names=NAMES)
        refused = "no error"
    except ValueError as exc:
        refused = str(exc)
    return gone and old_state, "expected a path that does not exist" in refused, calls


def test_a_crash_between_the_renames_loads_the_old_checkpoint_and_counts_it_as_existing(
    run_world, tmp_path
):
    (recovered, refused, calls) = run_world(crash_between_renames, 1, str(tmp_path))[0]
    assert any(".old-" in c for c in calls), calls
    assert recovered
    assert refused
