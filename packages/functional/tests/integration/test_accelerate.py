"""accelerate with shardopt's ZeroRedundancyOptimizer: prepare, train, save_state, load_state.

A tiny random-init GPT-2 at W=2 (gloo, CPU) in accelerate's own loop, compared with the same loop
on ``torch.optim.AdamW``. torch's own ZeroRedundancyOptimizer fails in ``prepare``, where
``AcceleratedOptimizer`` asks it for ``state_dict()`` on every rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _stack_helpers import (
    assert_same,
    dataset,
    join_from_env,
    make_optimizer,
    shared_dir,
    tiny_gpt2,
)

from shardopt.optim import ConsolidateOnSave
from shardopt.testing import World

STEPS, SAVE_AT = 6, 3


def batches(rank: int) -> list[torch.Tensor]:
    rows = dataset()
    return [
        torch.stack([r["input_ids"] for r in rows[8 * s + 4 * rank :][:4]]) for s in range(STEPS)
    ]


def run(kind: str, rank: int, save: Path | None, load: Path | None) -> list[torch.Tensor]:
    """Steps 1..STEPS (from SAVE_AT + 1 after ``load_state(load)``); ``save_state(save)`` after
    step SAVE_AT. Returns the final parameters."""
    from accelerate import Accelerator
    from transformers import get_linear_schedule_with_warmup

    accelerator = Accelerator(cpu=True)
    model = tiny_gpt2()
    opt = make_optimizer(kind, model)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    accelerator.register_save_state_pre_hook(ConsolidateOnSave(opt))
    first = 0
    if load is not None:
        accelerator.load_state(str(load))
        first = SAVE_AT
    for step, ids in enumerate(batches(rank)[first:], start=first + 1):
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if save is not None and step == SAVE_AT:
            # flat: the parameters are views of one buffer, which safetensors takes for shared
            # tensors and keeps one of (its load then misses the others): save with torch.save.
            accelerator.save_state(str(save), safe_serialization=kind == "greedy")
    return [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=180)
def test_accelerate_saves_and_resumes_as_adamw(world: World, partition: str) -> None:
    join_from_env(world)
    root = shared_dir(world)
    expected = run("adamw", world.rank, None, None)
    ours = run(partition, world.rank, root / "state", None)
    assert_same(ours, expected, f"{partition} against AdamW", partition)
    saved: Any = torch.load(root / "state" / "optimizer.bin", weights_only=True)
    assert len(saved["state"]) == len(ours)  # the global state, from the main process
    resumed = run(partition, world.rank, None, root / "state")
    assert_same(resumed, expected, f"{partition} resumed from step {SAVE_AT}", partition)


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_torch_zero_fails_in_prepare(world: World) -> None:
    join_from_env(world)
    with pytest.raises(RuntimeError, match="has not been consolidated"):
        run("torch_zero", world.rank, None, None)
