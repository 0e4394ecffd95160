"""Every optimizer factory and combinator is pure: init and update never modify their inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

import shardopt.core
from shardopt.core import (
    Transformation,
    add_decayed_weights,
    apply_updates,
    chain,
    clip,
    clip_by_global_norm,
    linear_warmup,
    masked,
    multi_steps,
    partition,
    scale_by_learning_rate,
)
from shardopt.core.blocks import tree_leaves

from _core_helpers import FACTORY_CASES, case_id, decay_label, is_matrix

COMBINATOR_CASES: dict[str, Callable[[], Transformation]] = {
    "clip": lambda: chain(clip(0.5), scale_by_learning_rate(0.1)),
    "clip_by_global_norm+adam": lambda: chain(clip_by_global_norm(1.0), shardopt.core.adam(1e-2)),
    "masked": lambda: masked(
        chain(add_decayed_weights(0.1), scale_by_learning_rate(linear_warmup(0.1, 3))), is_matrix
    ),
    "partition": lambda: partition(
        {"decay": shardopt.core.adamw(1e-2), "no_decay": shardopt.core.sgd(0.1, momentum=0.9)},
        decay_label,
    ),
    "multi_steps-core": lambda: multi_steps(
        chain(add_decayed_weights(0.01), scale_by_learning_rate(0.1)), 2
    ),
    "multi_steps-adam": lambda: multi_steps(shardopt.core.adam(1e-2), 2),
}


def tensors_of(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


class Watch:
    """Records the version counter and a clone of every tensor in some trees."""

    def __init__(self, *trees: Any) -> None:
        self.tensors = [t for tree in trees for t in tensors_of(tree)]
        self.versions = [t._version for t in self.tensors]
        self.clones = [t.clone() for t in self.tensors]

    def assert_untouched(self, what: str) -> None:
        for i, (t, v, c) in enumerate(zip(self.tensors, self.versions, self.clones)):
            assert t._version == v, f"{what} modified input tensor {i} in place"
            assert torch.equal(t, c), f"{what} changed the values of input tensor {i}"


def assert_pure_for_3_steps(tx: Transformation, mixed_params: Callable[..., Any]) -> None:
    params = mixed_params(torch.float64)
    leaves, spec = pytree.tree_flatten(params)
    gen = torch.Generator().manual_seed(5)
    watch = Watch(params)
    state = tx.init(params)
    watch.assert_untouched("init")
    for step in range(3):
        grads = pytree.tree_unflatten(
            [
                None if step == 1 and i == 2 else torch.randn(p.shape, generator=gen, dtype=p.dtype)
                for i, p in enumerate(leaves)
            ],
            spec,
        )
        watch = Watch(params, grads, state)
        updates, new_state = tx.update(grads, state, params)
        watch.assert_untouched(f"update (step {step})")
        if tensors_of(state):
            assert new_state is not state, "update returned its input state object"
        again, again_state = tx.update(grads, state, params)
        for a, b in zip(tensors_of((updates, new_state)), tensors_of((again, again_state))):
            assert torch.equal(a, b), "a second update on the same inputs gave another result"
        params, state = apply_updates(params, updates), new_state
        leaves = pytree.tree_leaves(params)


@pytest.mark.parametrize(
    ("name", "lr", "options"),
    [pytest.param(*case, id=case_id(case[0], case[2])) for case in FACTORY_CASES],
)
def test_factory_init_and_update_never_modify_their_inputs(
    mixed_params: Callable[..., Any], name: str, lr: float, options: dict[str, Any]
) -> None:
    assert_pure_for_3_steps(getattr(shardopt.core, name)(lr, **options), mixed_params)


@pytest.mark.parametrize("name", list(COMBINATOR_CASES))
def test_combinator_init_and_update_never_modify_their_inputs(
    mixed_params: Callable[..., Any], name: str
) -> None:
    assert_pure_for_3_steps(COMBINATOR_CASES[name](), mixed_params)
