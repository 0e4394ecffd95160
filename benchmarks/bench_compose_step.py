"""step() of shard over an elementwise chain, this checkout against another git revision.

Issue 35 runs every sharded update in a scope (core's [Note: reductions across shards]); an
elementwise chain must not pay for it. Two worker processes, one importing this checkout's
packages and one a ``git worktree`` of ``--base`` (default: the commit before the scopes), each
hold a world of one rank (gloo) and the same parameters; the parent alternates which one steps
first, round by round, so that load on the machine hits both alike. Each round is ``--steps``
timed steps per variant; the report is the median of each and the per-round ratio's median and
quartiles. Run from the repository root with the venv's python:

    python benchmarks/bench_compose_step.py --rounds 30
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

WORKER = r"""
import statistics, sys, time, torch, torch.distributed as dist
torch.manual_seed(0)
from shardopt.core import add_decayed_weights, adamw, chain, clip, plan_partition
from shardopt.core import scale_by_adam, scale_by_learning_rate, partition
from shardopt.functional import shard
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
which, steps = sys.argv[1], int(sys.argv[2])
params = [torch.randn(256, 256) for _ in range(16)] + [torch.randn(256) for _ in range(16)]
grads = [torch.randn_like(p) for p in params]
if which == "composed":
    tx = chain(clip(1.0), scale_by_adam(), add_decayed_weights(1e-2), scale_by_learning_rate(1e-3))
elif which == "partition":
    labels = lambda ps: ["m" if p.dim() == 2 else "v" for p in ps]
    # the same optimizer on both labels: before the scopes a flat plan's 1-D pieces all went
    # to "v", so different ones would time different arithmetic, not the labelling
    tx = partition({"m": adamw(1e-3), "v": adamw(1e-3)}, labels)
else:
    tx = adamw(1e-3)
sharded = shard(tx, plan_partition(params, 1, strategy="flat"))
state = sharded.init(params)
for _ in range(3):
    state = sharded.step(params, grads, state)
print("ready", flush=True)
for line in sys.stdin:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        state = sharded.step(params, grads, state)
        times.append(time.perf_counter() - t)
    print(statistics.median(times), flush=True)
"""

SRC = ("packages/core/src", "packages/functional/src", "packages/testing/src")


def worker(root: str, which: str, steps: int) -> subprocess.Popen[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join(os.path.join(root, s) for s in SRC)
    cmd = [sys.executable, "-c", WORKER, which, str(steps)]
    proc = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "ready"
    return proc


def round_of(proc: subprocess.Popen[str]) -> float:
    assert proc.stdin is not None
    assert proc.stdout is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()
    return float(proc.stdout.readline())


def compare(base: str, which: str, rounds: int, steps: int) -> None:
    procs = {"before": worker(base, which, steps), "now": worker(os.getcwd(), which, steps)}
    times: dict[str, list[float]] = {"before": [], "now": []}
    for r in range(rounds):
        order = ["before", "now"] if r % 2 == 0 else ["now", "before"]
        for name in order:
            times[name].append(round_of(procs[name]))
    for proc in procs.values():
        proc.kill()
    ratios = sorted(n / b for n, b in zip(times["now"], times["before"]))
    q = statistics.quantiles(ratios, n=4)
    before, now = statistics.median(times["before"]), statistics.median(times["now"])
    print(
        f"{which:10s} before {1e3 * before:7.3f} ms  now {1e3 * now:7.3f} ms  "
        f"ratio median {statistics.median(ratios):.3f} (quartiles {q[0]:.3f} to {q[2]:.3f}, "
        f"range {ratios[0]:.3f} to {ratios[-1]:.3f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="2ed5477", help="the revision to compare against")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--cases", default="builtin,composed,partition")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base = os.path.join(tmp, "base")
        subprocess.run(["git", "worktree", "add", "-q", "--detach", base, args.base], check=True)
        try:
            for which in args.cases.split(","):
                compare(base, which, args.rounds, args.steps)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", base], check=True)


if __name__ == "__main__":
    main()
