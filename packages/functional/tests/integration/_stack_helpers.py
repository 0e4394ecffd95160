"""What the stack tests share: a tiny random-init GPT-2, its data, the optimizers compared."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.testing import World

LR = 1e-3


def join_from_env(world: World) -> None:
    """What accelerate reads to join the harness's process group."""
    os.environ.update(
        RANK=str(world.rank),
        LOCAL_RANK=str(world.rank),
        WORLD_SIZE=str(world.world_size),
        LOCAL_WORLD_SIZE=str(world.world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="0",
    )


def tiny_gpt2(**config: Any) -> torch.nn.Module:
    """A random-init GPT-2 (2 layers, width 32, vocabulary 128, 16 positions, no dropout unless
    ``config`` says otherwise), the same on every call and rank; the caller's RNG is left alone."""
    from transformers import GPT2Config, GPT2LMHeadModel

    sizes = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 128, "n_positions": 16}
    no_dropout = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    tokens = {"bos_token_id": 0, "eos_token_id": 0}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return GPT2LMHeadModel(GPT2Config(**{**sizes, **no_dropout, **tokens, **config}))


def dataset() -> list[dict[str, torch.Tensor]]:
    rows = []
    for i in range(64):
        ids = torch.randint(0, 128, (16,), generator=torch.Generator().manual_seed(i))
        rows.append({"input_ids": ids, "labels": ids})
    return rows


def make_optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    params = model.parameters()
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=LR)
    if kind == "torch_zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

        return TorchZero(params, torch.optim.AdamW, lr=LR)
    return ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=LR, partition=kind)


def shared_dir(world: World) -> Path:
    """One fresh directory for the whole world (rank 0 makes it)."""
    name = [tempfile.mkdtemp(prefix="shardopt-trainer-") if world.rank == 0 else None]
    dist.broadcast_object_list(name, src=0)
    return Path(str(name[0]))


def assert_same(
    ours: list[torch.Tensor], theirs: list[torch.Tensor], what: str, partition: str
) -> None:
    """Bitwise for greedy (torch's AdamW steps each rank's parameters); within float32 rounding
    for flat (shardopt.core's AdamW, the tolerance of the drop-in's own torch comparison)."""
    assert len(ours) == len(theirs)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if partition == "greedy":
            assert torch.equal(a, b), f"{what}: parameter {i} differs by {(a - b).abs().max():.3e}"
        else:
            err = (a - b).abs().max().item()
            assert err <= 1e-6, f"{what}: parameter {i} differs by {err:.3e}"
