"""``shardopt demo`` and ``python -m shardopt.demo`` (also under ``torchrun``): the command."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

__all__ = ["add_demo_parser", "main", "run_demo"]

_DESCRIPTION = (
    "Trains a small character GPT on this Python's standard library sources with shardopt's "
    "sharded AdamW across local processes (gloo on CPU by default, NCCL with one GPU a rank), "
    "then reports the loss, memory per rank against DDP + AdamW and torch's "
    "ZeroRedundancyOptimizer, the difference from a single-process AdamW run, and a sample. "
    "Under torchrun (torchrun --nproc-per-node N -m shardopt.demo) the world is torchrun's."
)


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=2, help="local ranks (default: 2)")
    p.add_argument("--stage", type=int, choices=(1, 2), default=2, help="ZeRO stage (default: 2)")
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default: 400)")
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl"),
        default="auto",
        help="auto: NCCL with one GPU per rank, else gloo (default: auto)",
    )
    p.add_argument(
        "--device",
        choices=("auto", "cpu", "cuda"),
        default="auto",
        help="auto: cuda under NCCL, else cpu (default: auto)",
    )
    p.add_argument("--out", default="out/demo.png", help="the PNG (default: out/demo.png)")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (default: 8)")
    p.add_argument("--width", type=int, default=64, help="model width (default: 64)")
    p.add_argument("--depth", type=int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--corpus-kib", type=int, default=300, help="corpus size (default: 300)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds (default: 1800)")


def add_demo_parser(commands: Any) -> None:
    """Adds the ``demo`` subcommand to ``commands`` (an argparse subparsers object)."""
    p = commands.add_parser(
        "demo", help="train a small GPT with shardopt on local ranks", description=_DESCRIPTION
    )
    _add_arguments(p)
    p.set_defaults(run=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Runs the demo with parsed ``args`` (locally, or in this torchrun process)."""
    import torch

    from shardopt.cli._demo_train import DemoConfig, train_rank
    from shardopt.cli.launch import (
        launch,
        leave_torchrun_worker,
        resolve_backend,
        run_under_torchrun,
        torchrun_env,
    )

    env = torchrun_env()
    if env is None and args.world_size < 1:
        raise ValueError(f"demo: expected --world-size >= 1, got {args.world_size}")
    backend = resolve_backend(args.backend, args.world_size if env is None else 1)
    device = args.device if args.device != "auto" else ("cuda" if backend == "nccl" else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"demo: expected --device cuda only where torch sees a GPU, got torch "
            f"{torch.__version__} without one (try --device cpu)"
        )
    config = DemoConfig(
        stage=args.stage,
        steps=args.steps,
        batch=args.batch,
        width=args.width,
        depth=args.depth,
        corpus_bytes=args.corpus_kib * 1024,
        device=device,
        out=args.out,
    )
    start = time.perf_counter()
    if env is not None:
        run_under_torchrun(train_rank, env, backend, config, backend, timeout=args.timeout)
        if env.rank == 0:
            print(f"wall time: {time.perf_counter() - start:.1f} s")
        leave_torchrun_worker(0)
    else:
        launch(
            train_rank,
            args.world_size,
            config,
            backend,
            backend=backend,
            timeout=args.timeout,
            api="demo",
        )
    print(f"wall time: {time.perf_counter() - start:.1f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m shardopt.demo [options]``: the demo's own entry point."""
    parser = argparse.ArgumentParser(prog="python -m shardopt.demo", description=_DESCRIPTION)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run_demo(args)
    except ValueError as exc:
        print(f"shardopt demo: error: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError) as exc:
        print(f"shardopt demo: {exc}", file=sys.stderr)
        return 1
