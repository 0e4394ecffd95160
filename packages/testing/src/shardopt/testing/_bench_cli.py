"""``shardopt bench``: DDP, torch's ZeRO and shardopt stages 1 and 2 side by side, same run."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from typing import Any

__all__ = ["add_bench_parser", "run_bench"]

_QUICK_MODELS = ("tiny-mlp", "tiny-gpt")


def add_bench_parser(commands: Any) -> None:
    """Adds the ``bench`` subcommand to ``commands`` (an argparse subparsers object)."""
    p = commands.add_parser(
        "bench",
        help="DDP + Adam, DDP + torch's ZeroRedundancyOptimizer and shardopt stages 1 and 2",
        description="Runs DDP + torch.optim.Adam(fused=True), DDP + torch's "
        "ZeroRedundancyOptimizer (parameters_as_bucket_view=True, Adam fused=True) and shardopt "
        "stages 1 and 2 (flat plan) on the same model and data on local gloo ranks; measures "
        "median step() and iteration times, counted bytes per step, peak tensor bytes per rank "
        "and consolidation time; prints ratios against torch's ZeRO, writes JSON and a PNG.",
    )
    p.add_argument(
        "--world-size", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)"
    )
    p.add_argument(
        "--models",
        nargs="+",
        default=None,
        help="mlp-12x1024, gpt2-small, tiny-mlp, tiny-gpt (default: the first two)",
    )
    p.add_argument("--iters", type=int, default=5, help="timed iterations (default: 5)")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations (default: 1)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny models and 2 iterations: a check that it all runs (for CI)",
    )
    p.add_argument("--out-dir", default="out", help="where bench.json and bench.png go")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per world")
    p.set_defaults(run=run_bench)


def run_bench(args: argparse.Namespace) -> int:
    """Runs the bench with parsed ``args``: one world per world size, then the outputs."""
    from shardopt.testing._bench_report import (
        bench_json,
        merge_ranks,
        render_bench_table,
        write_bench_png,
    )
    from shardopt.testing._bench_run import BenchConfig, bench_rank
    from shardopt.testing._cli_launch import launch

    if any(w < 1 for w in args.world_size):
        raise ValueError(f"bench: expected world sizes >= 1, got {args.world_size}")
    models = tuple(args.models or (_QUICK_MODELS if args.quick else BenchConfig().models))
    iters = 2 if args.quick and args.iters == 5 else args.iters
    config = BenchConfig(models=models, iters=iters, warmup=args.warmup)
    rows = []
    for w in args.world_size:
        per_rank = launch(
            bench_rank, w, config, True, backend="gloo", timeout=args.timeout, api="bench"
        )
        rows.extend(merge_ranks(per_rank))
    print(render_bench_table(rows))
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "bench.json")
    with open(json_path, "w", encoding="utf-8") as file:
        settings = {**dataclasses.asdict(config), "world_sizes": args.world_size, "backend": "gloo"}
        json.dump(bench_json(rows, settings), file, indent=2)
    png_path = write_bench_png(rows, os.path.join(args.out_dir, "bench.png"))
    print(f"wrote {json_path} and {png_path}")
    return 0
