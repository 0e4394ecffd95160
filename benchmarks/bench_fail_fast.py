"""What failing together ([Note: failing together]) costs a successful step: step() with the
mechanism on and off, interleaved round by round in one world (gloo, CPU).

Variants: the drop-in (greedy, bucket views, Adam) and ``shard`` stage 2 (Adam, gradients
given), on the 12x1024 MLP, each once with the mechanism and once without (the switch the
module keeps for this benchmark), alternating which goes first. Each round's time is the
slowest rank's; the ratio on/off is taken per round. Printed: the medians and the median and
range of the per-round ratio.
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

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_fail_fast.json"
SHAPES = [s for _ in range(12) for s in ((1024, 1024), (1024,))]


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [torch.nn.Parameter(torch.randn(s) * 0.02) for s in SHAPES]


def _grads(params: list[torch.nn.Parameter]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(p.shape, generator=gen) * 1e-2 for p in params]


def build() -> dict[str, Any]:
    """Each variant's step as a callable."""
    from shardopt.core import adam, plan_partition
    from shardopt.functional import shard
    from shardopt.optim import ZeroRedundancyOptimizer

    params = _params()
    zero = ZeroRedundancyOptimizer(
        params, torch.optim.Adam, lr=1e-3, parameters_as_bucket_view=True
    )
    for p, g in zip(params, _grads(params)):
        p.grad = g
    flat = _params()
    sharded = shard(adam(1e-3), plan_partition(flat, dist.get_world_size()), stage=2)
    box = {"state": sharded.init(flat)}
    grads = _grads(flat)

    def shard_step() -> None:
        box["state"] = sharded.step(flat, grads, box["state"])

    return {"zero_step": zero.step, "shard_step": shard_step}


def measure(rank: int, world: int, rounds: int) -> dict[str, list[float]]:
    import shardopt.functional.engine._failure as failure

    steps = build()
    times: dict[str, list[float]] = {f"{v}/{m}": [] for v in steps for m in ("on", "off")}
    for i in range(rounds + 2):
        modes = ("on", "off") if i % 2 == 0 else ("off", "on")
        for name, step in steps.items():
            for mode in modes:
                failure._state["enabled"] = mode == "on"
                dist.barrier()
                start = time.perf_counter()
                step()
                if i >= 2:  # two rounds of warm-up
                    times[f"{name}/{mode}"].append(time.perf_counter() - start)
    failure._state["enabled"] = True
    return times


def run(world: int, rounds: int) -> dict[str, Any]:
    per_rank = spawn(measure, world, rounds, backend="gloo", timeout=1200)
    slowest = {k: [max(r[k][i] for r in per_rank) for i in range(rounds)] for k in per_rank[0]}
    out: dict[str, Any] = {"world_size": world, "rounds": rounds, "variants": {}}
    for name in ("zero_step", "shard_step"):
        on, off = slowest[f"{name}/on"], slowest[f"{name}/off"]
        ratios = [a / b for a, b in zip(on, off)]
        out["variants"][name] = {
            "median_on_ms": statistics.median(on) * 1e3,
            "median_off_ms": statistics.median(off) * 1e3,
            "ratio_median": statistics.median(ratios),
            "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2],
            "ratio_min_max": [min(ratios), max(ratios)],
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args()
    rows = [run(w, args.rounds) for w in tqdm(args.worlds, desc="bench_fail_fast")]
    header = ("W", "step", "on ms", "off ms", "on/off", "q1-q3", "range")
    widths = (2, 10, 7, 7, 7, 13, 13)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        for name, v in r["variants"].items():
            q1, q3 = v["ratio_q1_q3"]
            lo, hi = v["ratio_min_max"]
            on, off = v["median_on_ms"], v["median_off_ms"]
            print(
                f"{r['world_size']:>2} {name:>10} {on:7.2f} {off:7.2f} {v['ratio_median']:7.3f} "
                f"{q1:6.3f}-{q3:6.3f} {lo:6.3f}-{hi:6.3f}"
            )
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
