"""What bfloat16 optimizer state costs a training run and saves in bytes (issue 14, item 4).

The demo's character GPT (``shardopt demo``'s model, data and AdamW settings) trained for 200
steps on 2 gloo ranks with shardopt stage 2, twice on the same batches: AdamW with float32
state, and AdamW under core's ``with_state_dtype(..., torch.bfloat16)`` (moments stored in
bfloat16, updates computed in float32, parameters float32). The two runs step in lockstep,
each on its own copy of the model. Reported: each run's loss per step (the mean over ranks), the
mean of the last 20, the largest gap between the curves, and each rank's optimizer state bytes,
measured (the tensors of the sharded state) and predicted (``shard_cost(...,
state_dtype=...)``). Writes out/bench_state_dtype.json and out/bench_state_dtype.png.

    python benchmarks/bench_state_dtype.py [--steps 200] [--world 2]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from shardopt.cli._demo_data import encode, read_corpus, sample_batch
from shardopt.cli._demo_train import DemoConfig, build_model
from shardopt.cli.measure import measure_sharded
from shardopt.core import adamw, plan_partition, with_state_dtype
from shardopt.functional import register_grad_hooks, shard, shard_cost
from shardopt.testing import spawn

from _bench_io import write_results

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "out" / "bench_state_dtype.json"
VARIANTS = {"float32 state": None, "bfloat16 state": torch.bfloat16}


def train(rank: int, world: int, steps: int) -> dict[str, Any]:
    config = DemoConfig(steps=steps)
    data = encode(read_corpus(config.corpus_bytes))
    runs = {}
    for name, dtype in VARIANTS.items():
        model = build_model(config, torch.device("cpu"))
        params = list(model.parameters())
        tx = adamw(config.lr, weight_decay=config.weight_decay)
        tx = tx if dtype is None else with_state_dtype(tx, dtype)
        plan = plan_partition(params, world, bucket_numel=config.bucket_numel)
        sharded = shard(tx, plan, stage=2)
        state = sharded.init(params)
        register_grad_hooks(params, state)
        runs[name] = [model, params, sharded, state, [], plan, dtype]
    for step in range(steps):
        x, y = sample_batch(data, step, config.batch * world, config.length, seed=config.seed)
        n = x.shape[0] // world
        xs, ys = x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]
        for run in runs.values():
            model, params, sharded = run[:3]
            loss = F.cross_entropy(model(xs).flatten(0, 1), ys.flatten())
            loss.backward()
            run[3] = sharded.step(params, None, run[3])
            model.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            run[4].append(mean.item() / world)
    out = {}
    for name, (_, params, _, state, losses, plan, dtype) in runs.items():
        held = measure_sharded(params, state).optimizer
        predicted = shard_cost(plan, stage=2, state_dtype=dtype)[0][rank].optimizer
        out[name] = {"losses": losses, "optimizer_bytes": held, "predicted_bytes": predicted}
    return out


def plot(losses: dict[str, list[float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, curve in losses.items():
        ax.plot(range(1, len(curve) + 1), curve, label=name, linewidth=1)
    ax.set(xlabel="step", ylabel="training loss (mean over ranks)")
    ax.set_title("demo GPT, AdamW, shardopt stage 2 on 2 ranks")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    per_rank = spawn(train, args.world, args.steps, backend="gloo", timeout=1800)
    first = per_rank[0]
    curves = {name: first[name]["losses"] for name in VARIANTS}
    gap = max(abs(a - b) for a, b in zip(*curves.values()))
    rows = []
    for name in VARIANTS:
        bytes_ = [r[name]["optimizer_bytes"] for r in per_rank]
        predicted = [r[name]["predicted_bytes"] for r in per_rank]
        tail = curves[name][-20:]
        rows.append(
            {
                "variant": name,
                "final_loss_mean_of_last_20": sum(tail) / len(tail),
                "loss_at_last_step": curves[name][-1],
                "optimizer_bytes_per_rank": bytes_,
                "predicted_bytes_per_rank": predicted,
                "losses": curves[name],
            }
        )
        print(
            f"{name:15s} loss (mean of last 20 steps) {rows[-1]['final_loss_mean_of_last_20']:.4f}"
            f"  last {curves[name][-1]:.4f}  optimizer bytes per rank {bytes_}"
            f" (predicted {predicted})"
        )
    print(f"largest gap between the two loss curves over {args.steps} steps: {gap:.4f}")
    write_results(OUT, [{"steps": args.steps, "world": args.world}, *rows])
    plot(curves, OUT.with_suffix(".png"))


if __name__ == "__main__":
    main()
