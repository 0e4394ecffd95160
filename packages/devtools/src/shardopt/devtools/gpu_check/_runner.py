"""The GPU check's command: ``python -m shardopt.devtools.gpu_check`` and ``shardopt gpu-check``."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from shardopt.devtools.gpu_check._report import Item, Report, Status, failed_item, write_report

__all__ = [
    "ITEMS",
    "add_arguments",
    "add_gpu_check_parser",
    "default_out",
    "main",
    "parse_items",
    "run_gpu_check",
    "unavailable",
]

DESCRIPTION = (
    "Checks shardopt on one CUDA device and writes report.json and report.md: (a) the pytest "
    "tests marked gpu, (b) every core optimizer against torch.optim in float32 and bfloat16 with "
    "float32 masters, (c) shard stages 1/2, flat/greedy, both overlaps, the drop-in and "
    "checkpoints on a small GPT against torch.optim.AdamW(fused=True), (d) host syncs in "
    "step(), (e) the fused AdamW update's bandwidth against a device copy, (f) step() time "
    "against torch's AdamW and ZeroRedundancyOptimizer, (g) shardopt demo. Without CUDA it "
    "prints one line and exits 0."
)
ITEMS = {
    "a": "pytest -m gpu",
    "b": "core optimizers vs torch.optim",
    "c": "shard, drop-in and checkpoints on a GPT",
    "d": "host syncs in step()",
    "e": "fused AdamW bandwidth",
    "f": "step() time vs torch",
    "g": "shardopt demo",
}
ORDER = "agbcdef"  # the subprocesses first (they have timeouts); in-process items after
IN_GROUP = frozenset("bcdf")  # items that need the world of one rank
REPORT_ENV = "SHARDOPT_GPU_REPORT"


def default_out(environ: dict[str, str] | None = None) -> str:
    """The report folder when ``--out`` is not given: $SHARDOPT_GPU_REPORT, else out/gpu.

    Example:
        >>> default_out({}), default_out({"SHARDOPT_GPU_REPORT": "/tmp/r"})
        ('out/gpu', '/tmp/r')
    """
    env = os.environ if environ is None else environ
    return env.get(REPORT_ENV) or "out/gpu"


def parse_items(text: str) -> list[str]:
    """The item letters of ``--items`` ("all", or letters, with or without commas) in run order.

    Example:
        >>> parse_items("c,b"), parse_items("all") == list(ORDER)
        (['b', 'c'], True)
    """
    wanted = set(ORDER) if text == "all" else {c for c in text.replace(",", "") if c != " "}
    unknown = sorted(wanted - set(ITEMS))
    if unknown or not wanted:
        raise argparse.ArgumentTypeError(f"expected 'all' or letters of {ORDER}, got {text!r}")
    return [c for c in ORDER if c in wanted]


def _repo_root() -> str:
    """The checkout this module runs from (packages/functional/src/shardopt/devtools/gpu_check/),
    else the current folder."""
    root = Path(__file__).resolve().parents[6]
    return str(root) if (root / "packages").is_dir() else os.getcwd()


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of the check (``--device``/``--backend`` are hidden: CPU runs are for tests)."""
    p.add_argument("--out", default=None, help=f"report folder (default: ${REPORT_ENV} or out/gpu)")
    p.add_argument("--items", type=parse_items, default=list(ORDER), help="letters of " + ORDER)
    p.add_argument("--demo-steps", type=int, default=40, help="the demo's steps (default: 40)")
    p.add_argument("--pytest-timeout", type=float, default=300.0, help="seconds (default: 300)")
    p.add_argument("--budget", type=float, default=450.0, help="seconds; later items SKIP")
    p.add_argument("--repo", default=None, help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--backend", choices=("nccl", "gloo"), default=None, help=argparse.SUPPRESS)


def add_gpu_check_parser(commands: Any) -> None:
    """Adds ``gpu-check`` to ``commands`` (an argparse subparsers object)."""
    p = commands.add_parser("gpu-check", help="check shardopt on a GPU; write a report",
                            description=DESCRIPTION)  # fmt: skip
    add_arguments(p)
    p.set_defaults(run=run_gpu_check)


def unavailable(device: str) -> str | None:
    """The one line to print when the check cannot run here (no torch, or no CUDA device for
    ``device="cuda"``); None when it can."""
    if importlib.util.find_spec("torch") is None:
        return f"shardopt gpu-check: skipped: {sys.executable} cannot import torch; no report"
    if device == "cpu":
        return None
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a CUDA build without a driver warns as it probes
        found = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if found:
        return None
    return f"shardopt gpu-check: skipped: torch {torch.__version__} sees no CUDA device; no report"


@contextlib.contextmanager
def one_rank_world(backend: str, device: Any) -> Iterator[None]:
    """The default process group of one rank (NCCL on CUDA, gloo on the CPU), unless one is
    already initialised (a test's world); destroyed after if made here."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _checks(args: argparse.Namespace, device: Any, out: str) -> dict[str, Callable[[], list[Item]]]:
    from shardopt.devtools.gpu_check import _demo_item, _junit, _optimizers, _perf, _training

    repo = args.repo or _repo_root()
    return {
        "a": lambda: _junit.run_gpu_tests(repo, out, args.pytest_timeout),
        "b": lambda: _optimizers.check_optimizers(device),
        "c": lambda: _training.check_training(device) + _training.check_checkpoints(device),
        "d": lambda: _perf.check_syncs(device),
        "e": lambda: _perf.check_bandwidth(device),
        "f": lambda: _perf.check_step_times(device),
        "g": lambda: [_demo_item.run_demo(device.type, out, args.demo_steps, 300.0)],
    }


def run_item(report: Report, letter: str, check: Callable[[], list[Item]], left: float) -> None:
    """Runs one item into ``report``: its items, or one FAIL with the error if it raised, or
    one SKIP when the time budget is spent (``left`` seconds <= 0)."""
    name = f"{letter}/{ITEMS[letter]}"
    if left <= 0:
        report.items.append(Item(name, Status.SKIP, "the time budget (--budget) was spent"))
        return
    start = time.perf_counter()
    try:
        items = check()
    except Exception as exc:
        items = [failed_item(name, exc)]
    seconds = time.perf_counter() - start
    for item in items:
        item.seconds = seconds if item.seconds is None else item.seconds
    report.items.extend(items)


def run_gpu_check(args: argparse.Namespace) -> int:
    """Runs the check with parsed ``args``; 0 when no item failed (or it cannot run here)."""
    line = unavailable(args.device)
    if line is not None:
        print(line)
        return 0
    import torch

    from shardopt.devtools.gpu_check._report import environment

    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    backend = args.backend or ("nccl" if device.type == "cuda" else "gloo")
    out = args.out or default_out()
    report = Report({**environment(torch, str(device)), "backend": backend})
    checks, start = _checks(args, device, out), time.perf_counter()
    outside = [c for c in args.items if c not in IN_GROUP]
    inside = [c for c in args.items if c in IN_GROUP]
    for letter in outside:
        run_item(report, letter, checks[letter], args.budget - (time.perf_counter() - start))
        write_report(report, out)
    if inside:
        left = args.budget - (time.perf_counter() - start)
        _run_in_world(report, inside, checks, backend, device, out, left)
    json_path, md_path = write_report(report, out)
    counts = report.counts()
    summary = ", ".join(f"{v} {k}" for k, v in counts.items())
    print(f"shardopt gpu-check: {summary}; {json_path} and {md_path}")
    return 1 if counts[Status.FAIL.value] else 0


def _run_in_world(report: Report, letters: list[str], checks: Any, backend: str, device: Any,
                  out: str, budget: float) -> None:  # fmt: skip
    start = time.perf_counter()
    try:
        with one_rank_world(backend, device):
            for letter in letters:
                run_item(report, letter, checks[letter], budget - (time.perf_counter() - start))
                write_report(report, out)
    except Exception as exc:  # the world itself failed to start or to end
        report.items.append(failed_item(f"setup/{backend} world of one rank", exc))


def main(argv: list[str] | None = None) -> int:
    """``python -m shardopt.devtools.gpu_check [options]``."""
    prog = "python -m shardopt.devtools.gpu_check"
    parser = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    add_arguments(parser)
    return run_gpu_check(parser.parse_args(argv))
