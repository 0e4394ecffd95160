"""Items d, e and f, which need CUDA: host syncs in step(), the fused AdamW update's bandwidth,
and step() time against torch's optimizers."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from shardopt.devtools.gpu_check._report import Item, Status, failed_item
from shardopt.devtools.gpu_check._stats import (
    adamw_bytes,
    bandwidth_fraction,
    copy_bytes,
    fits_in_memory,
    interleaved_orders,
    median,
    ratio,
)
from shardopt.devtools.gpu_check._syncs import recording_syncs, sync_debug_mode, tally
from shardopt.devtools.gpu_check._variants import (
    Trainer,
    device_batch,
    drop_in,
    shard_trainer,
    torch_adamw,
    torch_zero,
)

__all__ = ["SIZES", "check_bandwidth", "check_step_times", "check_syncs", "needs_cuda"]

SIZES = (10_000_000, 100_000_000, 1_000_000_000)
TARGET_FRACTION = 0.8
TARGET_RATIO = 1.0


def needs_cuda(name: str, device: torch.device) -> list[Item] | None:
    """A SKIP item for ``name`` when ``device`` is not CUDA, else None."""
    if device.type == "cuda":
        return None
    return [Item(name, Status.SKIP, f"needs a CUDA device, ran on {device}")]


def _shardopt_variants() -> dict[str, Callable[..., Trainer]]:
    return {
        "shard stage 1 flat + both overlaps": lambda m, d, f: shard_trainer(
            m, d, f, stage=1, strategy="flat"
        ),
        "shard stage 2 flat + both overlaps": lambda m, d, f: shard_trainer(
            m, d, f, stage=2, strategy="flat"
        ),
        "shard stage 2 greedy + both overlaps": lambda m, d, f: shard_trainer(
            m, d, f, stage=2, strategy="greedy"
        ),
        "drop-in partition=flat": lambda m, d, f: drop_in(m, d, f, "flat"),
        "drop-in partition=greedy": lambda m, d, f: drop_in(m, d, f, "greedy"),
    }


def _timing_problem() -> tuple[Any, Callable[[int], Any], Callable[..., Any]]:
    """A GPT of about 17M parameters (an 8192-token embedding of width 512, 4 blocks) and its
    batches: big enough that step() is not all launch overhead."""
    import functools

    from shardopt.testing import build_gpt, cross_entropy, token_batch

    model = build_gpt(0, vocab=8192, width=512, depth=4, length=64)
    data = functools.partial(token_batch, batch_size=8, length=64, vocab=8192)
    return model, data, cross_entropy


def _sync_item(name: str, trainer: Trainer, data: Any, device: torch.device) -> Item:
    for i in range(3):  # warm-up: the first steps allocate and plan
        trainer.backward(device_batch(data(i), device))
        trainer.step()
    found: list[str] = []
    for i in range(3, 6):
        trainer.backward(device_batch(data(i), device))
        torch.cuda.synchronize()
        with recording_syncs() as syncs, sync_debug_mode(torch, "warn"):
            trainer.step()
        found += syncs
    trainer.settle()
    figures = {"steps_checked": 3, "host_syncs": len(found), "syncs": tally(found)}
    if not found:
        return Item(name, Status.PASS, "no host sync in 3 steady-state steps", figures)
    return Item(name, Status.FAIL, f"{len(found)} host sync(s) in 3 steps", figures)


def check_syncs(device: torch.device) -> list[Item]:
    """Item d: steady-state step() of every shardopt variant under sync debug mode "warn"."""
    skipped = needs_cuda("d/host syncs", device)
    if skipped is not None:
        return skipped
    model, data, loss = _timing_problem()
    items = []
    for label, make in _shardopt_variants().items():
        trainer = None
        try:
            trainer = make(model, device, loss)
            items.append(_sync_item(f"d/{label}", trainer, data, device))
        except Exception as exc:
            items.append(failed_item(f"d/{label}", exc))
        finally:
            if trainer is not None:
                trainer.close()
    return items


# [Note: device throughput]
# Item e asks how close the update's kernels come to the device's copy bandwidth. Timed one call
# at a time from an idle device, a small update also counts the host's launch latency (the time
# Python takes to reach the kernel), which is no property of the kernel: on an H100 it was more
# than the traffic's time at 10M float32 elements (measured: docs/performance.md). So each sample
# times CALLS back-to-back calls between two events (the host queues them faster than the device
# runs them) and divides; the copy it is compared with is timed the same way. The one-call
# latency is still reported.
CALLS = 10


def cuda_times(fn: Callable[[], Any], warmup: int, repeats: int, calls: int = 1) -> list[float]:
    """Seconds per call of ``fn`` by CUDA events, after ``warmup`` calls: ``repeats`` samples,
    each over ``calls`` back-to-back calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000.0 / calls)
    return times


def copy_rate(device: torch.device, nbytes: int) -> tuple[int, float]:
    """(bytes moved, median seconds) of a device-to-device copy of ``nbytes`` bytes."""
    n = nbytes // 4
    seconds = _copy_seconds(n, device)
    torch.cuda.empty_cache()  # the tensors died with _copy_seconds' frame
    return copy_bytes(4 * n), seconds


def _copy_seconds(n: int, device: torch.device) -> float:
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    return median(cuda_times(lambda: dst.copy_(src), warmup=3, repeats=20, calls=CALLS))


def _adamw_seconds(numel: int, device: torch.device) -> tuple[float, float]:
    seconds = _timed_adamw(numel, device)
    torch.cuda.empty_cache()  # the tensors died with _timed_adamw's frame
    return seconds


def _timed_adamw(numel: int, device: torch.device) -> tuple[float, float]:
    """(seconds per call back to back, seconds of one call from an idle device)."""
    from shardopt.core import adamw, update_pieces_

    tx = adamw(lr=1e-3)
    param = torch.rand(numel, device=device)
    grad = torch.rand(numel, device=device)
    state = tx.init([param])
    repeats = 10 if numel >= 500_000_000 else 20

    def step() -> None:
        update_pieces_(tx, [param], [grad], state)

    return median(cuda_times(step, 3, repeats, CALLS)), median(cuda_times(step, 0, repeats))


def _bandwidth_item(numel: int, device: torch.device, copy: tuple[int, float]) -> Item:
    name = f"e/fused AdamW {numel:,} params"
    free, _ = torch.cuda.mem_get_info(device)
    needed = 4 * 4 * numel  # parameters, gradients and two moments in float32
    if not fits_in_memory(needed, free):
        return Item(name, Status.SKIP, f"needs {needed / 2**30:.1f} GiB, {free / 2**30:.1f} free")
    seconds, one_call = _adamw_seconds(numel, device)
    moved = adamw_bytes(numel)
    fraction = bandwidth_fraction(moved, seconds, *copy)
    figures = {
        "median_ms": 1000 * seconds,
        "one_call_ms": 1000 * one_call,
        "bytes_per_step": moved,
        "GB_per_s": moved / seconds / 1e9,
        "copy_GB_per_s": copy[0] / copy[1] / 1e9,
        "fraction_of_copy": fraction,
        "target": TARGET_FRACTION,
    }
    ok = fraction >= TARGET_FRACTION
    reason = f"{fraction:.1%} of the copy bandwidth (target {TARGET_FRACTION:.0%})"
    return Item(name, Status.PASS if ok else Status.FAIL, reason, figures)


def check_bandwidth(device: torch.device) -> list[Item]:
    """Item e: bytes per second of update_pieces_(adamw) over SIZES, against a 1 GiB copy, both
    timed back to back (see [Note: device throughput])."""
    skipped = needs_cuda("e/fused AdamW bandwidth", device)
    if skipped is not None:
        return skipped
    torch.cuda.empty_cache()
    copy = copy_rate(device, 2**30)
    items = []
    for numel in SIZES:
        try:
            items.append(_bandwidth_item(numel, device, copy))
        except Exception as exc:
            torch.cuda.empty_cache()
            items.append(failed_item(f"e/fused AdamW {numel:,} params", exc))
    return items


def _timed_step(trainer: Trainer, batch: Any) -> float:
    """Seconds of ``trainer.step()`` after its backward, by CUDA events from an idle device (so
    the host's launch time counts too)."""
    trainer.backward(batch)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    trainer.step()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0


def step_rounds(
    trainers: dict[str, Trainer], data: Any, device: torch.device, warmup: int, rounds: int
) -> dict[str, list[float]]:
    """Interleaved rounds, the order rotated every round: each trainer's step() seconds."""
    names = list(trainers)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r, order in enumerate(interleaved_orders(names, warmup + rounds)):
        batch = device_batch(data(r), device)
        for name in order:
            seconds = _timed_step(trainers[name], batch)
            if r >= warmup:
                times[name].append(seconds)
    return times


def step_time_items(times: dict[str, list[float]], baselines: tuple[str, str]) -> list[Item]:
    """One item per non-baseline variant: its median and its ratios to both baselines' medians
    (from the same rounds); PASS when both ratios are at most TARGET_RATIO."""
    medians = {n: median(t) for n, t in times.items()}
    items = []
    for name, value in medians.items():
        if name in baselines:
            continue
        ratios = {f"ratio_vs_{b}": ratio(value, medians[b]) for b in baselines}
        figures = {"median_ms": 1000 * value, **ratios, "rounds": len(times[name])}
        figures.update({f"{b}_median_ms": 1000 * medians[b] for b in baselines})
        over = [k for k, v in ratios.items() if not v <= TARGET_RATIO]
        status = Status.FAIL if over else Status.PASS
        reason = ", ".join(f"{k} {v:.3f}" for k, v in ratios.items())
        items.append(Item(f"f/{name}", status, f"{reason} (target <= {TARGET_RATIO})", figures))
    return items


def check_step_times(device: torch.device, rounds: int = 20) -> list[Item]:
    """Item f: step() of every shardopt variant against torch AdamW(fused) and torch's ZeRO."""
    skipped = needs_cuda("f/step time", device)
    if skipped is not None:
        return skipped
    model, data, loss = _timing_problem()
    trainers = {"torch_adamw": torch_adamw(model, device, loss)}
    trainers["torch_zero"] = torch_zero(model, device, loss)
    trainers.update({n: make(model, device, loss) for n, make in _shardopt_variants().items()})
    start = time.perf_counter()
    try:
        times = step_rounds(trainers, data, device, warmup=3, rounds=rounds)
    finally:
        for t in trainers.values():
            t.close()
    items = step_time_items(times, ("torch_adamw", "torch_zero"))
    for item in items:
        item.figures["wall_s"] = round(time.perf_counter() - start, 1)
    return items
