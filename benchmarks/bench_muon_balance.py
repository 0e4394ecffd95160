"""How evenly each plan spreads the Muon + AdamW recipe over ranks (issue 14, balance).

The recipe: Muon on the hidden matrices (the 2-D ``blocks.*`` weights), AdamW on the rest
(embeddings, head, norms, biases). Per rank, the work is the Newton-Schulz flops of the matrices
it updates whole, the state is Muon's momentum (1 x numel) plus AdamW's two moments (2 x numel)
of the elements it owns. Reported: the largest rank over the mean (1.00 is perfect) for

- ``mixed``: ``plan_partition(strategy="mixed", whole=hidden, cost=newton_schulz_flops)``, the
  hidden matrices whole and balanced by flops, the rest cut like a flat plan;
- ``greedy (flops)``: every tensor whole, the same costs (what a plan of whole tensors gives);
- ``greedy (torch)``: torch ZeroRedundancyOptimizer's rule by element counts.

Plans only (meta tensors, no training): seconds on any machine. Writes out/bench_muon_balance.json
and out/bench_muon_balance.png.

    python benchmarks/bench_muon_balance.py [--world 4 8 16] [--models gpt2-small llama-7b]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch

from shardopt.cli.models import PRESETS
from shardopt.core import Plan, TensorSpec, newton_schulz_flops, plan_partition

from _bench_io import write_results

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "bench_muon_balance.json"


def shapes_of(model: str) -> tuple[list[tuple[int, ...]], list[bool]]:
    """The parameter shapes of ``model`` and which of them Muon updates."""
    with torch.device("meta"):
        named = list(PRESETS[model]().named_parameters())
    hidden = [n.startswith("blocks.") and p.dim() == 2 for n, p in named]
    return [tuple(p.shape) for _, p in named], hidden


def loads(plan: Plan, hidden: list[bool]) -> tuple[float, float]:
    """(largest / mean Muon work, largest / mean optimizer state) over the plan's ranks."""
    world = plan.world_size
    work, state = [0.0] * world, [0.0] * world
    for rank in range(world):
        for p in plan.pieces(rank):
            muon = hidden[p.tensor]
            work[rank] += newton_schulz_flops(plan.tensors[p.tensor].shape) if muon else 0.0
            state[rank] += p.numel * (1 if muon else 2)
    return max(work) * world / sum(work), max(state) * world / sum(state)


def plans(shapes: list[tuple[int, ...]], hidden: list[bool], world: int) -> dict[str, Plan]:
    specs = [TensorSpec(s, "float32", "cpu") for s in shapes]
    whole = dict(zip(map(id, specs), hidden))

    def flops(t: TensorSpec) -> float:  # Muon's work for its matrices, elements for the rest
        return newton_schulz_flops(t.shape) if whole[id(t)] else t.numel

    return {
        "mixed": plan_partition(
            specs, world, strategy="mixed", whole=lambda t: whole[id(t)], cost=flops
        ),
        "greedy (flops)": plan_partition(specs, world, strategy="greedy", cost=flops),
        "greedy (torch)": plan_partition(specs, world, strategy="greedy"),
    }


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = sorted({(r["model"], r["world"]) for r in rows})
    kinds = list(dict.fromkeys(r["plan"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 3.5))
    width = 0.8 / len(kinds)
    for k, kind in enumerate(kinds):
        values = [
            next(r["state"] for r in rows if (r["model"], r["world"]) == c and r["plan"] == kind)
            for c in cases
        ]
        ax.bar([i + k * width for i in range(len(cases))], values, width, label=kind)
    ax.axhline(1.10, color="grey", linestyle="--", linewidth=1, label="1.10x target")
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"{m}\nW={w}" for m, w in cases])
    ax.set_ylabel("largest rank's state / mean")
    ax.set_title("Muon + AdamW optimizer state per rank, by plan")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--models", nargs="+", default=["gpt2-small", "llama-7b"])
    args = parser.parse_args()
    rows = []
    print(f"{'model':<12} {'W':>3} {'plan':<16} {'work':>6} {'state':>6}")
    for model in args.models:
        shapes, hidden = shapes_of(model)
        for world in args.world:
            for name, plan in plans(shapes, hidden, world).items():
                work, state = loads(plan, hidden)
                print(f"{model:<12} {world:>3} {name:<16} {work:6.3f} {state:6.3f}")
                rows.append(
                    {"model": model, "world": world, "plan": name, "work": work, "state": state}
                )
    write_results(OUT, rows)
    plot(rows, OUT.with_suffix(".png"))


if __name__ == "__main__":
    main()
