"""What a per-step LR scheduler costs ZeroRedundancyOptimizer(partition="flat").step(), before
and after the hyperparameters moved into the optimizer state (issue 11, item 5).

- before: ``FlatShardOptimizer`` as of commit 352dfd5, its source read with ``git show`` and
  loaded as a module of its own, running on today's engine and core: on a changed lr its
  ``_refresh`` rebuilds the core transformation, calls ``shard`` again and probes the state
  twice (its fields and their initial values).
- after: today's ``FlatShardOptimizer``: ``_refresh`` puts the new lr into the unit's state with
  ``set_hyperparams``; each update builds the core transformation from the state's values.

One world, two optimizers (before, after; Adam, lr 1e-3), each on its own copy of the model,
the same gradients every step. Each round times four steps, in an order rotated each round:
each optimizer with its lr unchanged ("constant") and with a new lr written into its param
group just before ``step()``, as a LambdaLR stepping every iteration does ("scheduled"; the
write is outside the timed region). A step's time is the slowest rank's. Reported per run: the
median of each variant, the ratios scheduled / constant of each implementation and after /
before of each variant; over runs the median and min-max of each ratio.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from tqdm import tqdm

from shardopt.testing import spawn

from _bench_io import write_results

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "bench_lr_schedule.json"
BEFORE_COMMIT = "352dfd5"  # the last commit with the rebuilding _refresh
MODELS = {
    "mlp_12x1024": [(1024, 1024), (1024,)] * 12,  # 24 tensors, 12.6M elements
    "small_8x128": [(128, 128), (128,)] * 8,  # 132K elements: the fixed per-step costs show
    "many_2000x256": [(256,)] * 2000,  # 2,000 small tensors: per-parameter work shows
}
VARIANTS = ("before_constant", "before_scheduled", "after_constant", "after_scheduled")


def before_module(source: str) -> Any:
    """The module ``shardopt.optim._zero_flat`` as of BEFORE_COMMIT, under a name of its own."""
    name = "shardopt.optim._zero_flat_before"
    spec = importlib.util.spec_from_loader(name, loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    exec(compile(source, f"{BEFORE_COMMIT}:_zero_flat.py", "exec"), module.__dict__)
    return module


def build(model: str, flat_class: Any) -> tuple[list[torch.Tensor], Any]:
    """The model's parameters and a flat ZeroRedundancyOptimizer whose local optimizer is
    ``flat_class``."""
    from shardopt.optim import ZeroRedundancyOptimizer
    from shardopt.optim import _zero as zero_module

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in MODELS[model]]
    today = zero_module.FlatShardOptimizer
    zero_module.FlatShardOptimizer = flat_class
    try:
        opt = ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=1e-3, partition="flat")
    finally:
        zero_module.FlatShardOptimizer = today
    assert type(opt.optim) is flat_class
    return params, opt


def measure(rank: int, world: int, model: str, rounds: int, source: str) -> dict[str, list[float]]:
    from shardopt.optim import _zero_flat

    opts = {
        "before": build(model, before_module(source).FlatShardOptimizer),
        "after": build(model, _zero_flat.FlatShardOptimizer),
    }
    gen = torch.Generator().manual_seed(rank)
    for params, _ in opts.values():
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    lr = 1e-3
    for i in range(rounds + 4):
        order = VARIANTS[i % 4 :] + VARIANTS[: i % 4]
        for variant in order:
            which, kind = variant.split("_")
            opt = opts[which][1]
            if kind == "scheduled":
                lr *= 0.999
                opt.param_groups[0]["lr"] = lr
            dist.barrier()
            start = time.perf_counter()
            opt.step()
            elapsed = time.perf_counter() - start
            if i >= 4:  # warm-up rounds
                times[variant].append(elapsed)
    return times


def run_case(world: int, model: str, rounds: int, source: str) -> dict[str, Any]:
    per_rank = spawn(measure, world, model, rounds, source, backend="gloo", timeout=1200)
    slowest = {v: [max(r[v][i] for r in per_rank) for i in range(rounds)] for v in VARIANTS}
    median = {v: statistics.median(ts) for v, ts in slowest.items()}
    return {
        "world_size": world,
        "model": model,
        "median_step_s": median,
        "ratios": {
            "before_scheduled/constant": median["before_scheduled"] / median["before_constant"],
            "after_scheduled/constant": median["after_scheduled"] / median["after_constant"],
            "scheduled_after/before": median["after_scheduled"] / median["before_scheduled"],
            "constant_after/before": median["after_constant"] / median["before_constant"],
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    path = "packages/functional/src/shardopt/optim/_zero_flat.py"
    source = subprocess.run(
        ["git", "show", f"{BEFORE_COMMIT}:{path}"], cwd=ROOT, check=True, capture_output=True
    ).stdout.decode()
    cases = [(w, m) for m in args.models for w in args.worlds] * args.repeats
    rows = [run_case(w, m, args.rounds, source) for w, m in tqdm(cases, desc="bench_lr_schedule")]
    print("\nflat ZeroRedundancyOptimizer.step(), Adam, lr set before each step or not (gloo CPU)")
    for w, m in dict.fromkeys((r["world_size"], r["model"]) for r in rows):
        mine = [r for r in rows if (r["world_size"], r["model"]) == (w, m)]
        steps = ", ".join(
            f"{v} {statistics.median(r['median_step_s'][v] for r in mine) * 1e3:.3f} ms"
            for v in VARIANTS
        )
        print(f"{m:>14} W={w} ({len(mine)} runs): {steps}")
        for name in mine[0]["ratios"]:
            ratios = sorted(r["ratios"][name] for r in mine)
            spread = f"{statistics.median(ratios):.3f} ({ratios[0]:.3f}-{ratios[-1]:.3f})"
            print(f"{'':>16}{name}: {spread}")
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
