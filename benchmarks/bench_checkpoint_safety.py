"""What safe checkpoints cost (issue 37): ``save_checkpoint`` and ``load_checkpoint`` of HEAD
against the code before them, interleaved round by round.

Each variant runs in a world of its own (gloo, CPU, one process per rank, kept for the whole
run), importing shardopt from a temp dir: "after" from HEAD's sources (commit first), "before"
from the same with issue 37's own files (the checkpoint package, ``engine/_failure.py``, the
package's ``__init__``) as at ``--before``, so that only they differ. The driver asks each in
turn, alternating which goes first, to save (with ``overwrite=True`` over its previous save, so
each save also removes the one it supersedes) and then to load the checkpoint it just wrote. A
time is rank 0's, between barriers. The state: Adam on ``--mib`` MiB of float32 parameters
(flat plan over W ranks), saved with the parameters as ``extra``, as a training script does.
Printed: per operation the median time of each variant and the median and range of the
per-round ratio after/before, by the wall clock and by rank 0's CPU time (user + system).

    python benchmarks/bench_checkpoint_safety.py --world 1 --rounds 15
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / "out" / "bench_checkpoint_safety.json"
BEFORE = "2ed5477"  # the commit before issue 37's first
SRC = ["packages/core/src", "packages/functional/src", "packages/testing/src"]
# Issue 37's files: "before" is HEAD with these as they were at --before (so that only they
# differ between the variants, whatever else changed since).
OWN = [
    "packages/functional/src/shardopt/functional/checkpoint",
    "packages/functional/src/shardopt/functional/engine/_failure.py",
    "packages/functional/src/shardopt/functional/__init__.py",
]


def _worker(rank: int, world: int, store: str, root: str, mib: int) -> None:
    """A rank of one variant: builds the state, then runs the driver's commands (rank 0 reads
    them from stdin, broadcasts them, and prints each time)."""
    import torch
    import torch.distributed as dist

    from shardopt.core import adam, plan_partition
    from shardopt.functional import load_checkpoint, save_checkpoint, shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    numel = mib * (1 << 20) // 4
    shapes = [(numel // 8 // 512, 512)] * 8
    params = [torch.randn(s) for s in shapes]
    names = [f"layer{i}.weight" for i in range(len(params))]
    sharded = shard(adam(1e-3), plan_partition(params, world))
    state = sharded.step(params, [torch.randn(s) for s in shapes], sharded.init(params))
    path = os.path.join(root, "ckpt")
    extra = {"model": dict(zip(names, params))}
    ops = {
        1: lambda: save_checkpoint(state, path, names=names, extra=extra, overwrite=True),
        2: lambda: load_checkpoint(state, path, names=names, extra=extra),
    }
    while True:
        code = torch.tensor([0])
        if rank == 0:
            line = sys.stdin.readline().strip()
            code[0] = {"save": 1, "load": 2}.get(line, 0)
        dist.broadcast(code, 0)
        if code.item() == 0:
            break
        dist.barrier()
        start, cpu = time.perf_counter(), time.process_time()
        ops[int(code.item())]()
        cpu = time.process_time() - cpu  # (before the barrier: this rank's own work)
        dist.barrier()
        if rank == 0:
            print(f"{time.perf_counter() - start:.6f} {cpu:.6f}", flush=True)
    dist.destroy_process_group()


class Variant:
    """One variant's world: W processes with shardopt imported from ``src``."""

    def __init__(self, name: str, src: Path, world: int, scratch: str, mib: int) -> None:
        self.name = name
        root = os.path.join(scratch, name)
        os.makedirs(root)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(src / s) for s in SRC)}
        env["OMP_NUM_THREADS"] = "1"
        store = os.path.join(scratch, f"{name}.store")
        self.procs = [
            subprocess.Popen(
                [sys.executable, __file__, "--worker", str(r), str(world), store, root, str(mib)],
                env=env,
                stdin=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL,
                text=True,
            )
            for r in range(world)
        ]

    def time(self, op: str) -> tuple[float, float]:
        lead = self.procs[0]
        assert lead.stdin is not None
        assert lead.stdout is not None
        lead.stdin.write(op + "\n")
        lead.stdin.flush()
        line = lead.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: its world ended (see the error above)")
        wall, cpu = line.split()
        return float(wall), float(cpu)

    def close(self) -> None:
        lead = self.procs[0]
        if lead.stdin is not None:
            lead.stdin.write("stop\n")
            lead.stdin.flush()
        for p in self.procs:
            p.wait(timeout=60)


def _tree(rev: str, paths: list[str], into: str) -> None:
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", rev, *paths], check=True, capture_output=True
    ).stdout
    subprocess.run(["tar", "-x", "-C", into], input=archive, check=True)


def _before_tree(rev: str, into: str) -> Path:
    """HEAD's sources with issue 37's files (OWN) as at ``rev``."""
    _tree("HEAD", SRC, into)
    shutil.rmtree(os.path.join(into, OWN[0]))
    _tree(rev, OWN, into)
    return Path(into)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--before", default=BEFORE, help="the git revision to compare against")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--mib", type=int, default=32, help="MiB of float32 parameters")
    args = parser.parse_args()
    scratch = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        before = _before_tree(args.before, tempfile.mkdtemp(dir=scratch))
        after = tempfile.mkdtemp(dir=scratch)
        _tree("HEAD", SRC, after)
        variants = [
            Variant(name, src, args.world, scratch, args.mib)
            for name, src in (("before", before), ("after", Path(after)))
        ]
        times: dict[str, dict[str, list[tuple[float, float]]]] = {
            op: {v.name: [] for v in variants} for op in ("save", "load")
        }
        for v in variants:  # a warm-up round each (first saves, imports, page cache)
            v.time("save")
            v.time("load")
        for r in range(args.rounds):
            for v in variants if r % 2 == 0 else variants[::-1]:
                for op in ("save", "load"):
                    times[op][v.name].append(v.time(op))
        for v in variants:
            v.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    rows = _report(times, args)
    sys.path.insert(0, str(Path(__file__).parent))
    from _bench_io import write_results

    write_results(OUT.with_name(f"{OUT.stem}_w{args.world}.json"), rows)


def _report(times: dict[str, dict[str, list[tuple[float, float]]]], args: Any) -> list[dict]:
    rows = []
    print(
        f"W={args.world}, {args.mib} MiB of parameters, {args.rounds} rounds, before={args.before}"
    )
    print("clock  op    before ms  after ms  ratio med  ratio min..max")
    for clock, at in (("wall", 0), ("cpu", 1)):
        for op, by in times.items():
            before, after = ([t[at] for t in by[v]] for v in ("before", "after"))
            ratios = [a / b for a, b in zip(after, before)]
            row = {
                "clock": clock,
                "op": op,
                "world": args.world,
                "mib": args.mib,
                "before_ms": 1e3 * statistics.median(before),
                "after_ms": 1e3 * statistics.median(after),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
            rows.append(row)
            print(
                f"{clock:<7}{op:<6}{row['before_ms']:>9.1f}{row['after_ms']:>10.1f}"
                f"{row['ratio_median']:>11.3f}{row['ratio_min']:>9.3f}..{row['ratio_max']:.3f}"
            )
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        rank, world, store, root, mib = sys.argv[2:7]
        _worker(int(rank), int(world), store, root, int(mib))
    else:
        main()
