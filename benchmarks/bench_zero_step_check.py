"""What the agreement work costs step(): our ZeroRedundancyOptimizer's step with and without its
per-step gradient check (the only per-step addition; the agreements run at construction,
add_param_group and consolidation only).

One optimizer per world (greedy, bucket views, Adam fused), the same gradients every step; the
two variants alternate step by step on that same optimizer (the check switched off by swapping
the module's function between steps, outside the timed region), the order flipped each round.
A step's time is the slowest rank's. Reported: per run the median of each variant and their
ratio; over runs the median and min-max of that ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_zero_step_check.json"
MODELS = {
    "mlp_12x1024": [(1024, 1024), (1024,)] * 12,  # 24 tensors, 12.6M elements
    "many_2000x256": [(256,)] * 2000,  # 2,000 small tensors: per-parameter work shows
}
VARIANTS = ("checked", "unchecked")


def measure(rank: int, world: int, model: str, rounds: int) -> dict[str, list[float]]:
    from shardopt.optim import ZeroRedundancyOptimizer
    from shardopt.optim.zero import _optimizer as zero_module

    checked = zero_module.check_grads
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in MODELS[model]]
    opt = ZeroRedundancyOptimizer(
        params, torch.optim.Adam, lr=1e-3, fused=True, parameters_as_bucket_view=True
    )
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-2
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(rounds + 4):
        for v in VARIANTS if i % 2 == 0 else VARIANTS[::-1]:
            zero_module.check_grads = checked if v == "checked" else (lambda *args: None)
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            zero_module.check_grads = checked
            if i >= 4:  # warm-up rounds
                times[v].append(elapsed)
    return times


def run_case(world: int, model: str, rounds: int) -> dict[str, Any]:
    per_rank = spawn(measure, world, model, rounds, backend="gloo", timeout=1200)
    slowest = {v: [max(r[v][i] for r in per_rank) for i in range(rounds)] for v in VARIANTS}
    median = {v: statistics.median(ts) for v, ts in slowest.items()}
    return {
        "world_size": world,
        "model": model,
        "median_step_s": median,
        "ratio": median["checked"] / median["unchecked"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    cases = [(w, m) for m in args.models for w in args.worlds] * args.repeats
    rows = [run_case(w, m, args.rounds) for w, m in tqdm(cases, desc="bench_zero_step_check")]
    print("\nstep() with / without the gradient check (gloo CPU, 1 thread per rank)")
    for w, m in dict.fromkeys((r["world_size"], r["model"]) for r in rows):
        mine = [r for r in rows if (r["world_size"], r["model"]) == (w, m)]
        ratios = sorted(r["ratio"] for r in mine)
        ms = statistics.median(r["median_step_s"]["checked"] for r in mine) * 1e3
        spread = f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
        print(f"{m:>14} W={w}: step {ms:.2f} ms, checked / unchecked {spread}, {len(mine)} runs")
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
