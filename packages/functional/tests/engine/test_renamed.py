"""Names and keywords renamed by issue 39 still work, each with a FutureWarning naming the new
one; a call that passes both the old and the new keyword is refused."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist

import shardopt.functional as functional
from shardopt.core import adamw, plan_partition, scale_by_learning_rate
from shardopt.functional import average_params, local_sgd_step, shard
from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import current_world

RENAMED = [
    ("FlatLayout", "ParamBuffers"),
    ("FieldKind", "FieldGranularity"),
    ("layout_cost", "shard_cost"),
]


@pytest.mark.parametrize(("old", "new"), RENAMED)
def test_an_old_name_of_shardopt_functional_is_the_new_object_and_warns(old, new):
    match = rf"shardopt\.functional\.{old} is renamed shardopt\.functional\.{new}"
    with pytest.warns(FutureWarning, match=match):
        value = getattr(functional, old)
    assert value is getattr(functional, new)
    assert old not in functional.__all__
    assert new in functional.__all__


def renamed_uses(rank: int, world_size: int) -> dict[str, object]:
    """On each rank: every renamed keyword and attribute, old and new side by side."""
    out: dict[str, object] = {}
    params = [torch.ones(3), torch.zeros(2)]
    plan = plan_partition(params, world_size)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = shard(adamw(0.1), plan, group=None)
        state = old.init(params)
        buffers = state.layout
        world = current_world().group
        averaged = average_params([torch.full((2,), float(rank))], group=None)
        sgd, one = scale_by_learning_rate(1.0), [torch.ones(1)]
        stepped, _ = local_sgd_step(sgd, one, one, (), step=0, period=1, group=None)
        weight = torch.nn.Parameter(torch.ones(4))
        zero = ZeroRedundancyOptimizer(
            [weight], torch.optim.SGD, lr=0.1, parameters_as_bucket_view=True
        )
        views = zero.layout
    out["warnings"] = sorted(
        str(w.message).split(" is renamed ")[0] for w in caught if w.category is FutureWarning
    )
    out["same"] = (
        buffers is state.param_buffers,
        world is current_world().process_group,
        views is zero.bucket_views and views is not None,
    )
    out["averaged"] = averaged[0].tolist()
    out["stepped"] = stepped[0].tolist()
    try:
        shard(adamw(0.1), plan, group=None, process_group=dist.group.WORLD)
    except TypeError as exc:
        out["both"] = str(exc)
    return out


def test_old_keywords_and_attributes_work_warn_once_each_and_both_keywords_are_refused(run_world):
    results = run_world(renamed_uses, 2)
    for rank, out in enumerate(results):
        assert out["warnings"] == [
            "ShardedState.layout",
            "World.group",
            "ZeroRedundancyOptimizer.layout",
            "average_params(group=)",
            "local_sgd_step(group=)",
            "shard(group=)",
        ], rank
        assert out["same"] == (True, True, True), rank
        assert out["averaged"] == [0.5, 0.5], rank
        assert out["stepped"] == [0.0], rank
        assert out["both"] == "shard: got both group= and process_group=; pass process_group= only"
