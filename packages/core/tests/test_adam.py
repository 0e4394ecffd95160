"""adam and adamw against torch.optim.Adam and AdamW: option tables, schedules, validation."""

from __future__ import annotations

import itertools
import re
from typing import Any

import pytest
import torch

from shardopt.core import adam, adamw, warmup_cosine_decay
from shardopt.core._adam import ScaleByAdamState
from shardopt.core._fused import split_state
from shardopt.core._tree import tree_leaves
from shardopt.testing import requires_torch

from _core_helpers import (
    assert_rejected_like_torch,
    assert_torch_signature,
    lambda_lr_scheduled,
    learning_rate_and_skip,
    option_id,
    torch_form,
)

DTYPES = [torch.float64, torch.float32]
LR_KINDS = ["float_lr", "tensor_lr_and_skips"]


def check_state(run: Any, amsgrad: bool, *, bitwise: bool) -> None:
    """Our ScaleByAdamState against torch's state, within tolerance, or bitwise."""
    state = split_state(run.state)[0]
    assert isinstance(state, ScaleByAdamState)
    pairs = [("step", state.count), ("exp_avg", state.mu), ("exp_avg_sq", state.nu)]
    if amsgrad:
        pairs.append(("max_exp_avg_sq", state.nu_max))
    else:
        assert state.nu_max is None
    for key, tree in pairs:
        run.assert_state_close(tree_leaves(tree), key)
        if bitwise:
            for ours, theirs in zip(tree_leaves(tree), run.torch_state(key)):
                assert torch.equal(ours, theirs), key
    if bitwise:
        run.assert_params_equal()


ADAM_OPTIONS = [
    {"amsgrad": a, "weight_decay": w, "maximize": m, "decoupled_weight_decay": d}
    for a, w, m, d in itertools.product((False, True), (0.0, 0.1), (False, True), (False, True))
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", LR_KINDS)
@pytest.mark.parametrize("options", ADAM_OPTIONS, ids=option_id)
def test_adam_matches_torch_adam_for_50_steps_bitwise_unless_decoupled(
    equivalence: Any, options: dict[str, Any], lr_kind: str, dtype: torch.dtype
) -> None:
    """Parameters and state agree to 1e-12 (float64) / 1e-6 (float32), and bitwise without
    decoupled weight decay: same ops in the same order, the count's scalars rounded as torch's
    Python floats (see [Note: scalar arithmetic of the count]). Decoupled decay is torch's to
    the last bit nearly always (see [Note: decoupled decay as a delta]), not always.

    The tensor-lr rows (a float32 0-d lr, also for float64 parameters) skip gradients: a None
    leaf every third step.
    """
    lr, skip = learning_rate_and_skip(lr_kind, 0.01)
    cls, theirs = torch_form(torch.optim.Adam, {"lr": lr, **options})
    run = equivalence(adam(lr, **options), cls, theirs, dtype, skip=skip)
    run.assert_params_close()
    check_state(run, options["amsgrad"], bitwise=not options["decoupled_weight_decay"])


ADAMW_OPTIONS = [
    {"amsgrad": a, "maximize": m} for a, m in itertools.product((False, True), (False, True))
] + [{"weight_decay": 0.0}]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", LR_KINDS)
@pytest.mark.parametrize("options", ADAMW_OPTIONS, ids=option_id)
def test_adamw_matches_torch_adamw_for_50_steps(
    equivalence: Any, options: dict[str, Any], lr_kind: str, dtype: torch.dtype
) -> None:
    """Within 1e-12 (float64) / 1e-6 (float32); bitwise without weight decay."""
    lr, skip = learning_rate_and_skip(lr_kind, 0.01)
    run = equivalence(
        adamw(lr, **options), torch.optim.AdamW, {"lr": lr, **options}, dtype, skip=skip
    )
    run.assert_params_close()
    check_state(run, options.get("amsgrad", False), bitwise=options.get("weight_decay", 1) == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", LR_KINDS)
@requires_torch("2.6", "tensor betas in torch.optim.Adam")
def test_adam_with_tensor_betas_matches_torch_adam_bitwise(
    equivalence: Any, lr_kind: str, dtype: torch.dtype
) -> None:
    """torch computes the scalars of tensor betas with tensor ops in the betas' dtype (float32
    here), squares and cubes multiplied out; we use the same expressions."""
    lr, skip = learning_rate_and_skip(lr_kind, 0.01)
    options = {
        "betas": (torch.tensor(0.8), torch.tensor(0.99)),
        "amsgrad": True,
        "weight_decay": 0.1,
    }
    run = equivalence(
        adam(lr, **options), torch.optim.Adam, {"lr": lr, **options}, dtype, skip=skip
    )
    check_state(run, True, bitwise=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("factory", "torch_cls", "options"),
    [
        (adam, torch.optim.Adam, {}),
        (adam, torch.optim.Adam, {"amsgrad": True, "weight_decay": 0.1}),
        (adamw, torch.optim.AdamW, {}),
    ],
    ids=["adam", "adam-amsgrad-l2", "adamw"],
)
def test_adam_with_a_schedule_matches_torch_adam_with_lambda_lr(
    equivalence: Any, factory: Any, torch_cls: Any, options: dict[str, Any], dtype: torch.dtype
) -> None:
    """Bitwise for adam: a float64 schedule value is the lr torch gets as a Python float."""
    schedule = warmup_cosine_decay(0.01, 5, 50)
    run = equivalence(
        factory(schedule, **options), lambda_lr_scheduled(torch_cls, schedule), options, dtype
    )
    run.assert_params_close()
    check_state(run, options.get("amsgrad", False), bitwise=factory is adam)


@pytest.mark.parametrize(
    ("ours", "theirs"),
    [
        pytest.param(
            adam, torch.optim.Adam, marks=requires_torch("2.7", "Adam's decoupled_weight_decay")
        ),
        (adamw, torch.optim.AdamW),
    ],
)
def test_adam_and_adamw_have_torch_defaults(ours: Any, theirs: Any) -> None:
    assert_torch_signature(ours, theirs)


INVALID = [
    ({"lr": -1.0}, "adam: expected 0 <= lr, got -1.0"),
    ({"lr": torch.tensor([0.1, 0.2])}, "adam: expected lr with 1 element, got shape (2,)"),
    ({"eps": -1e-8}, "adam: expected 0 <= eps, got -1e-08"),
    ({"betas": (1.5, 0.999)}, "adam: expected 0 <= betas[0] < 1, got 1.5"),
    ({"betas": (0.9, 1.0)}, "adam: expected 0 <= betas[1] < 1, got 1.0"),
    ({"betas": (-0.1, 0.999)}, "adam: expected 0 <= betas[0] < 1, got -0.1"),
    pytest.param(
        {"betas": (0.9, torch.tensor(0.99))},
        "adam: expected betas both floats or both tensors",
        marks=requires_torch("2.6", "torch.optim.Adam refusing mixed betas"),
        id="adam: expected betas both floats or both tensors",
    ),
    ({"weight_decay": -0.1}, "adam: expected 0 <= weight_decay, got -0.1"),
]


@pytest.mark.parametrize(("kwargs", "message"), INVALID, ids=[m[-1] for m in INVALID])
def test_adam_rejects_what_torch_rejects(kwargs: dict[str, Any], message: str) -> None:
    assert_rejected_like_torch(adam, torch.optim.Adam, kwargs, message)
    with pytest.raises(ValueError, match=re.escape(message.replace("adam:", "adamw:"))):
        adamw(**kwargs)
