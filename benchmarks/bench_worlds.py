"""What a trivial two-rank test costs: shardopt.testing's warm worlds, its fresh ones, and torch's
``MultiProcessTestCase`` and ``MultiThreadedTestCase``, in one run.

Each variant is a generated test file of N tests whose body all-reduces a one-element tensor
over 2 ranks (gloo) and checks the sum, run by ``pytest -n 0`` in a subprocess. Variants run in
turn, the order rotated repeat by repeat; the table gives pytest's own time (its "in X s"
line) per test: median, min-max over the repeats. torch's classes need ``expecttest`` (a test
dependency of torch's own suite); without it their rows say so. ``MultiProcessTestCase`` costs
seconds a test, so it runs fewer tests (``--mp-tests``).

    python benchmarks/bench_worlds.py [--tests 100] [--mp-tests 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_worlds.json"

SHARDOPT = """
import pytest
import torch
import torch.distributed as dist

{tests}
"""
SHARDOPT_TEST = """
@pytest.mark.world(2, backend="gloo")
def test_{i}(world):
    t = torch.ones(1)
    dist.all_reduce(t)
    assert t.item() == 2
"""
MULTI_PROCESS = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiProcessTestCase


class T(MultiProcessTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_processes()

    def body(self):
        dist.init_process_group(
            "gloo", init_method=f"file://{{self.file_name}}", rank=self.rank, world_size=2
        )
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
        dist.destroy_process_group()
{tests}
"""
MULTI_THREADED = """
import torch
import torch.distributed as dist
from torch.testing._internal.common_distributed import MultiThreadedTestCase


class T(MultiThreadedTestCase):
    @property
    def world_size(self):
        return 2

    def setUp(self):
        super().setUp()
        self._spawn_threads()

    def body(self):
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == 2
{tests}
"""
METHOD = """
    def test_{i}(self):
        self.body()
"""
VARIANTS = ("shardopt_warm", "shardopt_fresh", "torch_multi_thread", "torch_multi_process")


def write_file(directory: Path, variant: str, count: int) -> Path:
    if variant.startswith("shardopt"):
        text = SHARDOPT.format(tests="".join(SHARDOPT_TEST.format(i=i) for i in range(count)))
    else:
        template = MULTI_THREADED if variant == "torch_multi_thread" else MULTI_PROCESS
        text = template.format(tests="".join(METHOD.format(i=i) for i in range(count)))
    path = directory / f"test_{variant}.py"
    path.write_text(text)
    return path


def run(path: Path, variant: str) -> tuple[float, float, str]:
    """(pytest's time, wall time, the summary line) of one pytest run of ``path``."""
    args = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-p", "no:cacheprovider", str(path)]
    if variant == "shardopt_fresh":
        args.append("--fresh-worlds")
    start = time.perf_counter()
    done = subprocess.run(args, capture_output=True, text=True, cwd=path.parent, check=False)
    wall = time.perf_counter() - start
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-300:]
    found = re.search(r" in ([0-9.]+)s", summary)
    if done.returncode != 0 or found is None:
        raise RuntimeError(f"{variant}: pytest failed: {summary}\n{done.stdout[-2000:]}")
    return float(found.group(1)), wall, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=100)
    parser.add_argument("--mp-tests", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    has_expecttest = importlib.util.find_spec("expecttest") is not None
    variants = [v for v in VARIANTS if has_expecttest or v.startswith("shardopt")]
    counts = {v: args.mp_tests if v == "torch_multi_process" else args.tests for v in variants}
    per_test: dict[str, list[float]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="bench-worlds-") as tmp:
        paths = {v: write_file(Path(tmp), v, counts[v]) for v in variants}
        runs = [(r, v) for r in range(args.repeats) for v in variants[r:] + variants[:r]]
        for _, variant in tqdm(runs, desc="pytest runs", file=sys.stderr):
            seconds, _, _ = run(paths[variant], variant)
            per_test[variant].append(seconds / counts[variant])
    rows = []
    print(f"\n{'variant':>20} {'tests':>6} {'ms per test':>12} {'min-max':>15}")
    for v in variants:
        ms = [s * 1e3 for s in per_test[v]]
        med = statistics.median(ms)
        rows.append({"variant": v, "tests": counts[v], "ms_per_test": med, "runs_ms": ms})
        print(f"{v:>20} {counts[v]:>6} {med:>12.1f} {min(ms):>7.1f}-{max(ms):<7.1f}")
    if not has_expecttest:
        print("(torch's MultiProcessTestCase and MultiThreadedTestCase need expecttest: skipped)")
    print("(pytest's own time per test, -n 0, one pytest run per variant and repeat)")
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
