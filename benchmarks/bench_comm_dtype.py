"""What bfloat16 gradient communication (``shard(..., comm_dtype=torch.bfloat16)``) buys and
costs against float32 communication and DDP's ``bf16_compress_hook`` (gloo, CPU, a thread a rank).

1. Accuracy (W=4): the demo GPT's gradients (each rank its rows of the demo batch, after some
   AdamW steps) averaged by each reduction, against the exact average (the float64 mean of the
   ranks' float32 gradients): RMS error / RMS of the exact average, median over steps.
2. Traffic (W=4): bytes handed to the reduce-type (gradients) and gather-type (parameters)
   collectives during one demo step (backward + step, grad hooks).
3. Loss: the demo (shardopt stage 2, grad hooks) with each wire on 3 data orders, in lockstep;
   is bf16's final loss within float32's spread over data orders?
4. Speed: 12 x Linear(1024, 1024), batch 32, forward + backward + step: shardopt stage 2 with
   the bfloat16 wire against DDP + bf16_compress_hook + torch's ZeroRedundancyOptimizer (and
   its ``hook_with_zero_step`` overlap where torch allows it), and shardopt's drop-in
   ``ZeroRedundancyOptimizer(partition="flat", comm_dtype=bf16)`` behind DDP with
   ``local_gradients_hook``, interleaved iteration by iteration; the slowest rank's time; the
   per-round ratio to the faster torch variant.

    python benchmarks/bench_comm_dtype.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from shardopt.cli._demo_data import encode, read_corpus, sample_batch
from shardopt.cli._demo_train import DemoConfig, build_model
from shardopt.core import adamw, plan_partition
from shardopt.functional import register_grad_hooks, shard
from shardopt.testing import count_collectives, spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_comm_dtype.json"
BF16 = torch.bfloat16
# name: (stage, comm_dtype) of the shardopt reductions measured for accuracy
REDUCERS = {
    f"shard {n} s{st}": (st, d) for n, d in (("bf16", BF16), ("fp32", None)) for st in (2, 1)
}
DDP_BF16 = "ddp bf16_compress"
IDEAL = "ideal bf16 (1 rounding)"
TAIL = 20  # the final loss is the mean of the last TAIL steps


def _zero_cls() -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer


def _bf16_hook() -> Any:
    """torch's ``bf16_compress_hook`` under another name: DDP refuses the hook by its name
    without CUDA and NCCL (a check of the build, not of the backend; gloo all-reduces
    bfloat16)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

    def bf16_compress_on_gloo(process_group, bucket):  # no annotations: DDP checks them
        return bf16_compress_hook(process_group, bucket)

    return bf16_compress_on_gloo


def _batch(data: torch.Tensor, config: DemoConfig, step: int, seed: int) -> Any:
    """This rank's rows of the demo's global batch of ``step`` under data order ``seed``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x, y = sample_batch(data, step, config.batch * world, config.length, seed=seed)
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def _loss(model: nn.Module, xy: Any) -> torch.Tensor:
    x, y = xy
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


# -- 1. accuracy -----------------------------------------------------------------------------


def _reducer(params: list[torch.Tensor], config: DemoConfig, stage: int, dtype: Any) -> list:
    """[sharded, its own copy of the parameters, state]: reduces gradients given to step."""
    copies = [p.detach().clone() for p in params]
    plan = plan_partition(copies, dist.get_world_size(), bucket_numel=config.bucket_numel)
    tx = adamw(config.lr, weight_decay=config.weight_decay)
    sharded = shard(tx, plan, stage=stage, comm_dtype=dtype)
    return [sharded, copies, sharded.init(copies)]


def _exact_mean(local: list[torch.Tensor]) -> tuple[list[torch.Tensor], float]:
    """The float64 mean over ranks of every rank's ``local`` gradients (all-gathered), and the
    error of the ideal bfloat16 wire: each local gradient rounded once, summed exactly."""
    flat = torch.cat([g.reshape(-1) for g in local])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    stack = torch.stack(every)
    mean, ideal = stack.double().mean(0), stack.to(BF16).double().mean(0)
    error = _relative(float((ideal - mean).square().sum()), float(mean.square().sum()))
    return [m.view(g.shape) for m, g in zip(mean.split([g.numel() for g in local]), local)], error


def _relative(err2: float, ref2: float) -> float:
    """sqrt(sum err^2 / sum ref^2) over all ranks' sums."""
    sums = torch.tensor([err2, ref2], dtype=torch.float64)
    dist.all_reduce(sums)
    return float((sums[0] / sums[1]).sqrt())


def _shard_error(run: list, local: list[torch.Tensor], exact: list[torch.Tensor]) -> float:
    """Steps ``run`` on ``local``; the error of this rank's averaged gradient shard."""
    sharded, copies, state = run
    run[2] = state = sharded.step(copies, [g.clone() for g in local], state)
    param_buffers, err2, ref2 = state.param_buffers, 0.0, 0.0
    for p in param_buffers.pieces:
        got = state.reducer.shards[p.group][p.offset : p.offset + p.numel].double()
        want = exact[p.tensor].reshape(-1)[p.start : p.stop]
        err2 += float((got - want).square().sum())
        ref2 += float(want.square().sum())
    return _relative(err2, ref2)


def _ddp_error(ddp: nn.Module, xy: Any, exact: list[torch.Tensor]) -> float:
    """One synchronised DDP backward on ``xy``; the error of the all-reduced ``.grad``."""
    ddp.zero_grad(set_to_none=True)
    _loss(ddp, xy).backward()
    err2 = sum(float((p.grad.double() - e).square().sum()) for p, e in zip(ddp.parameters(), exact))
    return _relative(err2, sum(float(e.square().sum()) for e in exact))


def accuracy(warmup: int, measured: int) -> dict[str, list[float]]:
    """Each reduction's relative error at each measured step (see the module's item 1)."""
    config = DemoConfig()
    data = encode(read_corpus(config.corpus_bytes))
    ddp = nn.parallel.DistributedDataParallel(build_model(config, torch.device("cpu")))
    ddp.register_comm_hook(None, _bf16_hook())
    params = list(ddp.parameters())
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    runs = {name: _reducer(params, config, *how) for name, how in REDUCERS.items()}
    errors: dict[str, list[float]] = {name: [] for name in [*REDUCERS, DDP_BF16, IDEAL]}
    for step in range(warmup + measured):
        xy = _batch(data, config, step, config.seed)
        ddp.zero_grad(set_to_none=True)
        with ddp.no_sync():
            _loss(ddp, xy).backward()
        local = [p.grad.detach().clone() for p in params]
        exact, ideal = _exact_mean(local)
        if step >= warmup:
            errors[IDEAL].append(ideal)
            for name, run in runs.items():
                errors[name].append(_shard_error(run, local, exact))
            errors[DDP_BF16].append(_ddp_error(ddp, xy, exact))
        for p, e in zip(params, exact):  # train on the exact average
            p.grad = e.float()
        opt.step()
    return errors


# -- 2. traffic ------------------------------------------------------------------------------


def traffic(dtype: Any) -> dict[str, Any]:
    """Bytes handed to collectives during the second demo step (backward + step, grad hooks)."""
    config = DemoConfig()
    data = encode(read_corpus(config.corpus_bytes))
    model = build_model(config, torch.device("cpu"))
    params = list(model.parameters())
    plan = plan_partition(params, dist.get_world_size(), bucket_numel=config.bucket_numel)
    sharded = shard(adamw(config.lr), plan, stage=2, comm_dtype=dtype)
    state = sharded.init(params)
    hooks = register_grad_hooks(params, state)
    for step in range(2):
        with count_collectives() as log:
            _loss(model, _batch(data, config, step, 0)).backward()
            state = sharded.step(params, None, state)
    hooks.remove()
    totals = log.totals()
    return {
        "reduce_bytes": totals.reduce_scatter + totals.all_reduce,
        "gather_bytes": totals.all_gather,
        "calls": sorted({c.name for c in log.calls}),
        "param_bytes": sum(p.numel() * p.element_size() for p in params),
    }


def figures_rank(rank: int, world: int, warmup: int, measured: int) -> dict[str, Any]:
    torch.manual_seed(rank)
    out = {"accuracy": accuracy(warmup, measured)}
    out["traffic"] = {"bf16": traffic(BF16), "fp32": traffic(None)}
    return out


# -- 3. loss ---------------------------------------------------------------------------------


def _training_run(config: DemoConfig, dtype: Any) -> list:
    """[model, params, sharded, state]: the demo's shardopt stage 2 with grad hooks."""
    model = build_model(config, torch.device("cpu"))
    params = list(model.parameters())
    plan = plan_partition(params, dist.get_world_size(), bucket_numel=config.bucket_numel)
    sharded = shard(
        adamw(config.lr, weight_decay=config.weight_decay), plan, stage=2, comm_dtype=dtype
    )
    state = sharded.init(params)
    register_grad_hooks(params, state)
    return [model, params, sharded, state]


def loss_rank(rank: int, world: int, steps: int, seeds: list[int]) -> dict[str, list[float]]:
    """Each (communication, data seed) run's loss per step, the mean over ranks; in lockstep."""
    config = DemoConfig(steps=steps)
    data = encode(read_corpus(config.corpus_bytes))
    kinds = {"bf16": BF16, "fp32": None}
    runs = {(k, s): _training_run(config, d) for k, d in kinds.items() for s in seeds}
    losses: dict[str, list[float]] = {f"{k}/{s}": [] for k, s in runs}
    for step in range(steps):
        for (kind, seed), run in runs.items():
            model, params, sharded, state = run
            loss = _loss(model, _batch(data, config, step, seed))
            loss.backward()
            run[3] = sharded.step(params, None, state)
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses[f"{kind}/{seed}"].append(mean.item() / world)
    return losses


# -- 4. speed --------------------------------------------------------------------------------


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for i in range(12):
        layers += [nn.Linear(1024, 1024)] + ([nn.ReLU()] if i < 11 else [])
    return nn.Sequential(*layers)


def _shard_iteration(x: torch.Tensor, y: torch.Tensor, dtype: Any) -> Any:
    model = _mlp()
    params = list(model.parameters())
    sharded = shard(
        adamw(1e-4), plan_partition(params, dist.get_world_size()), stage=2, comm_dtype=dtype
    )
    box = {"state": sharded.init(params)}
    register_grad_hooks(params, box["state"])

    def iteration() -> None:
        F.mse_loss(model(x), y).backward()
        box["state"] = sharded.step(params, None, box["state"])

    return iteration


def _torch_iteration(x: torch.Tensor, y: torch.Tensor, overlap: bool) -> Any:
    """DDP + bf16_compress_hook + ZeroRedundancyOptimizer(AdamW), maybe overlapped."""
    ddp = nn.parallel.DistributedDataParallel(_mlp())
    zero = _zero_cls()(ddp.parameters(), torch.optim.AdamW, lr=1e-4, overlap_with_ddp=overlap)
    if overlap:
        from torch.distributed.algorithms.ddp_comm_hooks.ddp_zero_hook import hook_with_zero_step

        ddp.register_comm_hook(None, hook_with_zero_step(_bf16_hook(), ddp, zero))
    else:
        ddp.register_comm_hook(None, _bf16_hook())

    def iteration() -> None:
        F.mse_loss(ddp(x), y).backward()
        zero.step()
        zero.zero_grad(set_to_none=True)

    return iteration


def _drop_in_iteration(x: torch.Tensor, y: torch.Tensor) -> Any:
    """shardopt's ZeroRedundancyOptimizer(partition="flat", comm_dtype=bf16) behind DDP with
    local_gradients_hook: DDP sends nothing, the drop-in reduces on the bfloat16 wire."""
    from shardopt.optim import ZeroRedundancyOptimizer, local_gradients_hook

    ddp = nn.parallel.DistributedDataParallel(_mlp())
    ddp.register_comm_hook(None, local_gradients_hook)
    zero = ZeroRedundancyOptimizer(
        ddp.parameters(), torch.optim.AdamW, partition="flat", comm_dtype=BF16, lr=1e-4
    )

    def iteration() -> None:
        F.mse_loss(ddp(x), y).backward()
        zero.step()
        zero.zero_grad(set_to_none=True)

    return iteration


def _variants(rank: int) -> tuple[dict[str, Any], dict[str, str]]:
    """Each variant's iteration, and why those that could not be built were left out."""
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(32, 1024, generator=gen), torch.randn(32, 1024, generator=gen)
    steps = {
        "shardopt bf16": _shard_iteration(x, y, BF16),
        "shardopt fp32": _shard_iteration(x, y, None),  # for context: what the wire saves
        "drop-in bf16": _drop_in_iteration(x, y),
        "torch zero": _torch_iteration(x, y, False),
    }
    skipped = {}
    try:
        steps["torch zero overlap"] = _torch_iteration(x, y, True)
    except (RuntimeError, ValueError) as e:  # the same on every rank
        skipped["torch zero overlap"] = f"{type(e).__name__}: {e}"
    return steps, skipped


def speed_rank(rank: int, world: int, rounds: int) -> dict[str, Any]:
    steps, skipped = _variants(rank)
    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(rounds + 3):  # three rounds of warm-up
        k = i % len(names)
        for name in names[k:] + names[:k]:  # rotate which goes first
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            if i >= 3:
                times[name].append(time.perf_counter() - start)
    return {"times": times, "skipped": skipped}


# -- the parent: summaries, table ------------------------------------------------------------


def _spread(values: list[float]) -> dict[str, Any]:
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "q1_q3": [q[0], q[2]],
        "min_max": [min(values), max(values)],
    }


def summarize_figures(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    errors = per_rank[0]["accuracy"]  # the same on every rank (all-reduced)
    ratios = [a / b for a, b in zip(errors["shard bf16 s2"], errors[DDP_BF16])]
    t = per_rank[0]["traffic"]
    return {
        "errors": {
            name: {"median": statistics.median(v), "per_step": v} for name, v in errors.items()
        },
        "ratio_shard_bf16_to_ddp_bf16": _spread(ratios),
        "traffic_rank0": t,
        "traffic_ratio_reduce": t["bf16"]["reduce_bytes"] / t["fp32"]["reduce_bytes"],
        "traffic_ratio_gather": t["bf16"]["gather_bytes"] / t["fp32"]["gather_bytes"],
    }


def summarize_loss(losses: dict[str, list[float]], seeds: list[int]) -> dict[str, Any]:
    final = {k: sum(v[-TAIL:]) / len(v[-TAIL:]) for k, v in losses.items()}
    fp32 = [final[f"fp32/{s}"] for s in seeds]
    bf16 = [final[f"bf16/{s}"] for s in seeds]
    gap = max(abs(a - b) for a, b in zip(bf16, fp32))
    within = min(fp32) <= sum(bf16) / len(bf16) <= max(fp32)
    out = {"final_fp32": fp32, "final_bf16": bf16, "fp32_spread": max(fp32) - min(fp32)}
    return {**out, "max_paired_gap": gap, "bf16_mean_within_fp32_range": within, "losses": losses}


def summarize_speed(per_rank: list[dict[str, Any]], world: int) -> dict[str, Any]:
    names = list(per_rank[0]["times"])
    rounds = len(per_rank[0]["times"][names[0]])
    slow = {n: [max(r["times"][n][i] for r in per_rank) for i in range(rounds)] for n in names}
    torch_names = [n for n in names if n.startswith("torch")]
    best = min(torch_names, key=lambda n: statistics.median(slow[n]))
    mine = slow["shardopt bf16"]
    out = {"world": world, "rounds": rounds, "best_torch": best, "skipped": per_rank[0]["skipped"]}
    out["median_ms"] = {n: statistics.median(v) * 1e3 for n, v in slow.items()}
    out["ratio_to_best_torch"] = _spread([a / b for a, b in zip(mine, slow[best])])
    drop_in = [a / b for a, b in zip(slow["drop-in bf16"], slow[best])]
    out["ratio_drop_in_to_best_torch"] = _spread(drop_in)
    out["ratio_bf16_to_fp32_wire"] = _spread([a / b for a, b in zip(mine, slow["shardopt fp32"])])
    return out


def _ratio(label: str, r: dict[str, Any], target: str = "") -> str:
    (q1, q3), (lo, hi) = r["q1_q3"], r["min_max"]
    spread = f"q1-q3 {q1:.3f}-{q3:.3f}  range {lo:.3f}-{hi:.3f}"
    return f"   {label:34s} {r['median']:.3f}  {spread}{target}"


def _print_figures(figs: dict[str, Any]) -> None:
    print("\n1. accuracy, W=4: RMS error / RMS of the exact average, median over steps")
    for name, v in figs["errors"].items():
        print(f"   {name:34s} {v['median']:.3e}")
    r = figs["ratio_shard_bf16_to_ddp_bf16"]
    print(_ratio("shard bf16 s2 / ddp bf16 (per step)", r, "  (target <= 0.6)"))
    t = figs["traffic_rank0"]
    print("\n2. traffic, W=4, one demo step, rank 0: bytes handed to collectives")
    for kind in ("bf16", "fp32"):
        v = t[kind]
        print(
            f"   {kind}: gradients {v['reduce_bytes']:>9,}  parameters {v['gather_bytes']:>9,}"
            f"  ({', '.join(v['calls'])})"
        )
    print(
        f"   bf16/fp32: gradients {figs['traffic_ratio_reduce']:.3f} (target 0.5), "
        f"parameters {figs['traffic_ratio_gather']:.3f}"
    )


def _print_loss(loss: dict[str, Any]) -> None:
    print(
        f"\n3. loss after {loss['steps']} steps, W={loss['world']}, mean of the last {TAIL},"
        f" data seeds {loss['seeds']}"
    )
    print("   fp32 wire " + "  ".join(f"{v:.4f}" for v in loss["final_fp32"]))
    print("   bf16 wire " + "  ".join(f"{v:.4f}" for v in loss["final_bf16"]))
    print(
        f"   fp32 spread over seeds {loss['fp32_spread']:.4f}; largest |bf16 - fp32| (same "
        f"seed) {loss['max_paired_gap']:.4f}; bf16's mean within fp32's range: "
        f"{loss['bf16_mean_within_fp32_range']}"
    )


def _print_speed(s: dict[str, Any]) -> None:
    ms = "  ".join(f"{n} {v:.1f}" for n, v in s["median_ms"].items())
    print(
        f"\n4. speed, 12x1024 MLP, batch 32, slowest rank's iteration, median ms, W={s['world']},"
    )
    print(f"   {s['rounds']} rounds: {ms}")
    target = "  (target <= 0.9)"
    print(_ratio(f"shardopt bf16 / {s['best_torch']}", s["ratio_to_best_torch"], target))
    print(_ratio(f"drop-in bf16 / {s['best_torch']}", s["ratio_drop_in_to_best_torch"], target))
    print(_ratio("shardopt bf16 / shardopt fp32", s["ratio_bf16_to_fp32_wire"]))
    for n, why in s["skipped"].items():
        print(f"   {n} left out: {why}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    parser.add_argument("--loss-world", type=int, default=None, help="default: 2 quick, else 4")
    parser.add_argument("--parts", nargs="+", default=PARTS, choices=PARTS)
    args = parser.parse_args()
    warmup, measured = (10, 3) if args.quick else (20, 5)
    steps, rounds = (60, 15) if args.quick else (200, 60)
    world, seeds = args.loss_world or (2 if args.quick else 4), [0, 1, 2]
    bar = tqdm(total=len(args.parts) + ("speed" in args.parts), desc="bench_comm_dtype")
    rows: list[dict[str, Any]] = [{"quick": args.quick}]
    if "accuracy" in args.parts:
        per_rank = spawn(figures_rank, 4, warmup, measured, backend="gloo", timeout=900)
        rows.append({"accuracy_and_traffic": summarize_figures(per_rank)})
        bar.update()
    if "loss" in args.parts:
        losses = spawn(loss_rank, world, steps, seeds, backend="gloo", timeout=1800)[0]
        rows.append({"loss": {"steps": steps, "world": world, "seeds": seeds}})
        rows[-1]["loss"].update(summarize_loss(losses, seeds))
        bar.update()
    for w in (2, 4) if "speed" in args.parts else ():
        per_rank = spawn(speed_rank, w, rounds, backend="gloo", timeout=1800)
        rows.append({"speed": summarize_speed(per_rank, w)})
        bar.update()
    bar.close()
    for row in rows[1:]:
        PRINTERS[next(iter(row))](next(iter(row.values())))
    write_results(OUT, rows)


PARTS = ["accuracy", "loss", "speed"]
PRINTERS = {"accuracy_and_traffic": _print_figures, "loss": _print_loss, "speed": _print_speed}


if __name__ == "__main__":
    main()
