"""The demo's rank: trains a character GPT with shardopt, measures, checks against AdamW."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardopt.cli._demo_data import VOCAB, decode, encode, read_corpus, sample_batch, stdlib_dir
from shardopt.cli._demo_report import DemoReport, format_report, write_png
from shardopt.cli.measure import measure_ddp, measure_sharded, storage_bytes
from shardopt.cli.models import GPT, GPTConfig
from shardopt.cli.torch_optim import zero_redundancy_optimizer
from shardopt.core import adamw, plan_partition
from shardopt.functional import (
    RankBytes,
    ShardedState,
    register_grad_hooks,
    register_param_hooks,
    shard,
)

__all__ = ["DemoConfig", "train_rank"]


# [Note: demo reference]
# The equivalence check runs the same steps in one process with torch.optim.AdamW(fused=True)
# on the same global batches, and computes the gradient as the ranks do: one backward per
# rank's rows, summed, then divided by the world size (what stage 2's reduction and DDP
# compute). The gradients are then equal up to the order of the sum (bitwise at 2 ranks), so the
# difference in the final parameters is the optimizers': shardopt's sharded flat AdamW (the same
# fused kernel, on each rank's slice) against torch's on whole tensors. At 2 ranks it is exactly
# 0. torch's default (for-loop) AdamW rounds differently in the last bit, and training amplifies
# that: about 1e-4 after 300 steps. A full-batch backward would round the gradients differently
# too, and Adam scales the rounding of near-zero gradients up to the learning rate; the model
# has no attention input bias for that reason (see GPTConfig).


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """The demo's settings; ``batch`` is per rank, the model a GPT of ``width`` x ``depth``."""

    stage: int = 2
    steps: int = 400
    batch: int = 8
    length: int = 64
    width: int = 64
    depth: int = 2
    heads: int = 4
    lr: float = 3e-3
    weight_decay: float = 0.01
    corpus_bytes: int = 300_000
    sample_chars: int = 120
    # Elements of one bucket, all ranks together: the default model (110K parameters) makes
    # about a dozen buckets, so their reduce-scatters overlap backward and their all-gathers the
    # next forward, with 64 KiB of gradient staging per rank at any world size (the default
    # bucket would hold the whole model: staging as large as its gradients).
    bucket_numel: int | None = 8192
    seed: int = 0
    device: str = "cpu"
    out: str | None = "out/demo.png"

    def __post_init__(self) -> None:
        if self.stage not in (1, 2):
            raise ValueError(f"demo: expected --stage 1 or 2, got {self.stage}")
        for name in ("steps", "batch", "length", "width", "depth", "heads", "corpus_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"demo: expected {name} >= 1, got {getattr(self, name)}")
        if self.sample_chars < 0:
            raise ValueError(f"demo: expected sample_chars >= 0, got {self.sample_chars}")


def _device(config: DemoConfig) -> torch.device:
    """``cpu``, or this rank's CUDA device (the launcher made it current) for ``cuda``."""
    if config.device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(config.device)


def build_model(config: DemoConfig, device: torch.device) -> nn.Module:
    """The demo's GPT, initialised from ``config.seed`` (the caller's RNG is left alone)."""
    shape = GPTConfig(
        len(VOCAB), config.length, config.width, config.depth, config.heads, qkv_bias=False
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        return GPT(shape).to(device)


def _shared_corpus(rank: int, config: DemoConfig, device: torch.device) -> torch.Tensor:
    """Rank 0's corpus on every rank (see [Note: demo corpus])."""
    data = encode(read_corpus(config.corpus_bytes)).to(device) if rank == 0 else None
    size = torch.tensor([0 if data is None else data.numel()], device=device)
    dist.broadcast(size, 0)
    if data is None:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, 0)
    return data.cpu()


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(model(x).flatten(0, 1), y.flatten())


def _train(
    rank: int, world: int, config: DemoConfig, model: nn.Module, data: torch.Tensor
) -> tuple[list[float], list[float], ShardedState]:
    """Trains ``model`` with shardopt AdamW; returns (mean losses, step times, final state)."""
    from tqdm import tqdm

    device = next(model.parameters()).device
    params = list(model.parameters())
    tx = adamw(config.lr, weight_decay=config.weight_decay)
    plan = plan_partition(params, world, bucket_numel=config.bucket_numel)
    sharded = shard(tx, plan, stage=config.stage)
    state = sharded.init(params)
    grad_hooks = register_grad_hooks(params, state)  # reduce-scatter during backward
    param_hooks = register_param_hooks(model, state)  # all-gather during the next forward
    net = model
    losses, times = [], []
    bar = tqdm(
        range(config.steps),
        desc=f"stage {config.stage}, {world} ranks",
        unit="step",
        disable=rank != 0,
        dynamic_ncols=True,
        mininterval=0.5,
    )
    for step in bar:
        start = time.perf_counter()
        x, y = sample_batch(data, step, config.batch * world, config.length, seed=config.seed)
        for p in params:
            p.grad = None
        loss = _loss(net, _rows(x, rank, world).to(device), _rows(y, rank, world).to(device))
        loss.backward()
        state = sharded.step(params, None, state)
        times.append(time.perf_counter() - start)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
        bar.set_postfix(loss=f"{losses[-1]:.3f}", step_ms=f"{1000 * times[-1]:.1f}", refresh=False)
    bar.close()
    grad_hooks.remove()
    param_hooks.remove()  # waits for the last gathers
    return losses, times, state


def _torch_zero_bytes(rank: int, world: int, config: DemoConfig, data: torch.Tensor) -> RankBytes:
    """What torch's ZeroRedundancyOptimizer(AdamW) holds on this rank after one step."""
    device = _device(config)
    model = build_model(config, device)
    zero = zero_redundancy_optimizer()(
        model.parameters(),
        optimizer_class=torch.optim.AdamW,
        lr=config.lr,
        weight_decay=config.weight_decay,
    )
    x, y = sample_batch(data, 0, config.batch * world, config.length, seed=config.seed)
    _loss(model, _rows(x, rank, world).to(device), _rows(y, rank, world).to(device)).backward()
    zero.step()
    return RankBytes(
        params=storage_bytes(model.parameters()),
        grads=storage_bytes(p.grad for p in model.parameters()),
        optimizer=storage_bytes(t for s in zero.optim.state.values() for t in s.values()),
        master=0,
        buffers=0,
    )


def _max_over_ranks(held: list[RankBytes], device: torch.device) -> list[RankBytes]:
    fields = [f.name for f in dataclasses.fields(RankBytes)]
    values = torch.tensor([[getattr(h, f) for f in fields] for h in held], device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return [RankBytes(*map(int, row)) for row in values.tolist()]


def _reference(
    config: DemoConfig, data: torch.Tensor, world: int
) -> tuple[list[float], nn.Module, RankBytes]:
    """The same training in one process with torch.optim.AdamW (see [Note: demo reference])."""
    device = _device(config)
    model = build_model(config, device)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, fused=True)
    losses = []
    for step in range(config.steps):
        x, y = sample_batch(data, step, config.batch * world, config.length, seed=config.seed)
        total = torch.zeros(())
        for rank in range(world):
            xr, yr = _rows(x, rank, world).to(device), _rows(y, rank, world).to(device)
            loss = _loss(model, xr, yr)
            loss.backward()  # accumulates the sum of the ranks' gradients in rank order
            total += loss.detach().cpu()
        for p in params:
            if p.grad is not None:
                p.grad.div_(world)
        opt.step()
        opt.zero_grad()
        losses.append(total.item() / world)
    for p in params:
        p.grad = torch.zeros_like(p)  # held between steps, as in DDP
    return losses, model, measure_ddp(params, opt)


@torch.no_grad()
def generate(model: nn.Module, prompt: str, count: int, length: int, seed: int = 0) -> str:
    """``count`` characters sampled after ``prompt`` (temperature 0.8, fixed seed)."""
    device = next(model.parameters()).device
    ids = encode(prompt).long().to(device)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(count):
        logits = model(ids[-length:][None])[0, -1].float().cpu()
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=gen)
        ids = torch.cat([ids, nxt.to(device)])
    return decode(ids.cpu())


def train_rank(rank: int, world: int, config: DemoConfig, backend: str) -> DemoReport | None:
    """One rank of the demo; rank 0 prints the report, writes the PNG and returns the report."""
    device = _device(config)
    data = _shared_corpus(rank, config, device)
    model = build_model(config, device)
    losses, times, state = _train(rank, world, config, model, data)
    mine = measure_sharded(model.parameters(), state)
    zero = _torch_zero_bytes(rank, world, config, data)
    mine, zero = _max_over_ranks([mine, zero], device)
    if rank != 0:
        dist.barrier()
        return None
    ref_losses, ref_model, ddp = _reference(config, data, world)
    diff = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(model.parameters(), ref_model.parameters())
    )
    report = DemoReport(
        world_size=world,
        stage=config.stage,
        backend=backend,
        device=str(device),
        parameters=sum(p.numel() for p in model.parameters()),
        corpus_bytes=data.numel(),
        corpus_dir=stdlib_dir(),
        losses=tuple(losses),
        reference_losses=tuple(ref_losses),
        step_times=tuple(times),
        memory={
            "DDP + AdamW": ddp,
            "torch ZeroRedundancyOptimizer": zero,
            f"shardopt stage {config.stage}": mine,
        },
        max_abs_diff=diff,
        sample=generate(model, "def ", config.sample_chars, config.length, config.seed)[4:],
    )
    if config.out is not None:
        report = dataclasses.replace(report, png=write_png(report, config.out))
    print(format_report(report), flush=True)
    dist.barrier()
    return report
