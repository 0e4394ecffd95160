"""Compiled flat updates (``shard(..., compile=True)``, [Note: compiled updates]) against built-in
fused AdamW on the same flat size, interleaved step by step in one world (gloo on CPU; with
``--device cuda``, NCCL on one GPU per rank).

Float32 parameters of ``--numel`` elements in ``--tensors`` equal tensors, stage 1, a flat plan,
fixed gradients given to ``step``. Variants (ratios to ``adamw fused``, built-in ``adamw`` run
eagerly through its fused piece rule):

- ``adamw chain``: ``chain(clip_by_global_norm(1.0), scale_by_adam(), add_decayed_weights(1e-2),
  scale_by_learning_rate(warmup_cosine_decay(...)))``, eager and compiled;
- ``adamw chain, clip``: the same with the elementwise ``clip(1.0)`` first (no reduction, so no
  graph break), compiled;
- ``lion``: ``lion(1e-4)`` (a chain of blocks), eager and compiled;
- ``adamw compiled``: built-in ``adamw`` with ``compile=True`` (its pure path compiled);
- bfloat16 parameters with float32 masters: ``f32 masters`` (fused AdamW, eager), against which
  ``remainders`` (``master_remainders=True``, eager) and ``remainders compiled`` are reported.

Each round steps every variant once, in an order rotated round by round; a round's time is the
slowest rank's, and each ratio is taken per round. Printed per world size: median milliseconds,
the median ratio with quartiles, the median ratio per repeat (its spread over ``--repeats``), the
first step's time of each compiled variant (its compile) and the graphs it compiled (1: no graph
break), and the graphs compiled after the first step by the compiled chain over at least 100
steps of its schedule (recompiles).

    python benchmarks/bench_compiled_update.py [--worlds 1 2] [--rounds 20] [--repeats 2]
    python benchmarks/bench_compiled_update.py --quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_compiled_update.json"
WARMUP = 2
SCHEDULE_STEPS = 100
BASE, MASTER_BASE = "adamw fused", "f32 masters"
# name: (transformation, compile, bfloat16 parameters with float32 masters, remainders)
VARIANTS = {
    BASE: ("adamw", False, False, False),
    "adamw chain eager": ("chain", False, False, False),
    "adamw chain compiled": ("chain", True, False, False),
    "adamw chain, clip, compiled": ("chain clip", True, False, False),
    "lion eager": ("lion", False, False, False),
    "lion compiled": ("lion", True, False, False),
    "adamw compiled": ("adamw", True, False, False),
    MASTER_BASE: ("adamw", False, True, False),
    "remainders": ("adamw", False, True, True),
    "remainders compiled": ("adamw", True, True, True),
}


def _tx(name: str) -> Any:
    from shardopt.core import (
        adamw,
        add_decayed_weights,
        chain,
        clip,
        clip_by_global_norm,
        lion,
        scale_by_adam,
        scale_by_learning_rate,
        warmup_cosine_decay,
    )

    if name.startswith("chain"):
        lr = warmup_cosine_decay(1e-3, 10, 1000)
        first = clip(1.0) if name == "chain clip" else clip_by_global_norm(1.0)
        return chain(first, scale_by_adam(), add_decayed_weights(1e-2), scale_by_learning_rate(lr))
    return lion(1e-4) if name == "lion" else adamw(1e-3)


def build(numel: int, tensors: int, device: str = "cpu") -> dict[str, Any]:
    """Each variant's step as a callable, and its first step's time."""
    from shardopt.core import plan_partition
    from shardopt.functional import shard

    shapes = [numel // tensors] * tensors
    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    grads32 = [(torch.randn(s, generator=gen) * 1e-2).to(device) for s in shapes]
    grads16 = [g.bfloat16() for g in grads32]
    steps, first, boxes = {}, {}, {}
    for name, (which, compiled, half, remainders) in VARIANTS.items():
        torch.manual_seed(0)
        dtype = torch.bfloat16 if half else torch.float32
        params = [torch.randn(s).to(device, dtype) for s in shapes]
        opts = {"master_dtype": torch.float32, "master_remainders": remainders} if half else {}
        plan = plan_partition(params, dist.get_world_size(), strategy="flat")
        sharded = shard(_tx(which), plan, compile=compiled, **opts)
        box = {"state": sharded.init(params)}
        grads = grads16 if half else grads32

        def step(
            sharded: Any = sharded, params: Any = params, box: Any = box, g: Any = grads
        ) -> None:
            box["state"] = sharded.step(params, g, box["state"])

        _sync(device)
        start = time.perf_counter()
        step()
        _sync(device)
        first[name] = time.perf_counter() - start
        steps[name], boxes[name] = step, box
    return {"steps": steps, "first": first, "boxes": boxes}


def _sync(device: str) -> None:
    """Every rank here, and (on CUDA) every launched kernel done."""
    if device == "cuda":
        torch.cuda.synchronize()
    dist.barrier()


def measure(
    rank: int, world: int, rounds: int, numel: int, tensors: int, device: str = "cpu"
) -> dict[str, Any]:
    from shardopt.functional.engine._compiled import compiled_update

    if device == "cuda":
        torch.cuda.set_device(rank)
    built = build(numel, tensors, device)
    names = list(VARIANTS)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(rounds + WARMUP):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            _sync(device)
            start = time.perf_counter()
            built["steps"][name]()
            if device == "cuda":
                torch.cuda.synchronize()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
        if rank == 0:
            print(".", end="", file=sys.stderr, flush=True)
    chain = "adamw chain compiled"
    for _ in range(max(0, SCHEDULE_STEPS - rounds - WARMUP)):  # the schedule's 100 steps
        built["steps"][chain]()
    update = compiled_update(built["boxes"][chain]["state"].param_buffers)
    compiled = [n for n in names if VARIANTS[n][1]]
    updates = {n: compiled_update(built["boxes"][n]["state"].param_buffers) for n in compiled}
    fallbacks = {n: u.fallback for n, u in updates.items()}  # type: ignore[union-attr]
    graphs = {n: u.graphs for n, u in updates.items()}  # type: ignore[union-attr]
    return {
        "times": times,
        "first": {n: built["first"][n] for n in compiled},
        "recompiles": None if update is None else update.recompiles,
        "steps": max(SCHEDULE_STEPS, rounds + WARMUP) + 1,
        "fallbacks": fallbacks,
        "graphs": graphs,
    }


def run(
    world: int, rounds: int, repeats: int, numel: int, tensors: int, device: str = "cpu"
) -> dict[str, Any]:
    ratios: dict[str, list[float]] = {n: [] for n in VARIANTS}
    per_repeat: dict[str, list[float]] = {n: [] for n in VARIANTS}
    medians: dict[str, list[float]] = {n: [] for n in VARIANTS}
    firsts, recompiles, fallbacks, graphs = [], [], [], []
    for _ in range(repeats):
        backend = "nccl" if device == "cuda" else "gloo"
        per_rank = spawn(
            measure, world, rounds, numel, tensors, device, backend=backend, timeout=3000
        )
        slowest = {
            n: [max(r["times"][n][i] for r in per_rank) for i in range(rounds)] for n in VARIANTS
        }
        for n in VARIANTS:
            base = slowest[MASTER_BASE if VARIANTS[n][2] else BASE]
            these = [a / b for a, b in zip(slowest[n], base)]
            ratios[n] += these
            per_repeat[n].append(statistics.median(these))
            medians[n].append(statistics.median(slowest[n]))
        firsts.append({n: max(r["first"][n] for r in per_rank) for n in per_rank[0]["first"]})
        recompiles.append(max(r["recompiles"] for r in per_rank))
        fallbacks.append(per_rank[0]["fallbacks"])
        graphs.append({n: max(r["graphs"][n] for r in per_rank) for n in per_rank[0]["graphs"]})
    return {
        "world_size": world,
        "device": device,
        "numel": numel,
        "tensors": tensors,
        "rounds": rounds,
        "repeats": repeats,
        "median_ms": {n: statistics.median(v) * 1e3 for n, v in medians.items()},
        "ratio_median": {n: statistics.median(v) for n, v in ratios.items()},
        "ratio_q1_q3": {n: statistics.quantiles(v, n=4)[::2] for n, v in ratios.items()},
        "ratio_median_per_repeat": per_repeat,
        "first_step_s_per_repeat": firsts,
        "recompiles_per_repeat": recompiles,
        "schedule_steps": per_rank[0]["steps"],
        "fallbacks": fallbacks,
        "graphs_per_repeat": graphs,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--numel", type=int, default=1 << 23)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--quick", action="store_true", help="5 rounds, 1 repeat, 2**20 elements")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    rounds, repeats = (5, 1) if args.quick else (args.rounds, args.repeats)
    numel = 1 << 20 if args.quick else args.numel
    rows = [run(w, rounds, repeats, numel, args.tensors, args.device) for w in args.worlds]
    for r in rows:
        where = f"{r['numel']} float32 elements in {r['tensors']} tensors on {r['device']}"
        print(f"\nW={r['world_size']}, {where}")
        print("variant | ms | ratio | q1-q3 | per repeat")
        for n in VARIANTS:
            q1, q3 = r["ratio_q1_q3"][n]
            reps = " ".join(f"{x:.3f}" for x in r["ratio_median_per_repeat"][n])
            base = MASTER_BASE if VARIANTS[n][2] else BASE
            print(
                f"{n} | {r['median_ms'][n]:.2f} | {r['ratio_median'][n]:.3f} (of {base}) | "
                f"{q1:.3f}-{q3:.3f} | {reps}"
            )
        for i, first in enumerate(r["first_step_s_per_repeat"]):
            text = ", ".join(f"{n} {s:.1f} s" for n, s in first.items())
            print(f"first step (compile), repeat {i}: {text}")
        print(
            f"recompiles of the compiled chain over {r['schedule_steps']} steps of its schedule: "
            f"{r['recompiles_per_repeat']}; fallbacks: {r['fallbacks']}"
        )
        print(f"graphs compiled by the first step: {r['graphs_per_repeat']}")
    write_results(args.out, rows)


if __name__ == "__main__":
    main()
