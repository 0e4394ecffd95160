"""masked and partition: per-leaf transformations that match torch.optim param groups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    EmptyState,
    PartitionState,
    Transformation,
    add_decayed_weights,
    apply_updates,
    chain,
    linear_warmup,
    masked,
    partition,
    scale,
    scale_by_learning_rate,
)
from shardopt.core.blocks import tree_leaves, tree_map


def is_matrix(params: Any) -> Any:
    """A mask: True for the leaves with 2 or more dimensions (weights), False otherwise."""
    return tree_map(lambda p: p.dim() >= 2, params)


def decay_label(params: Any) -> Any:
    return tree_map(lambda p: "decay" if p.dim() >= 2 else "no_decay", params)


def two_groups(
    torch_cls: type[torch.optim.Optimizer], matrix: dict[str, Any], other: dict[str, Any]
) -> Callable[..., torch.optim.Optimizer]:
    """Builds ``torch_cls`` with a group for the 2-d+ parameters and one for the others."""

    def build(params: list[torch.Tensor], **kwargs: Any) -> torch.optim.Optimizer:
        groups = [
            {"params": [p for p in params if p.dim() >= 2], **matrix},
            {"params": [p for p in params if p.dim() < 2], **other},
        ]
        return torch_cls(groups, **kwargs)

    return build


def sometimes_none(step: int, leaf: int) -> bool:
    return (step + leaf) % 4 == 0


@pytest.mark.parametrize("skip", [None, sometimes_none], ids=["all-grads", "none-grads"])
def test_partition_of_core_transforms_matches_sgd_param_groups(
    equivalence: Callable[..., Any], skip: Callable[[int, int], bool] | None
) -> None:
    tx = partition(
        {
            "decay": chain(add_decayed_weights(0.1), scale_by_learning_rate(0.1)),
            "no_decay": scale_by_learning_rate(0.01),
        },
        decay_label,
    )
    ref = two_groups(torch.optim.SGD, {"lr": 0.1, "weight_decay": 0.1}, {"lr": 0.01})
    kwargs = {} if skip is None else {"skip": skip}
    run = equivalence(tx, ref, {"lr": 1.0}, torch.float64, **kwargs)
    run.assert_params_close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("skip", [None, sometimes_none], ids=["all-grads", "none-grads"])
def test_partition_of_adamw_matches_adamw_with_two_param_groups(
    equivalence: Callable[..., Any],
    dtype: torch.dtype,
    skip: Callable[[int, int], bool] | None,
) -> None:
    adamw = shardopt.core.adamw
    tx = partition(
        {"decay": adamw(1e-3, weight_decay=0.1), "no_decay": adamw(1e-2, weight_decay=0.0)},
        decay_label,
    )
    ref = two_groups(
        torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 0.1}, {"lr": 1e-2, "weight_decay": 0.0}
    )
    kwargs = {} if skip is None else {"skip": skip}
    run = equivalence(tx, ref, {}, dtype, steps=20, **kwargs)
    run.assert_params_close()


def test_masked_weight_decay_before_sgd_matches_sgd_param_groups(
    equivalence: Callable[..., Any],
) -> None:
    tx = chain(masked(add_decayed_weights(0.05), is_matrix), shardopt.core.sgd(0.1, momentum=0.9))
    ref = two_groups(torch.optim.SGD, {"weight_decay": 0.05}, {"weight_decay": 0.0})
    run = equivalence(tx, ref, {"lr": 0.1, "momentum": 0.9}, torch.float64, skip=sometimes_none)
    run.assert_params_close()


def recording(seen: list[tuple[Any, Any]]) -> Transformation:
    """scale(-1.0) that records the (updates, params) it is given."""
    inner = scale(-1.0)

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        seen.append((updates, params))
        return inner.update(updates, state, params)

    return Transformation(inner.init, update)


def test_masked_inner_sees_only_the_selected_leaves_and_others_pass_unchanged() -> None:
    seen: list[tuple[Any, Any]] = []
    tx = masked(recording(seen), {"w": True, "b": False, "s": [True, False]})
    params: dict[str, Any] = {"w": torch.ones(2), "b": torch.ones(1), "s": [torch.ones(3), None]}
    grads: dict[str, Any] = {
        "w": torch.full((2,), 2.0),
        "b": torch.full((1,), 3.0),
        "s": [None, None],
    }
    updates, state = tx.update(grads, tx.init(params), params)
    inner_grads, inner_params = seen[0]
    assert len(inner_grads) == 2
    assert inner_grads[0] is grads["w"]
    assert inner_grads[1] is None
    assert inner_params[1] is params["s"][0]
    assert torch.equal(updates["w"], torch.full((2,), -2.0))
    assert updates["b"] is grads["b"], "a masked-out update was not passed through"
    assert updates["s"] == [None, None]
    assert state.inner_state == EmptyState()


def test_masked_leaves_masked_out_params_untouched_by_the_inner_optimizer() -> None:
    # The inner SGD (lr, momentum, weight decay) acts on "w" only; "b" receives its update as
    # given, so with a zero incoming update it stays bitwise equal.
    tx = masked(shardopt.core.sgd(0.1, momentum=0.9, weight_decay=0.5), {"w": True, "b": False})
    params = {"w": torch.ones(3), "b": torch.full((2,), 7.0)}
    state = tx.init(params)
    for _ in range(3):
        grads = {"w": torch.ones(3), "b": torch.zeros(2)}
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    assert torch.equal(params["b"], torch.full((2,), 7.0))
    assert not torch.equal(params["w"], torch.ones(3))
    assert len(tree_leaves(state.inner_state)) > 0


def test_partition_to_scale_zero_freezes_parameters_bitwise(
    mixed_params: Callable[..., Any],
) -> None:
    params = mixed_params(torch.float32)
    tx = partition({"decay": shardopt.core.adam(1e-2), "no_decay": scale(0.0)}, decay_label)
    frozen = [
        p.clone()
        for p, lbl in zip(tree_leaves(params), tree_leaves(decay_label(params)))
        if lbl == "no_decay"
    ]
    state = tx.init(params)
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        grads = tree_map(lambda p: torch.randn(p.shape, generator=gen), params)
        updates, state = tx.update(grads, state, params)
        params = apply_updates(params, updates)
    after = [
        p
        for p, lbl in zip(tree_leaves(params), tree_leaves(decay_label(params)))
        if lbl == "no_decay"
    ]
    assert all(torch.equal(a, b) for a, b in zip(after, frozen))


def test_partition_state_holds_one_inner_state_per_label_over_its_leaves() -> None:
    schedule = linear_warmup(1.0, 4)
    tx = partition(
        {
            "a": scale_by_learning_rate(schedule),
            "b": scale(1.0),
            "unused": scale_by_learning_rate(schedule),
        },
        ["a", "b", "a"],
    )
    params = [torch.zeros(1), torch.zeros(2), torch.zeros(3)]
    state = tx.init(params)
    assert isinstance(state, PartitionState)
    assert list(state.inner_states) == ["a", "b", "unused"]
    assert len(state.inner_states["a"].count) == 2
    assert state.inner_states["unused"].count == []
    _, state = tx.update([torch.ones(1), torch.ones(2), None], state, params)
    assert [c.item() for c in state.inner_states["a"].count] == [1.0, 0.0]


def test_callable_labels_are_resolved_from_the_updates_without_params() -> None:
    tx = partition(
        {"big": scale(2.0), "small": scale(0.5)},
        lambda t: tree_map(lambda x: "big" if x.numel() > 1 else "small", t),
    )
    state = tx.init([torch.zeros(3), torch.zeros(1)])
    updates, _ = tx.update([torch.ones(3), torch.ones(1)], state)
    assert torch.equal(updates[0], torch.full((3,), 2.0))
    assert torch.equal(updates[1], torch.full((1,), 0.5))


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda: masked(scale(1.0), [True]).init([torch.ones(1), torch.ones(1)]),
            r"masked: expected a mask with the tree structure of the params",
        ),
        (
            lambda: masked(scale(1.0), [True, 1]).init([torch.ones(1), torch.ones(1)]),
            r"masked: expected a mask of Python bools, got int at leaf 1",
        ),
        (
            lambda: partition({"a": scale(1.0)}, ["a", "b"]).init([torch.ones(1)] * 2),
            r"partition: expected every label to be one of \['a'\], got 'b' at leaf 1",
        ),
        (lambda: partition({}, []), r"partition: expected at least one transformation"),
        (
            lambda: partition({"a": scale(1.0)}, ["a"]).update(
                [torch.ones(1)], PartitionState({"b": EmptyState()})
            ),
            r"partition: expected a state with labels \['a'\], got \['b'\]",
        ),
        (
            lambda: masked(scale(1.0), [True]).update(
                [torch.ones(1)], masked(scale(1.0), [True]).init([torch.ones(1)]), {"p": 1}
            ),
            r"masked: expected updates and params of the same structure",
        ),
    ],
)
def test_combinators_reject_bad_masks_labels_and_states(
    make: Callable[[], Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_masked_and_partition_keep_the_tree_structure_of_the_updates(
    mixed_params: Callable[..., Any],
) -> None:
    params = mixed_params(torch.float64)
    grads = tree_map(torch.ones_like, params)
    for tx in (
        masked(scale(2.0), is_matrix),
        partition({"decay": scale(2.0), "no_decay": scale(3.0)}, decay_label),
    ):
        updates, _ = tx.update(grads, tx.init(params), params)
        assert pytree.tree_structure(updates) == pytree.tree_structure(params)
