"""Times update_pieces_ of adam, adamw, sgd(momentum) against torch.optim fused, foreach, plain."""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from shardopt.core import adam, adamw, sgd, update_pieces_

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_flat_adam.json"

# family -> (our factory, torch class, hyperparameters shared by both)
FAMILIES: dict[str, tuple[Callable[..., Any], type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (adam, torch.optim.Adam, {"lr": 1e-3}),
    "adamw": (adamw, torch.optim.AdamW, {"lr": 1e-3, "weight_decay": 1e-2}),
    "sgd_momentum": (sgd, torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
# variant -> torch optimizer kwargs (None: ours); "fused" is the baseline of the ratios.
VARIANTS: dict[str, dict[str, Any] | None] = {
    "ours_update_pieces_": None,
    "torch_fused": {"fused": True},
    "torch_foreach": {"foreach": True},
    "torch_default": {},
}
OURS, BASELINE = "ours_update_pieces_", "torch_fused"


def make_steppers(family: str, numel: int, seed: int = 0) -> dict[str, Callable[[], None]]:
    """One zero-argument step function per variant, each on its own copy of the same tensors."""
    factory, torch_cls, hyper = FAMILIES[family]
    gen = torch.Generator().manual_seed(seed)
    param = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen)
    steppers: dict[str, Callable[[], None]] = {}
    for name, kwargs in VARIANTS.items():
        p = param.clone()
        if kwargs is None:
            tx = factory(**hyper)
            state = tx.init([p])
            g = grad.clone()
            steppers[name] = lambda tx=tx, p=p, g=g, s=state: update_pieces_(tx, [p], [g], s)
        else:
            p.grad = grad.clone()
            opt = torch_cls([p], **hyper, **kwargs)
            steppers[name] = opt.step
    return steppers


def time_family(family: str, numel: int, repeat: int, warmup: int) -> dict[str, Any]:
    """Median seconds per step of every variant, the variants interleaved round by round."""
    steppers = make_steppers(family, numel)
    for step in steppers.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    pair, rest, rng = (
        [OURS, BASELINE],
        [n for n in steppers if n not in (OURS, BASELINE)],
        random.Random(0),
    )
    for _ in range(repeat):
        # Ours and the baseline back to back in a random order (a paired sample: the load of a
        # shared machine drifts slowly), then the others in a random order.
        rng.shuffle(pair)
        rng.shuffle(rest)
        for name in (*pair, *rest):
            start = time.perf_counter()
            steppers[name]()
            times[name].append(time.perf_counter() - start)
    paired = [a / b for a, b in zip(times[OURS], times[BASELINE])]
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    minima = {name: min(ts) for name, ts in times.items()}
    return {
        "family": family,
        "numel": numel,
        "repeat": repeat,
        "paired_median_ratio_ours_vs_torch_fused": statistics.median(paired),
        "median_s": medians,
        "min_s": minima,
        "ratio_vs_torch_fused": {n: m / medians["torch_fused"] for n, m in medians.items()},
        "min_ratio_vs_torch_fused": {n: m / minima["torch_fused"] for n, m in minima.items()},
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    names = list(VARIANTS)
    print(f"\n{'family':>13} {'numel':>9} " + " ".join(f"{n:>18}" for n in names))
    for r in rows:
        cells = [
            f"{r['median_s'][n] * 1e3:9.3f}ms x{r['ratio_vs_torch_fused'][n]:5.3f}" for n in names
        ]
        print(f"{r['family']:>13} {r['numel']:>9} " + " ".join(f"{c:>18}" for c in cells))
    print("(median ms per step, and its ratio to torch_fused's median in the same run)")
    print("\nours / torch_fused, median of the paired (back-to-back) step-time ratios:")
    for r in rows:
        print(
            f"{r['family']:>13} {r['numel']:>9}  {r['paired_median_ratio_ours_vs_torch_fused']:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[2**20, 2**24])
    parser.add_argument("--repeat", type=int, default=31, help="timed steps per variant")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps (a smoke run)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if args.quick:
        args.sizes, args.repeat, args.warmup = [2**12, 2**16], 5, 1
    cases = [(f, n) for n in args.sizes for f in FAMILIES]
    rows = [
        time_family(f, n, args.repeat, args.warmup) for f, n in tqdm(cases, desc="bench_flat_adam")
    ]
    print(f"\nfloat32 flat tensor on CPU, {torch.get_num_threads()} intra-op threads")
    print_table(rows)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "device": "cpu",
        "dtype": "float32",
    }
    OUT.write_text(json.dumps({"meta": meta, "cases": rows}, indent=2) + "\n")
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
