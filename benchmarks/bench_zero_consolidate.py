"""Times consolidate_state_dict of ours against torch's ZeroRedundancyOptimizer (Adam, gloo).

Every case runs in fresh gloo worlds: one rank process per rank, the 12x1024 MLP (12 layers of
Linear(1024, 1024), 12.6M float32 parameters, 100 MB of Adam state) and one optimizer step so
that the state exists. Time: wall seconds of ``consolidate_state_dict(to=0)`` + ``state_dict()``,
the slowest rank, median over repeats, ours and torch's alternating in one world. Memory: the
peak growth of rank 0's resident set during its first consolidation, sampled every 0.2 ms, in a
world of its own per implementation (glibc is told to give large blocks back at once, so that
freed memory does not hide later allocations).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_zero_consolidate.json"
ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "OMP_NUM_THREADS": "1"}
IMPLEMENTATIONS = ("torch", "ours", "ours_flat")


def build(impl: str, width: int, depth: int) -> Any:
    """A model and a stepped optimizer of ``impl`` over it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from shardopt.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])
    if impl == "torch":
        opt = TorchZero(model.parameters(), torch.optim.Adam, lr=1e-3)
    else:
        partition = "flat" if impl == "ours_flat" else "greedy"
        opt = ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, lr=1e-3, partition=partition
        )
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return opt


def forget(opt: Any) -> None:
    """Drops a previous consolidation, so that each one starts from nothing."""
    if hasattr(opt, "_all_state_dicts"):
        opt._all_state_dicts = []
    if hasattr(opt, "_saved"):
        opt._saved.consolidated = None
    gc.collect()


def consolidate(opt: Any, rank: int) -> float:
    """Seconds of one consolidation to rank 0 and its state_dict() there."""
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    opt.consolidate_state_dict(to=0)
    if rank == 0:
        sd = opt.state_dict()
        assert len(sd["state"]) > 0
    return time.perf_counter() - start


def time_ranks(rank: int, world: int, width: int, depth: int, repeat: int) -> dict[str, list]:
    opts = {impl: build(impl, width, depth) for impl in IMPLEMENTATIONS}
    times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    for i in range(repeat + 1):
        order = IMPLEMENTATIONS if i % 2 == 0 else IMPLEMENTATIONS[::-1]
        for impl in order:
            forget(opts[impl])
            seconds = consolidate(opts[impl], rank)
            if i > 0:  # the first round warms up
                times[impl].append(seconds)
    return times


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_growth(fn: Callable[[], Any]) -> int:
    """The largest resident-set growth while ``fn`` runs (a sampling thread)."""
    gc.collect()
    base, peak, running = rss_bytes(), [0], [True]

    def sample() -> None:
        while running[0]:
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0002)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        running[0] = False
        thread.join()
    return max(peak[0], rss_bytes()) - base


def memory_ranks(rank: int, world: int, impl: str, width: int, depth: int) -> int:
    opt = build(impl, width, depth)
    return peak_growth(lambda: consolidate(opt, rank))


def state_bytes(width: int, depth: int) -> int:
    return 2 * 4 * depth * (width * width + width)


def run_case(world: int, width: int, depth: int, repeat: int) -> dict[str, Any]:
    per_rank = spawn(time_ranks, world, width, depth, repeat, backend="gloo", env=ENV, timeout=900)
    slowest = {
        impl: [max(r[impl][i] for r in per_rank) for i in range(repeat)] for impl in IMPLEMENTATIONS
    }
    median = {impl: statistics.median(ts) for impl, ts in slowest.items()}
    peak = {
        impl: spawn(memory_ranks, world, impl, width, depth, backend="gloo", env=ENV, timeout=900)[
            0
        ]
        for impl in IMPLEMENTATIONS
    }
    return {
        "world_size": world,
        "model": f"{depth}x{width} MLP",
        "adam_state_bytes": state_bytes(width, depth),
        "median_s": median,
        "speedup_vs_torch": {impl: median["torch"] / median[impl] for impl in IMPLEMENTATIONS},
        "rank0_peak_rss_growth_bytes": peak,
        "peak_ratio_vs_torch": {impl: peak[impl] / peak["torch"] for impl in IMPLEMENTATIONS},
        "times_s": slowest,
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("W", "impl", "median ms", "speedup", "rank-0 peak MB", "ratio")
    widths = (2, 10, 10, 8, 15, 6)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        for impl in IMPLEMENTATIONS:
            print(
                f"{r['world_size']:>2} {impl:>10} {r['median_s'][impl] * 1e3:>10.1f} "
                f"{r['speedup_vs_torch'][impl]:>7.2f}x "
                f"{r['rank0_peak_rss_growth_bytes'][impl] / 2**20:>15.1f} "
                f"{r['peak_ratio_vs_torch'][impl]:>6.2f}"
            )
    print("(speedup: torch's median / this one's; ratio: this peak / torch's peak)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--quick", action="store_true", help="a small model, few repeats")
    args = parser.parse_args()
    if args.quick:
        args.width, args.depth, args.repeat = 128, 4, 2
    rows = [
        run_case(w, args.width, args.depth, args.repeat)
        for w in tqdm(args.worlds, desc="bench_zero_consolidate")
    ]
    print(f"\n{args.depth}x{args.width} MLP, Adam, gloo on CPU, one intra-op thread per rank")
    print_table(rows)
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
