"""``shardopt bench``: DDP, torch's ZeRO, the drop-in and shardopt stages 1 and 2, interleaved."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from typing import Any

__all__ = ["add_bench_parser", "run_bench"]


def add_bench_parser(commands: Any) -> None:
    """Adds the ``bench`` subcommand to ``commands`` (an argparse subparsers object)."""
    from shardopt.devtools.bench._run import MODELS, OVERLAP_BUCKET_NUMEL, Variant

    p = commands.add_parser(
        "bench",
        help="DDP + Adam, DDP + torch's ZeroRedundancyOptimizer, the drop-in and shardopt "
        "stages 1 and 2, interleaved",
        description="Runs every variant on the same model and batches on local gloo ranks, "
        "interleaved iteration by iteration (order rotated each round): "
        + "; ".join(v.value for v in Variant)
        + ". Reports median step() and iteration times, their ratios to DDP + torch ZeRO "
        "(parameters_as_bucket_view=True, Adam fused=True) and to DDP + Adam(fused=True) in "
        "each run, the median and min-max of every ratio over the runs, the fraction of "
        "reduce-scatter launched during backward, counted bytes per step, peak tensor bytes "
        "per rank and consolidation time; writes bench.json and bench.png.",
    )
    p.add_argument(
        "--world-size", type=int, nargs="+", default=[2, 4], help="world sizes (default: 2 4)"
    )
    p.add_argument(
        "--model",
        "--models",
        dest="model",
        default=None,
        help=f"one of {', '.join(MODELS)} (default: mlp-12x1024; --quick: tiny-mlp)",
    )
    p.add_argument(
        "--variants",
        nargs="+",
        default=None,
        help=f"a subset of {' '.join(v.name for v in Variant)} (default: all; "
        "DDP_ZERO always runs: it is the baseline)",
    )
    p.add_argument("--iters", type=int, default=None, help="timed rounds per run (default: 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds (default: 2)")
    p.add_argument("--repeats", type=int, default=None, help="runs per world size (default: 3)")
    p.add_argument(
        "--bucket-numel",
        type=int,
        default=OVERLAP_BUCKET_NUMEL,
        help="bucket_numel of the stage 2 variants (default: %(default)s; stage 1 keeps "
        "plan_partition's default)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="tiny-mlp, 2 rounds, 1 warm-up, 1 run: a check that it all runs (for CI)",
    )
    p.add_argument("--out-dir", default="out", help="where bench.json and bench.png go")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per world")
    p.set_defaults(run=run_bench)


def _pick(value: int | None, quick: bool, quick_default: int, default: int) -> int:
    if value is not None:
        return value
    return quick_default if quick else default


def run_bench(args: argparse.Namespace) -> int:
    """Runs the bench with parsed ``args``: ``repeats`` runs of every world size (the world
    sizes alternating), then the table, JSON and PNG."""
    from shardopt.cli.launch import launch
    from shardopt.devtools.bench._report import (
        bench_json,
        merge_run,
        render_bench_table,
        summarize,
        write_bench_png,
    )
    from shardopt.devtools.bench._run import BASELINE, BenchConfig, Variant, bench_rank

    if not args.world_size or any(w < 1 for w in args.world_size):
        raise ValueError(f"bench: expected world sizes >= 1, got {args.world_size}")
    repeats = _pick(args.repeats, args.quick, 1, 3)
    if repeats < 1:
        raise ValueError(f"bench: expected repeats >= 1, got {repeats}")
    variants = [v.name for v in Variant]
    if args.variants is not None:
        wanted = {BASELINE.name, *(v.upper() for v in args.variants)}
        variants = [v for v in variants if v in wanted] + sorted(wanted - set(variants))
    config = BenchConfig(
        model=args.model or ("tiny-mlp" if args.quick else "mlp-12x1024"),
        variants=tuple(variants),
        iters=_pick(args.iters, args.quick, 2, 10),
        warmup=_pick(args.warmup, args.quick, 1, 2),
        bucket_numel=args.bucket_numel,
    )
    results = []
    start = time.perf_counter()
    for run in range(repeats):
        for w in args.world_size:
            print(f"run {run + 1}/{repeats}, W={w}", flush=True)
            per_rank = launch(
                bench_rank, w, config, True, backend="gloo", timeout=args.timeout, api="bench"
            )
            results.extend(merge_run(run, per_rank))
    rows = summarize(results)
    settings = {
        **dataclasses.asdict(config),
        "world_sizes": args.world_size,
        "repeats": repeats,
        "backend": "gloo",
        "seconds": round(time.perf_counter() - start, 1),
    }
    print(render_bench_table(rows, settings))
    os.makedirs(args.out_dir, exist_ok=True)
    json_path = os.path.join(args.out_dir, "bench.json")
    with open(json_path, "w", encoding="utf-8") as file:
        json.dump(bench_json(rows, results, settings), file, indent=2)
        file.write("\n")
    title = (
        f"{config.model}, gloo CPU, {repeats} runs x {config.iters} rounds; "
        "bars: median ratio over runs, whiskers: min-max"
    )
    png_path = write_bench_png(rows, os.path.join(args.out_dir, "bench.png"), title)
    print(f"wrote {json_path} and {png_path} ({settings['seconds']} s)")
    return 0


if __name__ == "__main__":  # ``python -m shardopt.devtools.bench._cli``: the bench alone
    import sys

    _parser = argparse.ArgumentParser(prog="shardopt")
    add_bench_parser(_parser.add_subparsers(dest="command", required=True))
    _args = _parser.parse_args(["bench", *sys.argv[1:]])
    sys.exit(_args.run(_args))
