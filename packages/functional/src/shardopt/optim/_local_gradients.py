"""A DDP communication hook that sends nothing, for an optimizer that reduces gradients itself."""

# No ``from __future__ import annotations``: DDP reads this hook's annotations as objects.

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["local_gradients_hook"]


def local_gradients_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """A DDP communication hook that leaves each bucket as it is: after ``backward`` every
    rank's ``p.grad`` is its own gradient, not DDP's average, and no bytes are sent.

    For ``ZeroRedundancyOptimizer(..., partition="flat", comm_dtype=torch.bfloat16)``, whose
    step reduces the local gradients itself (each element rounded once onto the wire, summed
    in float32 by the rank that owns it); DDP's all-reduce would only repeat that traffic.
    Register it on every rank: ``ddp.register_comm_hook(None, local_gradients_hook)``.

    Example:
        >>> import os, tempfile, torch, torch.distributed as dist
        >>> from torch.nn.parallel import DistributedDataParallel as DDP
        >>> store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        >>> dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        >>> ddp = DDP(torch.nn.Linear(2, 1))
        >>> ddp.register_comm_hook(None, local_gradients_hook)
        >>> ddp(torch.ones(3, 2)).sum().backward()
        >>> ddp.module.weight.grad.tolist()  # the local gradient: 3 ones per weight
        [[3.0, 3.0]]
        >>> dist.destroy_process_group()
    """
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(bucket.buffer())
    return done
