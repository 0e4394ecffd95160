"""What keeping master weights as 16-bit remainders ([Note: master remainders]) costs a step:
``shard(..., master_dtype=torch.float32)`` with ``master_remainders=True`` and without,
interleaved round by round in one world (gloo, CPU).

The model: 12 bfloat16 Linear layers of 1024 x 1024 (weights and biases), AdamW, stage 1,
fixed bfloat16 gradients given to ``step``. Each round steps both variants once, alternating
which goes first; a round's time is the slowest rank's and the ratio remainders / float32 is
taken per round. Printed per world size: the median step times, the median, quartiles and
range of the per-round ratio, the spread of the median ratio over ``--repeats`` repeats, and
the master bytes each rank holds.

    python benchmarks/bench_master_remainders.py [--worlds 1 2] [--rounds 40] [--repeats 3]
    python benchmarks/bench_master_remainders.py --quick
    python benchmarks/bench_master_remainders.py --device cuda --worlds 1   # NCCL, one GPU a rank
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_master_remainders.json"
SHAPES = [s for _ in range(12) for s in ((1024, 1024), (1024,))]
VARIANTS = {"float32": False, "remainders": True}
WARMUP = 3


def _device() -> torch.device:
    """The rank's device: its GPU under NCCL, else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", dist.get_rank() % torch.cuda.device_count())
    return torch.device("cpu")


def _params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return [
        torch.nn.Parameter((torch.randn(s) * 0.02).to(_device(), torch.bfloat16)) for s in SHAPES
    ]


def build() -> dict[str, Any]:
    """Each variant's step as a callable, and the master bytes it holds."""
    from shardopt.cli.measure import storage_bytes
    from shardopt.core import adamw, plan_partition
    from shardopt.functional import shard

    gen = torch.Generator().manual_seed(1 + dist.get_rank())
    grads = [(torch.randn(s, generator=gen) * 1e-2).to(_device(), torch.bfloat16) for s in SHAPES]
    steps, held = {}, {}
    for name, remainders in VARIANTS.items():
        params = _params()
        plan = plan_partition(params, dist.get_world_size())
        sharded = shard(adamw(1e-3), plan, master_dtype=torch.float32, master_remainders=remainders)
        box = {"state": sharded.init(params)}

        def step(sharded: Any = sharded, params: Any = params, box: Any = box) -> None:
            box["state"] = sharded.step(params, grads, box["state"])

        steps[name] = step
        held[name] = storage_bytes(box["state"].master.stored)
    return {"steps": steps, "held": held}


def _finish() -> None:
    """Waits for the device's queued work (a GPU's; the CPU's is done)."""
    if _device().type == "cuda":
        torch.cuda.synchronize()


def measure(rank: int, world: int, rounds: int) -> dict[str, Any]:
    built = build()
    times: dict[str, list[float]] = {name: [] for name in VARIANTS}
    names = list(VARIANTS)
    for i in range(rounds + WARMUP):
        for name in names if i % 2 == 0 else names[::-1]:
            _finish()
            dist.barrier()
            start = time.perf_counter()
            built["steps"][name]()
            _finish()
            if i >= WARMUP:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "held": built["held"]}


def run(world: int, rounds: int, repeats: int, backend: str = "gloo") -> dict[str, Any]:
    medians: dict[str, list[float]] = {name: [] for name in VARIANTS}
    ratios: list[float] = []
    repeat_ratios = []
    for _ in range(repeats):
        per_rank = spawn(measure, world, rounds, backend=backend, timeout=1200)
        slowest = {
            k: [max(r["times"][k][i] for r in per_rank) for i in range(rounds)] for k in VARIANTS
        }
        these = [a / b for a, b in zip(slowest["remainders"], slowest["float32"])]
        ratios += these
        repeat_ratios.append(statistics.median(these))
        for k in VARIANTS:
            medians[k].append(statistics.median(slowest[k]))
    return {
        "world_size": world,
        "backend": backend,
        "rounds": rounds,
        "repeats": repeats,
        "median_ms": {k: statistics.median(v) * 1e3 for k, v in medians.items()},
        "ratio_median": statistics.median(ratios),
        "ratio_q1_q3": statistics.quantiles(ratios, n=4)[::2],
        "ratio_min_max": [min(ratios), max(ratios)],
        "ratio_median_per_repeat": repeat_ratios,
        "master_bytes_per_rank": {k: [r["held"][k] for r in per_rank] for k in VARIANTS},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="10 rounds, 1 repeat: a smoke run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: NCCL")
    args = parser.parse_args()
    rounds, repeats = (10, 1) if args.quick else (args.rounds, args.repeats)
    backend = "nccl" if args.device == "cuda" else "gloo"
    rows = [run(w, rounds, repeats, backend) for w in args.worlds]
    header = ("W", "f32 ms", "rem ms", "rem/f32", "q1-q3", "range", "per repeat", "MiB f32/rem")
    print("\n" + " | ".join(header))
    for r in rows:
        q1, q3 = r["ratio_q1_q3"]
        lo, hi = r["ratio_min_max"]
        per_repeat = " ".join(f"{x:.3f}" for x in r["ratio_median_per_repeat"])
        held = r["master_bytes_per_rank"]
        mib = f"{held['float32'][0] / 2**20:.1f}/{held['remainders'][0] / 2**20:.1f}"
        print(
            f"{r['world_size']} | {r['median_ms']['float32']:.2f} | "
            f"{r['median_ms']['remainders']:.2f} | {r['ratio_median']:.3f} | "
            f"{q1:.3f}-{q3:.3f} | {lo:.3f}-{hi:.3f} | {per_repeat} | {mib}"
        )
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
