"""Checkpoints of ``partition`` states, one torch.optim state dict per label: Muon on matrices and
AdamW on the rest consolidate to torch's two dicts, load back from them, and reshard through DCP
at another world size and plan, each time matching torch's two optimizers in one process."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch
from torch import nn

from shardopt.core import adamw, muon, newton_schulz_flops, partition, plan_partition
from shardopt.functional import (
    consolidate_state_dict,
    load_checkpoint,
    load_torch_state_dict,
    register_grad_hooks,
    save_checkpoint,
    shard,
    torch_hyperparams,
)
from shardopt.testing import requires_torch

from _functional_helpers import mlp_batch, small_mlp

NEEDS_MUON = requires_torch("2.9", "torch.optim.Muon")
STEPS, HALF = 4, 2
MUON_LR, ADAMW_LR = 0.02, 1e-2
LABELS = ["muon", "adamw"]  # the order of partition's transforms mapping
# small_mlp's parameters, in plan-tensor order; its shapes are distinct, so a shape names one.
NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"]
MATRICES = {(16, 6), (12, 16), (3, 12)}
# Plan kinds by the shapes they keep whole, which are the tensors labelled "muon" (labels are
# resolved on the whole tensors): greedy keeps everything whole, mixed the matrices (biases
# cut), hidden only the two hidden matrices (the head's matrix is cut and labelled AdamW by its
# shape, as the recipe labels it by name).
WHOLE = {"greedy": None, "mixed": MATRICES, "hidden": {(16, 6), (12, 16)}}


def labels_of(kind: str) -> Callable[[Sequence[torch.Tensor]], list[str]]:
    """The labels for plan kind ``kind``: Muon for the matrices it keeps whole."""
    return lambda ps: ["muon" if tuple(p.shape) in muon_shapes(kind) else "adamw" for p in ps]


def muon_shapes(kind: str) -> set[tuple[int, ...]]:
    return MATRICES if WHOLE[kind] is None else WHOLE[kind]


def is_muon(kind: str) -> list[bool]:
    """Per parameter of small_mlp: whether the plan kind's labels give it to Muon."""
    return [tuple(p.shape) in muon_shapes(kind) for p in small_mlp().parameters()]


def label_keys(kind: str, named: bool) -> dict[str, list[Any]]:
    """Each label's parameter keys, in plan-tensor order: indices among the label, or names."""
    mask = is_muon(kind)
    out: dict[str, list[Any]] = {}
    for label in LABELS:
        mine = [n for n, m in zip(NAMES, mask) if m == (label == "muon")]
        out[label] = mine if named else list(range(len(mine)))
    return out


def hyperparams() -> dict[str, dict[str, Any]]:
    return {
        "muon": torch_hyperparams(torch.optim.Muon, lr=MUON_LR),
        "adamw": torch_hyperparams(torch.optim.AdamW, lr=ADAMW_LR),
    }


def make_plan(params: list[torch.Tensor], world: int, kind: str) -> Any:
    cost = lambda t: newton_schulz_flops(t.shape)  # noqa: E731
    if WHOLE[kind] is None:
        return plan_partition(params, world, strategy="greedy", cost=cost)
    whole = lambda t: tuple(t.shape) in WHOLE[kind]  # noqa: E731
    return plan_partition(params, world, strategy="mixed", whole=whole, cost=cost)


def make_sharded(params: list[torch.Tensor], world: int, kind: str, stage: int) -> Any:
    tx = partition({"muon": muon(lr=MUON_LR), "adamw": adamw(lr=ADAMW_LR)}, labels_of(kind))
    sharded = shard(tx, make_plan(params, world, kind), stage=stage)
    return sharded, sharded.init(params)


def train(model: nn.Module, sharded: Any, state: Any, steps: range) -> Any:
    """Every rank on rank 0's batch: the averaged gradient is exactly one process's."""
    params = list(model.parameters())
    for step in steps:
        x, y = mlp_batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return state


def torch_run(kind: str, steps: range, sds: dict[str, Any] | None = None) -> Any:
    """torch.optim.Muon on the kind's Muon matrices and AdamW on the rest over ``steps``, in one
    process; with ``sds``, from the parameters after HALF steps and the optimizers loaded from
    ``sds[label]``. Returns (parameters, {label: optimizer})."""
    model = small_mlp()
    params = list(model.parameters())
    if sds is not None:
        half = torch_run(kind, range(HALF))[0]
        with torch.no_grad():
            for p, q in zip(params, half):
                p.copy_(q)
    mask = is_muon(kind)
    opts = {
        "muon": torch.optim.Muon([p for p, m in zip(params, mask) if m], lr=MUON_LR),
        "adamw": torch.optim.AdamW([p for p, m in zip(params, mask) if not m], lr=ADAMW_LR),
    }
    for label, sd in (sds or {}).items():
        opts[label].load_state_dict(sd)
    for step in steps:
        x, y = mlp_batch(step, 0)
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts.values():
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in params], opts


def torch_dicts(kind: str, named: bool) -> dict[str, Any]:
    """torch's state dicts after HALF steps, each keyed as ``label_keys`` says."""
    keys = label_keys(kind, named)
    out = {}
    for label, opt in torch_run(kind, range(HALF))[1].items():
        sd = opt.state_dict()
        key = keys[label].__getitem__
        out[label] = {
            "state": {key(i): entry for i, entry in sd["state"].items()},
            "param_groups": [
                {**g, "params": [key(i) for i in g["params"]]} for g in sd["param_groups"]
            ],
        }
    return out


def assert_same_dict(got: dict[str, Any], expected: dict[str, Any]) -> None:
    assert got["param_groups"] == expected["param_groups"]
    assert list(got["state"]) == list(expected["state"])
    for key, entry in expected["state"].items():
        assert list(got["state"][key]) == list(entry), key  # torch's keys in torch's order
        for name, value in entry.items():
            torch.testing.assert_close(
                got["state"][key][name],
                value,
                rtol=1e-5,
                atol=1e-6,
                msg=lambda m, at=f"{key}.{name}": f"{at}: {m}",
            )


def assert_params(got: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    for name, p, e in zip(NAMES, got, expected, strict=True):
        torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6, msg=lambda m, at=name: f"{at}: {m}")


# 1. Consolidation: {label: torch.optim state dict} on rank 0, None elsewhere.


def consolidated(rank: int, world: int, kind: str, stage: int, named: bool) -> Any:
    model = small_mlp()
    params = list(model.parameters())
    sharded, state = make_sharded(params, world, kind, stage)
    if stage == 2:
        register_grad_hooks(params, state)
    state = train(model, sharded, state, range(HALF))
    return consolidate_state_dict(state, hyperparams(), names=NAMES if named else None)


@NEEDS_MUON
@pytest.mark.parametrize(
    ("world", "stage", "kind", "named"),
    [
        (1, 1, "greedy", False),
        (2, 2, "mixed", False),
        (3, 2, "hidden", True),
        (4, 1, "mixed", False),
        (4, 2, "greedy", True),
    ],
)
def test_a_partition_state_consolidates_to_each_labels_torch_dict_and_loads_into_torch(
    run_world, world, stage, kind, named
):
    results = run_world(consolidated, world, kind, stage, named)
    assert [sd is None for sd in results] == [False] + [True] * (world - 1)
    sd = results[0]
    assert list(sd) == LABELS
    expected = torch_dicts(kind, named)
    for label in LABELS:  # param_groups included: the hyperparameters given, per label
        assert_same_dict(sd[label], expected[label])
    # torch's optimizers load the dicts and continue like the uninterrupted torch run.
    assert_params(torch_run(kind, range(HALF, STEPS), sd)[0], torch_run(kind, range(STEPS))[0])


# 2. torch's dicts into a sharded state.


def resumed_from_torch(
    rank: int, world: int, kind: str, stage: int, named: bool, sds: Any, half: Any
) -> list[torch.Tensor]:
    model = small_mlp()
    params = list(model.parameters())
    with torch.no_grad():
        for p, q in zip(params, half):
            p.copy_(q)
    sharded, state = make_sharded(params, world, kind, stage)
    load_torch_state_dict(state, sds, names=NAMES if named else None)
    if stage == 2:
        register_grad_hooks(params, state)
    train(model, sharded, state, range(HALF, STEPS))
    return [p.detach() for p in params]


@NEEDS_MUON
@pytest.mark.parametrize(
    ("world", "stage", "kind", "named"),
    [(2, 2, "mixed", False), (3, 1, "hidden", True), (3, 2, "greedy", False)],
)
def test_torchs_dicts_load_into_a_sharded_partition_state_that_continues_like_torch(
    run_world, world, stage, kind, named
):
    half = torch_run(kind, range(HALF))[0]
    final = torch_run(kind, range(STEPS))[0]
    # The state matters: torch's fresh optimizers from the same parameters end elsewhere.
    fresh = torch_run(kind, range(HALF, STEPS), {})[0]
    assert any(not torch.allclose(f, e, rtol=1e-5, atol=1e-6) for f, e in zip(fresh, final))
    for params in run_world(
        resumed_from_torch, world, kind, stage, named, torch_dicts(kind, named), half
    ):
        assert_params(params, final)


# 3. DCP: saved at one world size and plan, loaded at another.


def dcp_run(
    rank: int, world: int, kind: str, stage: int, path: str, save: bool
) -> list[torch.Tensor] | None:
    """The first HALF steps, saved with the model; or, from zeroed parameters and a fresh state,
    both loaded from the checkpoint and the rest of the steps."""
    model = small_mlp()
    params = list(model.parameters())
    if not save:
        with torch.no_grad():
            for p in params:
                p.zero_()
    sharded, state = make_sharded(params, world, kind, stage)
    if not save:
        load_checkpoint(state, path, names=NAMES, extra={"model": model.state_dict()})
    if stage == 2:
        register_grad_hooks(params, state)
    state = train(model, sharded, state, range(HALF) if save else range(HALF, STEPS))
    if save:
        save_checkpoint(state, path, names=NAMES, extra={"model": model.state_dict()})
        return None
    return [p.detach() for p in params]


@NEEDS_MUON
@pytest.mark.parametrize(
    ("saved", "loaded"),
    [
        ((2, "mixed", 2), (3, "greedy", 1)),
        ((3, "greedy", 1), (1, "mixed", 2)),
        ((4, "hidden", 2), (2, "hidden", 1)),
        ((1, "greedy", 2), (4, "mixed", 2)),
    ],
    ids=str,
)
def test_a_partition_checkpoint_reshards_to_another_world_size_and_plan(
    run_world, tmp_path, saved, loaded
):
    path = str(tmp_path / "ckpt")
    assert is_muon(saved[1]) == is_muon(loaded[1])  # the same labels on both plans
    (saved_world, saved_kind, saved_stage), (world, kind, stage) = saved, loaded
    assert (
        run_world(dcp_run, saved_world, saved_kind, saved_stage, path, True) == [None] * saved_world
    )
    final = torch_run(kind, range(STEPS))[0]
    fresh = torch_run(kind, range(HALF, STEPS), {})[0]  # the optimizer state matters
    assert any(not torch.allclose(f, e, rtol=1e-5, atol=1e-6) for f, e in zip(fresh, final))
    for params in run_world(dcp_run, world, kind, stage, path, False):
        assert_params(params, final)


# 4. A partition checkpoint is not a plain optimizer's.


def partition_into_adamw(rank: int, world: int, path: str) -> str:
    """One step of the recipe, saved; then loaded into a plain AdamW state of the same plan:
    the error message, or "no error"."""
    model = small_mlp()
    params = list(model.parameters())
    sharded, state = make_sharded(params, world, "mixed", 1)
    state = train(model, sharded, state, range(1))
    save_checkpoint(state, path, names=NAMES)
    plain = shard(adamw(lr=ADAMW_LR), make_plan(params, world, "mixed")).init(params)
    try:
        load_checkpoint(plain, path, names=NAMES)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_a_partition_checkpoint_is_refused_by_a_plain_adamw_state_on_every_rank(
    run_world, tmp_path
):
    messages = run_world(partition_into_adamw, 2, str(tmp_path / "ckpt"))
    for rank, message in enumerate(messages):
        assert message.startswith("load_checkpoint: expected "), (rank, message)
        assert "momentum" in message, (rank, message)  # it names Muon's key it does not know


# 5. Without torch.optim.Muon (torch < 2.9): keyed by path, still resharded.


def own_run(rank: int, world: int, kind: str, path: str, mode: str) -> list[torch.Tensor] | None:
    """STEPS steps in one go ("whole"), the first HALF then saved ("save"), or the rest from
    the checkpoint into zeroed parameters and a fresh state ("load")."""
    model = small_mlp()
    params = list(model.parameters())
    if mode == "load":
        with torch.no_grad():
            for p in params:
                p.zero_()
    sharded, state = make_sharded(params, world, kind, 1)
    if mode == "load":
        load_checkpoint(state, path, names=NAMES, extra={"model": model.state_dict()})
    steps = {"whole": range(STEPS), "save": range(HALF), "load": range(HALF, STEPS)}[mode]
    state = train(model, sharded, state, steps)
    if mode == "save":
        save_checkpoint(state, path, names=NAMES, extra={"model": model.state_dict()})
        return None
    return [p.detach() for p in params]


def test_a_partition_checkpoint_reshards_on_every_torch_like_the_uninterrupted_run(
    run_world, tmp_path
):
    path = str(tmp_path / "ckpt")
    final = run_world(own_run, 2, "mixed", path, "whole")[0]
    run_world(own_run, 2, "mixed", path, "save")
    for params in run_world(own_run, 3, "greedy", path, "load"):
        assert_params(params, final)
