"""Host cost of one AdamW step as the number of tensors grows (gloo, CPU, one intra-op thread).

One model of 131,072 float32 elements, cut two ways: 16 tensors of 8192 or 2048 of 64; one
bucket. Variants, each on its own copy of the parameters with the same gradients:

- ``torch_fused``: ``torch.optim.AdamW(fused=True)`` on the whole model (no communication).
- ``shard_stage1``: ``shard(adamw(), plan, stage=1).step(params, None, state)``, ``.grad`` set
  once and kept, as a loop that zeroes them in place keeps them (at W = 1 they are views of the
  gradient shard from the first step on: [Note: gradients in the shard]).
- ``shard_stage1_fresh``: the same, given new ``.grad`` tensors before every step (out of the
  timer), as a loop that sets them to None gets from backward.
- ``shard_stage2_hooks``: backward with ``register_grad_hooks`` on a tiny graph
  (``sum((p * w).sum())``, so the gradients are ``w``), then stage 2's ``step``.
- ``backward_only``: the same backward on a copy without hooks, then every ``.grad`` set to
  None, as torch's ``zero_grad()`` does: a torch loop frees its gradients outside ``step()``,
  stage 2 frees each one inside, once packed (about 1 us a tensor on this CPU).
  ``stage2_net`` is ``shard_stage2_hooks`` minus it, round by round: the hooks' and the step's
  own cost.
- ``dropin_flat`` / ``dropin_greedy``: shardopt's ``ZeroRedundancyOptimizer`` over AdamW,
  ``partition="flat"``, or the default greedy one with ``fused=True``.

Every rank runs every variant; the graphs are built before the timer starts. A round times
each variant once (barrier, step, all-reduce MAX: the slowest rank counts), in an order
rotated round by round, after warm-up rounds. Per repeat (a fresh world) each variant gets
the median of its round times and the median of its per-round ratios to ``torch_fused``;
the table shows the median over repeats, with the ratio's min-max over repeats. ``growth``
is the median time with the most tensors over that with the fewest. Counts, from one step
after warm-up in the first repeat: aten operators dispatched (a ``TorchDispatchMode``) and
Python function calls (``sys.setprofile``), on every rank.

    python benchmarks/bench_host.py [--world-sizes 1 2] [--tensors 16 2048] [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm import tqdm

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_host.json"
NUMEL = 131_072
VARIANTS = (
    "torch_fused",
    "shard_stage1",
    "shard_stage1_fresh",
    "shard_stage2_hooks",
    "backward_only",
    "dropin_flat",
    "dropin_greedy",
)
NET = "stage2_net"  # shard_stage2_hooks - backward_only, round by round
BASELINE = "torch_fused"


class CountingMode(TorchDispatchMode):
    """Counts the aten operators dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def python_calls(fn: Callable[[], None]) -> int:
    """Python function calls made by ``fn()``, itself included (not the profiler's own)."""
    calls = 0

    def profile(frame: Any, event: str, arg: Any) -> None:
        nonlocal calls
        if event == "call":
            calls += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


class Variant:
    """One copy of the model and how to step it; ``prepare`` runs before the timer starts."""

    def __init__(self, params: list[torch.Tensor], step: Callable[[], None]) -> None:
        self.params = params
        self.step = step

    def prepare(self) -> None:
        pass


class Backward(Variant):
    """Forward on ``prepare``, backward (+ ``after``, e.g. a stage-2 step) on ``step``."""

    def __init__(
        self, params: list[torch.Tensor], weights: list[torch.Tensor], after: Callable[[], None]
    ) -> None:
        super().__init__(params, self._backward)
        self.weights, self.after, self.loss = weights, after, None

    def prepare(self) -> None:
        for p in self.params:
            p.grad = None
        self.loss = sum((p * w).sum() for p, w in zip(self.params, self.weights))

    def _backward(self) -> None:
        self.loss.backward()
        self.loss = None
        self.after()


class Fresh(Variant):
    """New ``.grad`` tensors (copies of ``grads``) on ``prepare``, as backward makes them."""

    def __init__(
        self, params: list[torch.Tensor], grads: list[torch.Tensor], step: Callable[[], None]
    ) -> None:
        super().__init__(params, step)
        self.grads = grads

    def prepare(self) -> None:
        for p, g in zip(self.params, self.grads):
            p.grad = g.clone()


def make_params(count: int, grads: list[torch.Tensor] | None, numel: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    size = numel // count
    params = [torch.nn.Parameter(torch.randn(size, generator=gen) * 0.02) for _ in range(count)]
    for p, g in zip(params, grads or []):
        p.grad = g.clone()
    return params


def build(name: str, count: int, world: int, grads: list[torch.Tensor], numel: int) -> Variant:
    from shardopt.core import adamw, plan_partition
    from shardopt.functional import register_grad_hooks, shard
    from shardopt.optim import ZeroRedundancyOptimizer

    hooked = name in ("shard_stage2_hooks", "backward_only")
    params = make_params(count, None if hooked else grads, numel)
    if name == "torch_fused":
        return Variant(params, torch.optim.AdamW(params, lr=1e-3, fused=True).step)
    if name.startswith("dropin"):
        kw = {"partition": "flat"} if name == "dropin_flat" else {"fused": True}
        opt = ZeroRedundancyOptimizer(params, torch.optim.AdamW, lr=1e-3, **kw)
        return Variant(params, opt.step)
    if name == "backward_only":  # and zero_grad(): what stage 2's hooks do for the loop
        return Backward(params, grads, lambda: [setattr(p, "grad", None) for p in params])
    stage = 1 if name.startswith("shard_stage1") else 2
    plan = plan_partition(params, world, bucket_numel=max(1 << 20, numel))  # one bucket
    tx = shard(adamw(lr=1e-3), plan, stage=stage)
    box = {"state": tx.init(params)}

    def step() -> None:
        box["state"] = tx.step(params, None, box["state"])

    if name == "shard_stage1_fresh":
        return Fresh(params, grads, step)
    if stage == 1:
        return Variant(params, step)
    box["hooks"] = register_grad_hooks(params, box["state"])
    return Backward(params, grads, step)


def timed(variant: Variant) -> float:
    variant.prepare()
    dist.barrier()
    start = time.perf_counter()
    variant.step()
    slowest = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def count_step(variant: Variant) -> dict[str, int]:
    variant.prepare()
    mode = CountingMode()
    with mode:
        variant.step()
    variant.prepare()
    return {"ops": mode.count, "calls": python_calls(variant.step)}


def measure_count(
    rank: int, world: int, count: int, rounds: int, warmup: int, counts: bool, numel: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(numel // count, generator=gen) * 1e-2 for _ in range(count)]
    built = {v: build(v, count, world, grads, numel) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(warmup + rounds):
        order = VARIANTS[i % len(VARIANTS) :] + VARIANTS[: i % len(VARIANTS)]
        for v in order:
            seconds = timed(built[v])
            if i >= warmup:
                times[v].append(seconds)
    tallies = {v: count_step(b) for v, b in built.items()} if counts else {}
    return {"times": times, "counts": tallies}


def measure(
    rank: int, world: int, tensors: list[int], rounds: int, warmup: int, counts: bool, numel: int
) -> dict[int, Any]:
    torch.set_num_threads(1)
    return {n: measure_count(rank, world, n, rounds, warmup, counts, numel) for n in tensors}


def with_net(times: dict[str, list[float]]) -> dict[str, list[float]]:
    net = [a - b for a, b in zip(times["shard_stage2_hooks"], times["backward_only"])]
    return {**times, NET: net}


def summarize(runs: list[dict[str, list[float]]]) -> dict[str, dict[str, Any]]:
    """Per variant: median ms over repeats and the per-round ratio's median and spread."""
    out = {}
    for v in (*VARIANTS, NET):
        medians = [statistics.median(run[v]) for run in runs]
        ratios = [statistics.median(a / b for a, b in zip(run[v], run[BASELINE])) for run in runs]
        out[v] = {
            "median_ms": statistics.median(medians) * 1e3,
            "median_ms_per_repeat": [m * 1e3 for m in medians],
            "ratio": statistics.median(ratios),
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        }
    return out


def rank_counts(per_rank: list[dict[int, Any]], n: int) -> dict[str, list[dict[str, int]]]:
    counts = {v: [r[n]["counts"][v] for r in per_rank] for v in VARIANTS}
    counts[NET] = [
        {k: s[k] - b[k] for k in s}
        for s, b in zip(counts["shard_stage2_hooks"], counts["backward_only"])
    ]
    return counts


def run_world(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs: dict[int, list[dict[str, list[float]]]] = {n: [] for n in args.tensors}
    counts: dict[int, Any] = {}
    for repeat in tqdm(range(args.repeats), desc=f"W={world}"):
        work = (args.tensors, args.rounds, args.warmup, repeat == 0, args.numel)
        per_rank = spawn(measure, world, *work, backend="gloo", timeout=1800)
        for n in args.tensors:
            runs[n].append(with_net(per_rank[0][n]["times"]))
            if repeat == 0:
                counts[n] = rank_counts(per_rank, n)
    stats = {n: summarize(runs[n]) for n in args.tensors}
    fewest = min(args.tensors)
    rows = []
    for n in args.tensors:
        for v, s in stats[n].items():
            growth = s["median_ms"] / stats[fewest][v]["median_ms"] if n != fewest else None
            row = {"world_size": world, "tensors": n, "variant": v, **s, "growth": growth}
            rows.append({**row, "counts_per_rank": counts[n][v]})
    return rows


def fmt_counts(per_rank: list[dict[str, int]], key: str) -> str:
    values = [c[key] for c in per_rank]
    return str(values[0]) if len(set(values)) == 1 else "/".join(map(str, values))


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("W", "tensors", "variant", "median ms", "vs torch", "spread", "growth", "ops/step")
    header += ("py calls/step",)
    widths = (2, 7, 19, 9, 8, 11, 6, 11, 13)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        cells = (
            r["world_size"],
            r["tensors"],
            r["variant"],
            f"{r['median_ms']:.3f}",
            f"{r['ratio']:.2f}x",
            f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}",
            "-" if r["growth"] is None else f"{r['growth']:.1f}x",
            fmt_counts(r["counts_per_rank"], "ops"),
            fmt_counts(r["counts_per_rank"], "calls"),
        )
        print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print(
        "(median ms: of the slowest rank's step; vs torch: median of per-round ratios to "
        "torch_fused, median over repeats, spread: min-max over repeats; growth: vs the fewest "
        "tensors; counts: one step, per rank as a/b where the ranks differ; stage2_net = "
        "shard_stage2_hooks - backward_only)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tensors", type=int, nargs="+", default=[16, 2048])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--numel", type=int, default=NUMEL, help="elements in all (float32)")
    parser.add_argument("--quick", action="store_true", help="5 rounds, 1 repeat, 1 warm-up")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.repeats, args.warmup = 5, 1, 1
    rows = [row for world in args.world_sizes for row in run_world(world, args)]
    print(f"\nAdamW, {args.numel} float32 elements, gloo (CPU), one intra-op thread per rank")
    print_table(rows)
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
