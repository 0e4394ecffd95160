"""One large tensor at W = 1: shard's stage-1 step against torch.optim.AdamW(fused=True).

The "no regression on large tensors" check of the host-cost work (benchmarks/bench_host.py times
the many-tensor case): both variants alone in one process (gloo, one rank, one intra-op thread),
each on its own copy of the same parameter and gradient, interleaved step by step with the order
swapped every round; per repeat the median of the per-round ratios, over repeats their median
and spread. Usage: ``OMP_NUM_THREADS=1 python benchmarks/bench_host_large.py [--numel N]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist

from shardopt.core import adamw, plan_partition
from shardopt.functional import shard


def steppers(numel: int) -> dict[str, object]:
    gen = torch.Generator().manual_seed(0)
    value, grad = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen)
    ref = [torch.nn.Parameter(value.clone())]
    ref[0].grad = grad.clone()
    ours = [torch.nn.Parameter(value.clone())]
    ours[0].grad = grad.clone()
    torch_opt = torch.optim.AdamW(ref, lr=1e-3, fused=True)
    sharded = shard(adamw(lr=1e-3), plan_partition(ours, 1, bucket_numel=numel))
    box = [sharded.init(ours)]

    def step() -> None:
        box[0] = sharded.step(ours, None, box[0])

    return {"torch_fused": torch_opt.step, "shard_stage1": step}


def repeat(numel: int, rounds: int) -> float:
    """The median over ``rounds`` of shard's step time / torch's, interleaved."""
    fns = steppers(numel)
    names = list(fns)
    for fn in fns.values():
        fn()  # type: ignore[operator]
    ratios = []
    for i in range(rounds):
        took = {}
        for name in names if i % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            fns[name]()  # type: ignore[operator]
            took[name] = time.perf_counter() - start
        ratios.append(took["shard_stage1"] / took["torch_fused"])
    return statistics.median(ratios)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", type=int, default=8 * 1024 * 1024)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    ratios = [repeat(args.numel, args.rounds) for _ in range(args.repeats)]
    dist.destroy_process_group()
    print(
        f"{args.numel} float32 elements, W = 1: shard stage 1 / AdamW(fused=True) step, "
        f"median {statistics.median(ratios):.2f}x (spread {min(ratios):.2f}-{max(ratios):.2f} "
        f"over {args.repeats} repeats of {args.rounds} interleaved rounds)"
    )


if __name__ == "__main__":
    main()
