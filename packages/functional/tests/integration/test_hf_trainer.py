"""HF Trainer with shardopt's ZeroRedundancyOptimizer: trains, saves every N steps, resumes.

Every case runs the same tiny random-init GPT-2 through ``transformers.Trainer`` at W=2 (gloo,
CPU) and compares with the same Trainer run on ``torch.optim.AdamW`` (which DDP keeps whole on
every rank). torch's own ZeroRedundancyOptimizer cannot even start: accelerate's
``AcceleratedOptimizer`` asks it for ``state_dict()`` on every rank before any step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from _stack_helpers import assert_same, dataset, make_optimizer, shared_dir, tiny_gpt2
from _stack_helpers import join_from_env as trainer_env

from shardopt.optim import ConsolidateOnSave
from shardopt.testing import World

STEPS, SAVE_EVERY = 6, 3


def train(kind: str, out: Path, *, resume: str | None = None) -> Any:
    """A Trainer run; returns (final parameters, the trainer)."""
    from transformers import Trainer, TrainingArguments, get_linear_schedule_with_warmup

    model = tiny_gpt2()
    opt = make_optimizer(kind, model)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    args = TrainingArguments(
        output_dir=str(out),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        save_strategy="steps",
        save_steps=SAVE_EVERY,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        logging_steps=1000,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=dataset(),
        optimizers=(opt, sched),
        callbacks=[ConsolidateOnSave()],  # a no-op for torch.optim.AdamW
    )
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in model.parameters()], trainer


@pytest.mark.parametrize("partition", ["greedy", "flat"])
@pytest.mark.world(2, backend="gloo", timeout=180)
def test_trainer_trains_saves_and_resumes_as_adamw_under_ddp(world: World, partition: str) -> None:
    trainer_env(world)
    root = shared_dir(world)
    expected, _ = train("adamw", root / "adamw")
    ours, trainer = train(partition, root / "ours")
    assert_same(ours, expected, f"{partition} against AdamW under DDP", partition)
    checkpoint = root / "ours" / f"checkpoint-{SAVE_EVERY}"
    saved = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    assert len(saved["state"]) == len(ours)  # the global state: every parameter's entry
    assert sorted(saved["state"][0]) == ["exp_avg", "exp_avg_sq", "step"]
    resumed, _ = train(partition, root / "ours", resume=str(checkpoint))
    assert_same(resumed, expected, f"{partition} resumed from step {SAVE_EVERY}", partition)
    assert trainer.state.global_step == STEPS


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_torch_zero_fails_where_ours_trains(world: World) -> None:
    trainer_env(world)
    root = shared_dir(world)
    with pytest.raises(RuntimeError, match="has not been consolidated"):
        train("torch_zero", root / "torch")  # accelerate's state_dict() at prepare, every rank
    ours, _ = train("greedy", root / "ours")
    assert all(torch.isfinite(p).all() for p in ours)
