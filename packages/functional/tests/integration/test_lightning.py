"""Lightning's Trainer drives shardopt.optim.ZeroRedundancyOptimizer as it drives torch's.

The Trainer runs in the ranks of the harness's W=2 gloo world: with LOCAL_RANK set, Lightning's
default cluster environment takes the processes as launched externally (it spawns none) and its
DDP strategy finds the process group already initialised (it makes none), so the Trainer is the
one a user gets from ``strategy="ddp"`` under torchrun, without starting new interpreters.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.strategies import DDPStrategy
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

from shardopt.optim import ZeroRedundancyOptimizer, local_gradients_hook
from shardopt.testing import World

STEPS = 6  # optimizer steps in all; 3 batches per rank and epoch, so 2 epochs
EVERY = 3  # ModelCheckpoint's every_n_train_steps: the run resumes from step 3
BATCH = 4  # rows per rank and step
LR = 1e-2

# name: the class of the optimizer configure_optimizers returns (the ZeROs over AdamW).
OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "shardopt": ZeroRedundancyOptimizer,
    "torch_zero": TorchZeroRedundancyOptimizer,
    "adamw": torch.optim.AdamW,
}


class Regressor(pl.LightningModule):
    """A small MLP: six tensors, which ZeRO spreads over both ranks."""

    def __init__(self, optimizer: str) -> None:
        super().__init__()
        self.optimizer_name = optimizer
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.net = nn.Sequential(
                nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1)
            )

    def on_train_start(self) -> None:
        assert isinstance(self.trainer.strategy.model, DistributedDataParallel)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        cls: Any = OPTIMIZERS[self.optimizer_name]
        if cls is torch.optim.AdamW:
            return cls(self.parameters(), lr=LR, weight_decay=0.1)
        return cls(self.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1)


def loader() -> DataLoader[tuple[torch.Tensor, ...]]:
    """One epoch: EVERY steps of BATCH rows per rank (Lightning adds the DistributedSampler)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(EVERY * BATCH * 2, 8, generator=g)
    y = torch.randn(EVERY * BATCH * 2, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH)


def ddp_trainer(root: Path) -> pl.Trainer:
    """Lightning's DDP over the harness's world, to STEPS, checkpointing every EVERY steps into
    ``root``."""
    return pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS,
        callbacks=[ModelCheckpoint(dirpath=root, every_n_train_steps=EVERY, save_top_k=-1)],
        default_root_dir=root,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def fit(optimizer: str, root: Path, ckpt_path: str | None = None) -> list[torch.Tensor]:
    """Trains to STEPS under Lightning's DDP (from ``ckpt_path`` if given), checkpointing every
    EVERY steps into ``root``; returns the final parameters."""
    model = Regressor(optimizer)
    trainer = ddp_trainer(root)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    assert (trainer.global_step, trainer.world_size) == (STEPS, 2)
    assert type(trainer.optimizers[0]) is OPTIMIZERS[optimizer]
    return [p.detach().clone() for p in model.net.parameters()]


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_lightning_ddp_fit_and_resume_with_shardopt_zero_equal_torch_zero_and_adamw_bitwise(
    world: World, tmp_path: Path
) -> None:
    os.environ["LOCAL_RANK"] = str(world.rank)  # processes launched outside Lightning
    os.environ["NODE_RANK"] = "0"
    final: dict[str, list[torch.Tensor]] = {}
    for name in OPTIMIZERS:
        root = tmp_path / name
        uninterrupted = fit(name, root / "run")
        checkpoints = sorted(p.name for p in (root / "run").iterdir())
        assert checkpoints == [f"epoch=0-step={EVERY}.ckpt", f"epoch=1-step={STEPS}.ckpt"]
        saved = torch.load(root / "run" / checkpoints[0], weights_only=True)
        states = saved["optimizer_states"][0]["state"]  # whole, consolidated by Lightning
        assert sorted(states) == list(range(6)), f"{name}: {sorted(states)}"
        resumed = fit(name, root / "resumed", str(root / "run" / checkpoints[0]))
        for a, b in zip(resumed, uninterrupted, strict=True):
            assert torch.equal(a, b), f"{name}: resumed from step {EVERY} != uninterrupted"
        final[name] = resumed
    for name in ("torch_zero", "adamw"):
        for ours, theirs in zip(final["shardopt"], final[name], strict=True):
            assert torch.equal(ours, theirs), f"shardopt's ZeroRedundancyOptimizer != {name}"
    assert not torch.equal(final["adamw"][0], Regressor("adamw").net[0].weight)  # it trained


class WireRegressor(Regressor):
    """The drop-in with partition="flat" and ``comm_dtype`` (None: DDP averages); records
    whether the ranks' first gradients differ (DDP sent nothing) or agree (DDP averaged)."""

    def __init__(self, comm_dtype: torch.dtype | None) -> None:
        super().__init__("shardopt")
        self.comm_dtype = comm_dtype
        self.local_grads: bool | None = None

    def on_train_start(self) -> None:
        # DDPStrategy(ddp_comm_hook=) registers its hook on CUDA only: on the CPU, here
        if self.comm_dtype is not None:
            self.trainer.strategy.model.register_comm_hook(None, local_gradients_hook)

    def on_after_backward(self) -> None:
        if self.local_grads is None:
            mine = self.net[0].weight.grad.detach().clone()
            both = [torch.empty_like(mine) for _ in range(2)]
            torch.distributed.all_gather(both, mine)
            self.local_grads = not torch.equal(both[0], both[1])

    def configure_optimizers(self) -> Any:
        return ZeroRedundancyOptimizer(
            self.parameters(),
            torch.optim.AdamW,
            partition="flat",
            comm_dtype=self.comm_dtype,
            lr=LR,
            weight_decay=0.1,
        )


def fit_wire(
    comm_dtype: torch.dtype | None, root: Path, ckpt_path: str | None = None
) -> tuple[list[torch.Tensor], bool | None]:
    """fit() of a WireRegressor (with ``comm_dtype``, behind local_gradients_hook). Returns the
    final parameters and whether the gradients were local."""
    model = WireRegressor(comm_dtype)
    trainer = ddp_trainer(root)
    trainer.fit(model, loader(), ckpt_path=ckpt_path)
    assert trainer.global_step == STEPS
    return [p.detach().clone() for p in model.net.parameters()], model.local_grads


@pytest.mark.world(2, backend="gloo", timeout=120)
def test_lightning_with_the_local_hook_gives_the_drop_in_local_gradients_to_reduce_on_the_wire(
    world: World, tmp_path: Path
) -> None:
    os.environ["LOCAL_RANK"] = str(world.rank)
    os.environ["NODE_RANK"] = "0"
    averaged, local = fit_wire(None, tmp_path / "ddp")
    assert local is False  # DDP averaged: the ranks' gradients agree
    # a float32 wire sums the two local gradients and halves them: DDP's average, bit for bit
    wide, local = fit_wire(torch.float32, tmp_path / "f32")
    assert local is True  # DDP sent nothing
    for a, b in zip(wide, averaged, strict=True):
        assert torch.equal(a, b)
    narrow, _ = fit_wire(torch.bfloat16, tmp_path / "bf16" / "run")
    first = tmp_path / "bf16" / "run" / f"epoch=0-step={EVERY}.ckpt"
    resumed, _ = fit_wire(torch.bfloat16, tmp_path / "bf16" / "resumed", str(first))
    for a, b, c in zip(resumed, narrow, averaged, strict=True):
        assert torch.equal(a, b)  # resumed from step 3 == uninterrupted
        # the gradients' rounding: Adam moves an element at most LR a step; where a gradient is
        # near zero the rounding may flip its step, elsewhere the two runs stay within 1e-3
        diff = (a - c).abs()
        assert diff.max() <= STEPS * LR
        assert (diff > 1e-3).float().mean() < 0.02
    assert not all(torch.equal(a, c) for a, c in zip(narrow, averaged))
