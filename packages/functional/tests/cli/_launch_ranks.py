"""Rank functions for the launch tests: module-level in an importable module, as the CLI's
spawned ranks import ``fn`` by name (see [Note: CLI worlds])."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist


def summed(rank: int, world: int, base: int) -> tuple[int, int]:
    t = torch.tensor([rank + base])
    dist.all_reduce(t)
    return rank, int(t)


def fails_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        raise ZeroDivisionError("rank 1 divides by zero")
    dist.barrier()  # rank 0 waits for a peer that never comes


def stuck_on_every_rank(rank: int, world: int) -> None:
    time.sleep(600)


def dies_on_rank_1(rank: int, world: int) -> None:
    if rank == 1:
        os._exit(3)  # no traceback, no report
    dist.barrier()
