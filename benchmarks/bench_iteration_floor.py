"""Where an iteration's time goes on this machine, and why overlap cannot hide it (issue 10).

``shardopt bench``'s 12x1024 MLP on W gloo ranks, five variants on the same batches, interleaved
iteration by iteration (order rotated each round; a deferred-gather variant runs a lead-in first,
after the round's barrier, as in the bench, so its forward waits for the gathers its previous
step left):

- ``compute only``: forward, backward and Adam(fused) on the whole model, no communication (every
  rank at once, so they share the cores as in the other variants): the floor.
- ``DDP + torch ZeRO``: the bench's baseline.
- ``stage 2, no overlap``: shardopt stage 2 without hooks: backward, then ``step`` reduces,
  updates and gathers, one thing after the other.
- ``stage 2 + grad hooks``: reductions overlap backward; gathers in ``step``.
- ``stage 2 + both overlaps``: and gathers overlap the next forward.
- ``stage 2 + param hooks``: reductions in ``step``, gathers overlap the next forward.

Each iteration's time is the slowest rank's; each run reports medians, and over runs the
median and min-max of each variant's ratio to the baseline. If the overlapped variants take as
long as the one without overlap, the machine has nothing idle to overlap with: communication
costs CPU time (gloo copies through the kernel), and the cores are all busy already.

    python benchmarks/bench_iteration_floor.py [--worlds 2 4] [--repeats 3] [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from shardopt.devtools.bench._run import MODELS, BenchConfig, Variant, _Runner
from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_iteration_floor.json"
NAMES = (
    "compute only",
    "DDP + torch ZeRO",
    "stage 2, no overlap",
    "stage 2 + grad hooks",
    "stage 2 + both overlaps",
    "stage 2 + param hooks",
)
BASELINE = "DDP + torch ZeRO"


class _Local:
    """Forward, backward and Adam(fused) on the whole model, no communication."""

    def __init__(self, config: BenchConfig, batch: Any) -> None:
        torch.manual_seed(config.seed)
        self.model = MODELS[config.model].build()
        self.opt = torch.optim.Adam(self.model.parameters(), lr=config.lr, fused=True)
        self.batch = batch

    def iteration(self, i: int) -> None:
        x, y = self.batch(i)
        self.opt.zero_grad(set_to_none=True)
        F.mse_loss(self.model(x), y).backward()
        self.opt.step()


def _runners(rank: int, config: BenchConfig) -> dict[str, Any]:
    zero = _Runner(Variant.DDP_ZERO, config, rank)
    plain = _Runner(Variant.STAGE2, config, rank)
    plain.hooks.remove()  # step reduces the full local gradients itself
    gathers = _Runner(Variant.STAGE2_OVERLAP, config, rank)
    gathers.hooks.remove()  # step reduces; its gathers overlap the next forward
    return {
        "compute only": _Local(config, zero.batch),
        "DDP + torch ZeRO": zero,
        "stage 2, no overlap": plain,
        "stage 2 + grad hooks": _Runner(Variant.STAGE2, config, rank),
        "stage 2 + both overlaps": _Runner(Variant.STAGE2_OVERLAP, config, rank),
        "stage 2 + param hooks": gathers,
    }


def _timed(runner: Any, i: int) -> float:
    dist.barrier()  # (gloo's barrier waits for the group's work in flight: it goes first)
    if getattr(runner, "deferred", False):
        runner.iteration(i)  # lead-in: leaves its gathers in flight for the timed one
    start = time.perf_counter()
    runner.iteration(i)
    seconds = time.perf_counter() - start
    if hasattr(runner, "settle"):
        runner.settle()
    slowest = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def measure(rank: int, world: int, rounds: int, warmup: int) -> dict[str, list[float]] | None:
    torch.set_num_threads(1)
    config = BenchConfig(iters=rounds, warmup=warmup)
    runners = _runners(rank, config)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    for i in range(warmup + rounds):
        order = NAMES[i % len(NAMES) :] + NAMES[: i % len(NAMES)]
        for name in order:
            seconds = _timed(runners[name], i)
            if i >= warmup:
                times[name].append(seconds)
    return times if rank == 0 else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    rows = []
    for world in args.worlds:
        runs = []
        for _ in tqdm(range(args.repeats), desc=f"W={world}"):
            times = spawn(measure, world, args.rounds, args.warmup, backend="gloo", timeout=1800)
            runs.append({n: statistics.median(t) for n, t in times[0].items()})
        for name in NAMES:
            ratios = [run[name] / run[BASELINE] for run in runs]
            ms = statistics.median(run[name] for run in runs) * 1e3
            rows.append(
                {
                    "world": world,
                    "variant": name,
                    "iteration_ms": [run[name] * 1e3 for run in runs],
                    "ratio_median": statistics.median(ratios),
                    "ratio_min": min(ratios),
                    "ratio_max": max(ratios),
                }
            )
            spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
            print(
                f"W={world} {name:24s} {ms:7.1f} ms  vs DDP + torch ZeRO "
                f"{statistics.median(ratios):.2f}x ({spread})"
            )
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
