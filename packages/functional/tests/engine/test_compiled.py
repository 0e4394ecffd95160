"""shard(..., compile=...): the choice of the compiled update, its validation and its fallback.

These tests never compile (compiling takes seconds to minutes on a small CPU): the ones that do
are in tests/compiled/, collected with SHARDOPT_COMPILED=1 (see its conftest.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.core import adamw, lion, muon, plan_partition
from shardopt.functional import shard
from shardopt.functional.engine import _compiled
from shardopt.functional.engine._compiled import compiled_update

EAGER = "shard: compile: running the update eagerly: "


def params_of(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 3, generator=gen), torch.randn(4, generator=gen)]


# [Note: one-rank tests] The tests below that step a shard() need a process group. They run in a
# one-rank world (a fresh process), never in pytest's: on torch 2.4 a gloo group destroyed in the
# process that made it can deadlock in its destructor while holding the GIL, where no timeout can
# reach it. A fresh process also makes the module patches below (no monkeypatch) its own.


@pytest.mark.parametrize("value", ["yes", 1, None, 0.0, "True"])
def test_compile_other_than_true_false_or_auto_is_refused_naming_shard(value):
    with pytest.raises(ValueError, match=r"shard: expected compile True, False or 'auto', got"):
        shard(adamw(1e-3), plan_partition(params_of(), 1), compile=value)


@pytest.mark.world(1)
@pytest.mark.parametrize(("mode", "compiled"), [("auto", False), (False, False), (True, True)])
def test_auto_stays_eager_below_the_threshold_and_true_compiles_any_size(mode, compiled):
    params = params_of()
    state = shard(adamw(1e-3), plan_partition(params, 1), compile=mode).init(params)
    assert (compiled_update(state.param_buffers) is not None) is compiled


@pytest.mark.world(1)
def test_auto_compiles_a_composed_transformation_from_the_threshold_never_a_fused_one():
    params = params_of()
    numel = sum(p.numel() for p in params)
    for threshold, tx, compiled in [
        (numel, lion(1e-3), True),  # a chain of blocks: compiled from AUTO_NUMEL on
        (numel + 1, lion(1e-3), False),
        (numel, adamw(1e-3), False),  # its piece rule runs torch's fused kernel already
    ]:
        _compiled.AUTO_NUMEL = threshold
        state = shard(tx, plan_partition(params, 1)).init(params)
        assert (compiled_update(state.param_buffers) is not None) is compiled, (threshold, tx)


@pytest.mark.world(1)
def test_no_compiler_warns_once_naming_why_and_steps_as_eager():
    _compiled.compile_blocker = lambda device: "no C++ compiler (test)"
    eager_params, params = params_of(), params_of()
    eager = shard(lion(1e-2), plan_partition(params, 1), compile=False)
    eager_state = eager.init(eager_params)
    sharded = shard(lion(1e-2), plan_partition(params, 1), compile=True)
    with pytest.warns(UserWarning, match=EAGER + r"no C\+\+ compiler \(test\)") as caught:
        state = sharded.init(params)
    assert len(caught) == 1
    for seed in (1, 2):
        eager_state = eager.step(eager_params, params_of(seed), eager_state)
        state = sharded.step(params, params_of(seed), state)
    assert all(torch.equal(a, b) for a, b in zip(params, eager_params))


@pytest.mark.world(1)
def test_true_with_a_transformation_that_needs_whole_tensors_warns_and_runs_eagerly():
    params = [torch.randn(4, 4), torch.randn(3, 5)]
    plan = plan_partition(params, 1, strategy="greedy")
    with pytest.warns(UserWarning, match=EAGER + "the transformation needs whole tensors"):
        state = shard(muon(lr=0.1), plan, compile=True).init(params)
    assert compiled_update(state.param_buffers) is None


def failing_compile(rank_fails: Any) -> Any:
    """A stand-in for torch.compile: the function runs eagerly (changing the parameters and
    state), then raises on the ranks ``rank_fails`` picks, as a compile error would."""

    def compile_(fn: Any) -> Any:
        def run(*args: Any) -> None:
            fn(*args)
            if rank_fails(dist.get_rank()):
                raise RuntimeError("unsupported op aten::made_up\nsecond line")

        return run

    return compile_


def fallback_after_failure(rank: int, world: int, fails_on: tuple[int, ...]) -> dict[str, Any]:
    import warnings

    _compiled._compile = failing_compile(lambda r: r in fails_on)
    out: dict[str, Any] = {}
    params, eager_params = params_of(), params_of()
    plan = plan_partition(params, world)
    sharded = shard(adamw(1e-2), plan, compile=True)
    eager = shard(adamw(1e-2), plan, compile=False)
    state, eager_state = sharded.init(params), eager.init(eager_params)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in (1, 2, 3):
            state = sharded.step(params, params_of(seed), state)
            eager_state = eager.step(eager_params, params_of(seed), eager_state)
    out["warnings"] = [str(w.message) for w in caught]
    out["equal"] = all(torch.equal(a, b) for a, b in zip(params, eager_params))
    out["fallback"] = compiled_update(state.param_buffers).fallback
    return out


# rank 0 compiled and rank 1 failed: both fall back
@pytest.mark.parametrize(("world", "fails_on"), [(1, (0,)), (2, (1,))])
def test_a_failed_first_compile_restores_warns_once_and_every_rank_steps_as_eager(
    run_world, world, fails_on
):
    why = "RuntimeError: unsupported op aten::made_up"
    for rank, out in enumerate(run_world(fallback_after_failure, world, fails_on)):
        expected = why if rank in fails_on else "another rank's compile failed"
        assert out["warnings"] == [EAGER + f"the first compile failed ({expected})"], rank
        assert out["equal"], f"rank {rank}: the parameters differ from the eager path's"
        assert out["fallback"] is not None


def decided_with_a_compiler_on_rank_0_only(rank: int, world: int) -> dict[str, Any]:
    import warnings

    _compiled.compile_blocker = lambda device: None if rank == 0 else "no C++ compiler (test)"
    _compiled.AUTO_NUMEL = 10  # the greedy plan gives rank 0 the 15-element matrix, rank 1 4
    params = params_of()
    plan = plan_partition(params, world, strategy="greedy")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = shard(lion(1e-2), plan).init(params)
        state = shard(lion(1e-2), plan).step(params, params_of(1), state)
    return {
        "owned": plan.numel_per_rank()[rank],
        "warnings": [str(w.message) for w in caught],
        "compiled": compiled_update(state.param_buffers) is not None,
    }


def test_every_rank_decides_alike_by_the_plans_largest_shard_and_every_ranks_compiler(
    run_world,
):
    """Rank 1 owns fewer elements than AUTO_NUMEL and has no compiler: "auto" decides by the
    largest shard on both ranks, agrees that one lacks a compiler, and both run eagerly (a rank
    compiling alone would wait alone in its first step's agreement)."""
    out = run_world(decided_with_a_compiler_on_rank_0_only, 2)
    assert [o["owned"] for o in out] == [15, 4]
    assert out[0]["warnings"] == [EAGER + "another rank cannot compile"]
    assert out[1]["warnings"] == [EAGER + "no C++ compiler (test)"]
    assert [o["compiled"] for o in out] == [False, False]
