"""Transformation basics: chain, identity, apply_updates, tree helpers and the flat fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.core import (
    EmptyState,
    Transformation,
    add_decayed_weights,
    apply_updates,
    chain,
    identity,
    linear_warmup,
    multi_steps,
    scale,
    scale_by_learning_rate,
    update_pieces_,
)
from shardopt.core._tree import zeros_like_tree
from shardopt.core.blocks import (
    init_count,
    leafwise,
    piece_rule,
    tree_leaves,
    tree_map,
    with_piece_rule,
)


def test_identity_returns_the_updates_and_state_objects_unchanged() -> None:
    tx = identity()
    grads = {"w": torch.ones(2), "b": None}
    state = tx.init(grads)
    updates, new_state = tx.update(grads, state)
    assert updates is grads
    assert new_state is state == EmptyState()


@pytest.mark.parametrize(
    ("first", "second", "expected"),
    [
        (add_decayed_weights(1.0), scale(2.0), 2.0 * (1.0 + 3.0)),  # decay, then scale
        (scale(2.0), add_decayed_weights(1.0), 2.0 * 1.0 + 3.0),  # scale, then decay
    ],
)
def test_chain_applies_transformations_in_order(
    first: Transformation, second: Transformation, expected: float
) -> None:
    tx = chain(first, second)
    params = [torch.full((2,), 3.0)]
    updates, state = tx.update([torch.ones(2)], tx.init(params), params)
    assert torch.equal(updates[0], torch.full((2,), expected))
    assert state == (EmptyState(), EmptyState())


def test_chain_state_is_the_tuple_of_inner_states() -> None:
    sched = linear_warmup(1.0, 4)
    tx = chain(scale_by_learning_rate(sched), scale(2.0))
    params = [torch.zeros(1), torch.zeros(2)]
    state = tx.init(params)
    assert isinstance(state, tuple)
    assert len(state) == 2
    _, state = tx.update([torch.ones(1), None], state, params)
    counts = state[0].count
    assert counts[0].item() == 1.0
    assert counts[1].item() == 0.0  # a None gradient does not advance its count


def test_empty_chain_passes_updates_through() -> None:
    tx = chain()
    assert tx.init([torch.zeros(1)]) == ()
    grads = [torch.ones(1)]
    assert tx.update(grads, ())[0] is grads


def test_chain_rejects_a_state_with_another_number_of_parts() -> None:
    tx = chain(scale(1.0), scale(2.0))
    with pytest.raises(ValueError, match=r"chain: expected a state of 2 parts, got 1"):
        tx.update([torch.ones(1)], (EmptyState(),))


def test_apply_updates_adds_leafwise_and_skips_none_updates() -> None:
    params = {"w": torch.ones(2), "b": torch.zeros(1)}
    updates = {"w": torch.full((2,), 0.5), "b": None}
    new = apply_updates(params, updates)
    assert torch.equal(new["w"], torch.full((2,), 1.5))
    assert new["b"] is params["b"]
    assert torch.equal(params["w"], torch.ones(2)), "apply_updates modified its input"


def test_apply_updates_keeps_the_param_dtype() -> None:
    params = [torch.ones(2, dtype=torch.float32)]
    new = apply_updates(params, [torch.full((2,), 0.25, dtype=torch.float64)])
    assert new[0].dtype == torch.float32
    assert torch.equal(new[0], torch.full((2,), 1.25))


def test_apply_updates_rejects_trees_of_another_structure() -> None:
    with pytest.raises(ValueError, match="tree_map: expected trees of the same structure"):
        apply_updates([torch.ones(1)], [torch.ones(1), torch.ones(1)])


def test_tree_leaves_counts_none_as_a_leaf() -> None:
    tree = {"a": None, "b": [torch.ones(1), (None, torch.zeros(()))]}
    leaves = tree_leaves(tree)
    assert len(leaves) == 4
    assert leaves[0] is None
    assert leaves[2] is None


def test_tree_map_passes_none_leaves_to_the_function() -> None:
    seen: list[Any] = []

    def record(a: Any, b: Any) -> Any:
        seen.append((a, b))
        return "x"

    out = tree_map(record, [None, torch.ones(1)], [torch.zeros(1), None])
    assert out == ["x", "x"]
    assert seen[0][0] is None
    assert seen[1][1] is None


def test_leafwise_skips_none_gradients_and_keeps_their_state_objects() -> None:
    state = [torch.zeros(1), torch.zeros(1)]
    calls: list[Any] = []

    def rule(g: torch.Tensor, p: Any, m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(p)
        return -(m + g), m + g

    updates, (new_state,) = leafwise(rule, [torch.ones(1), None], None, state)
    assert updates[1] is None
    assert new_state[1] is state[1]
    assert torch.equal(new_state[0], torch.ones(1))
    assert calls == [None]  # called once, with p None as no params were given


def test_leafwise_rejects_params_and_states_with_another_number_of_leaves() -> None:
    with pytest.raises(ValueError, match=r"leafwise: expected params and states with 2 leaves"):
        leafwise(lambda g, p, s: (g, s), [torch.ones(1)] * 2, None, [torch.ones(1)])


def test_init_count_is_a_float32_zero_per_tensor_leaf_and_none_for_none() -> None:
    counts = init_count({"w": torch.ones(3, dtype=torch.float64), "b": None})
    assert counts["b"] is None
    assert counts["w"].dtype == torch.float32
    assert counts["w"].shape == ()
    assert counts["w"].item() == 0.0


def test_zeros_like_tree_keeps_none_leaves() -> None:
    zeros = zeros_like_tree([torch.ones(2, dtype=torch.float64), None])
    assert zeros[1] is None
    assert torch.equal(zeros[0], torch.zeros(2, dtype=torch.float64))


def test_update_pieces_without_a_rule_matches_the_pure_path_in_place() -> None:
    tx = multi_steps(chain(add_decayed_weights(0.1), scale_by_learning_rate(0.5)), every_k=2)
    assert piece_rule(tx) is None
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(5, generator=gen), torch.randn(3, generator=gen)]
    state = tx.init(params)
    ref_params, ref_state = [p.clone() for p in params], tx.init(params)
    param_ids, state_ids = [id(p) for p in params], [id(t) for t in tree_leaves(state)]
    for step in range(4):
        grads = [
            torch.randn(5, generator=gen),
            None if step == 1 else torch.randn(3, generator=gen),
        ]
        update_pieces_(tx, params, grads, state)
        updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = apply_updates(ref_params, updates)
        assert [id(p) for p in params] == param_ids
        assert [id(t) for t in tree_leaves(state)] == state_ids, "state tensors were replaced"
        for ours, ref in zip(params + tree_leaves(state), ref_params + tree_leaves(ref_state)):
            assert torch.equal(ours, ref)


def test_update_pieces_uses_a_registered_rule() -> None:
    calls: list[tuple[Any, ...]] = []
    tx = with_piece_rule(scale(1.0), lambda p, g, s: calls.append((p, g, s)))
    assert piece_rule(tx) is not None
    params, grads = (torch.zeros(2),), (torch.ones(2),)
    update_pieces_(tx, params, grads, EmptyState())
    assert len(calls) == 1
    assert calls[0][0][0] is params[0]
    assert torch.equal(params[0], torch.zeros(2)), "the pure path ran instead of the rule"


def test_update_pieces_rejects_a_grads_list_of_another_length() -> None:
    tx = scale(1.0)
    with pytest.raises(ValueError, match="update_pieces_: expected as many grads as params"):
        update_pieces_(tx, [torch.zeros(1)], [], EmptyState())
