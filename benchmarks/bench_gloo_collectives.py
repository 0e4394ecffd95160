"""What each way of reducing and gathering one bucket costs under gloo on CPUs: the measurement
behind [Note: collective algorithms] (shardopt.functional picks "exchange" for gloo).

One world per size; every call runs on one 8 MiB float32 bucket, the calls interleaved round by
round after a barrier, one intra-op thread per rank; medians over the rounds of rank 0's time.

    python benchmarks/bench_gloo_collectives.py [--worlds 2 4] [--rounds 30]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_gloo_collectives.json"
NUMEL = 1 << 21  # 8 MiB of float32


def calls(world: int) -> dict[str, Callable[[], Any]]:
    full, out, scratch = torch.randn(NUMEL), torch.empty(NUMEL // world), torch.empty(NUMEL)
    blocks = list(full.chunk(world))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter": lambda: scatter(out, full),
        "reduce per owner": lambda: [dist.reduce(b, group_dst=r) for r, b in enumerate(blocks)],
        "all_to_all + sum": lambda: (
            dist.all_to_all_single(scratch, full),
            torch.sum(scratch.view(world, -1), 0, out=out),
        ),
        "all_gather": lambda: gather(full, out),
        "broadcast per owner": lambda: [
            dist.broadcast(b, group_src=r) for r, b in enumerate(blocks)
        ],
    }


def measure(rank: int, world: int, rounds: int) -> dict[str, float]:
    ops = calls(world)
    times: dict[str, list[float]] = {k: [] for k in ops}
    for i in range(rounds + 3):
        for name, op in ops.items():
            dist.barrier()
            start = time.perf_counter()
            op()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        medians = spawn(measure, world, args.rounds, backend="gloo", timeout=600)[0]
        rows.append({"world_size": world, "median_s": medians})
    names = list(rows[0]["median_s"])
    print("\none 8 MiB float32 bucket, gloo CPU, median ms")
    print(f"{'call':>20} " + " ".join(f"{'W=' + str(r['world_size']):>8}" for r in rows))
    for name in names:
        cells = " ".join(f"{r['median_s'][name] * 1e3:8.2f}" for r in rows)
        print(f"{name:>20} {cells}")
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
