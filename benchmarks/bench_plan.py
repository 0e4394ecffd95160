"""Times plan_partition on 10,000 mixed tensors against torch ZeRO's assignment; GPT-2 imbalance."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.distributed.optim import ZeroRedundancyOptimizer
from tqdm import tqdm

from shardopt.core import Plan, plan_partition

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_plan.json"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
TARGET_S = 1.0


def mixed_tensors(n: int, seed: int = 0) -> list[list[torch.Tensor]]:
    """``n`` meta tensors of mixed shapes and dtypes in two param groups (matrices, the rest)."""
    rng = random.Random(seed)
    matrices, others = [], []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.45:
            shape: tuple[int, ...] = (rng.randint(16, 4096), rng.randint(16, 4096))
        elif kind < 0.55:
            shape = (rng.choice([32, 64, 128, 256]), rng.choice([3, 64]), 3, 3)
        elif kind < 0.95:
            shape = (rng.randint(1, 8192),)
        else:
            shape = ()
        t = torch.empty(shape, dtype=rng.choice(DTYPES), device="meta")
        (matrices if t.dim() >= 2 else others).append(t)
    return [matrices, others]


def gpt2_small() -> list[torch.Tensor]:
    """GPT-2 small's 148 parameters (124,439,808 elements) on the meta device."""
    block = [(768,), (768,), (768, 2304), (2304,), (768, 768), (768,)]
    block += [(768,), (768,), (768, 3072), (3072,), (3072, 768), (768,)]
    shapes = [(50257, 768), (1024, 768), *block * 12, (768,), (768,)]
    return [torch.empty(s, device="meta") for s in shapes]


def best_of(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    """The fastest of ``repeat`` runs of ``fn`` in seconds, and its last result."""
    best, out = float("inf"), None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - start)
    return best, out


def torch_zero_assignment(groups: list[list[torch.Tensor]], world_size: int) -> Any:
    """torch's own greedy assignment, run on an instance built without a process group."""
    zero = object.__new__(ZeroRedundancyOptimizer)
    zero.world_size = world_size
    zero.param_groups = [{"params": g} for g in groups]
    zero._partition_parameters_cache = []
    return zero._partition_parameters()


def bench_case(groups: list[list[torch.Tensor]], world_size: int, strategy: str, repeat: int):
    """One row: plan time (from tensors), pieces of every rank, JSON round trip, torch baseline."""
    plan_s, plan = best_of(lambda: plan_partition(groups, world_size, strategy=strategy), repeat)
    pieces_s, _ = best_of(lambda: [plan.pieces(r) for r in range(world_size)], repeat)
    json_s, _ = best_of(lambda: Plan.from_json(plan.to_json()), repeat)
    torch_s, _ = best_of(lambda: torch_zero_assignment(groups, world_size), repeat)
    return {
        "strategy": strategy,
        "world_size": world_size,
        "tensors": len(plan.tensors),
        "groups": len(plan.groups),
        "plan_s": plan_s,
        "all_pieces_s": pieces_s,
        "json_round_trip_s": json_s,
        "torch_zero_assign_s": torch_s,
        "plan_vs_torch": plan_s / torch_s,
        "imbalance": plan.imbalance(),
        "under_target": plan_s < TARGET_S,
    }


def allgather_send_bytes(plan: Plan) -> int:
    """Bytes each rank sends in one parameter all-gather: a ring all-gather of every bucket
    sends ``(W - 1) / W`` of the bucket's buffer (padding included) per rank."""
    w = plan.world_size
    return sum(
        (w - 1) * b.numel * torch.empty(0, dtype=getattr(torch, g.dtype)).element_size() // w
        for g in plan.groups
        for b in g.buckets
    )


def gpt2_figures() -> list[dict[str, Any]]:
    """Imbalance, buckets and all-gather bytes of GPT-2 small at a few world sizes, both
    strategies, with plan_partition's default bucket_numel."""
    params, rows = gpt2_small(), []
    for world_size in (8, 64):
        for strategy in ("flat", "greedy"):
            plan = plan_partition(params, world_size, strategy=strategy)
            rows.append(
                {
                    "world_size": world_size,
                    "strategy": strategy,
                    "bucket_numel": plan.bucket_numel,
                    "buckets": sum(len(g.buckets) for g in plan.groups),
                    "imbalance": plan.imbalance(),
                    "max_rank_MB": max(plan.bytes_per_rank()) / 1e6,
                    "allgather_send_MB_per_rank": allgather_send_bytes(plan) / 1e6,
                }
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    groups = mixed_tensors(args.tensors)
    cases = [(w, s) for w in (8, 1024) for s in ("flat", "greedy")]
    rows = [bench_case(groups, w, s, args.repeat) for w, s in tqdm(cases, desc="bench_plan")]
    print(f"\nplan_partition on {args.tensors} meta tensors, {len(DTYPES)} dtypes, 2 param groups")
    print(f"(best of {args.repeat}; plan = specs + owners + layout + full validation;")
    print(" torch = ZeroRedundancyOptimizer._partition_parameters, owner assignment only)")
    head = f"{'strategy':>8} {'W':>5} {'plan s':>8} {'torch s':>8} {'ratio':>6} "
    print(head + f"{'pieces s':>9} {'json s':>7} {'imbal.':>7} {'<1 s':>5}")
    for r in rows:
        print(
            f"{r['strategy']:>8} {r['world_size']:>5} {r['plan_s']:>8.4f} "
            f"{r['torch_zero_assign_s']:>8.4f} {r['plan_vs_torch']:>6.2f} "
            f"{r['all_pieces_s']:>9.4f} "
            f"{r['json_round_trip_s']:>7.4f} {r['imbalance']:>7.4f} {r['under_target']!s:>5}"
        )
    gpt2 = gpt2_figures()
    print("\nGPT-2 small (124,439,808 params, float32): imbalance = max / mean bytes per rank")
    for g in gpt2:
        print(
            f"  W={g['world_size']:<3} {g['strategy']:>6}: imbalance {g['imbalance']:.4f}, "
            f"{g['buckets']} buckets, largest rank {g['max_rank_MB']:.1f} MB, "
            f"all-gather send {g['allgather_send_MB_per_rank']:.1f} MB/rank"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, "python": platform.python_version(), "cpus": os.cpu_count()}
    OUT.write_text(json.dumps({"meta": meta, "cases": rows, "gpt2_small": gpt2}, indent=2) + "\n")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
