"""Step time and per-rank state bytes of our ZeroRedundancyOptimizer against torch's (gloo, CPU).

torch's baseline is its best setting: ``parameters_as_bucket_view=True`` and Adam
``fused=True``; its default (no bucket views: one broadcast per parameter) is shown too. Ours
runs with the same arguments (the default greedy partition, so the same local optimizer and the
same shards), without bucket views (staged), and with ``partition="flat"`` (shardopt.core's Adam
over equal flat slices). All variants live in one world, each on its own
copy of the model, with the same gradients; a step is ``step()`` (local update + parameter
sync), timed on every rank, the slowest rank counted, variants interleaved round by round.
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
from tqdm import tqdm

from shardopt.testing import spawn

from _bench_io import write_results

OUT = Path(__file__).resolve().parents[1] / "out" / "bench_zero_step.json"
# variant -> (implementation, constructor keyword arguments besides the model's parameters)
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch_bucket_view_fused": (
        "torch",
        {"parameters_as_bucket_view": True, "lr": 1e-3, "fused": True},
    ),
    "torch_staged_fused": ("torch", {"lr": 1e-3, "fused": True}),
    "ours_bucket_view_fused": (
        "ours",
        {"parameters_as_bucket_view": True, "lr": 1e-3, "fused": True},
    ),
    "ours_staged_fused": ("ours", {"lr": 1e-3, "fused": True}),
    "ours_flat": ("ours", {"lr": 1e-3, "partition": "flat"}),
}
BASELINE = "torch_bucket_view_fused"


def mlp_shapes(width: int, depth: int) -> list[tuple[int, ...]]:
    return [s for _ in range(depth) for s in ((width, width), (width,))]


def gpt_shapes(vocab: int, d: int, layers: int) -> list[tuple[int, ...]]:
    """GPT-2's parameter shapes (tied embedding, position embedding, blocks, final norm)."""
    block = [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,)]
    block += [(4 * d, d), (4 * d,), (d, 4 * d), (d,)]
    return [(vocab, d), (1024, d), *block * layers, (d,), (d,)]


MODELS = {
    "mlp_12x1024": mlp_shapes(1024, 12),  # 12.6M parameters, all layers alike
    "gpt_d384_l6": gpt_shapes(16384, 384, 6),  # 17.4M; the embedding is 36% of it
    "mlp_24x512": mlp_shapes(512, 24),
}


def build(variant: str, shapes: list[tuple[int, ...]]) -> tuple[torch.nn.Module, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

    from shardopt.optim import ZeroRedundancyOptimizer

    impl, kwargs = VARIANTS[variant]
    torch.manual_seed(0)
    model = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes])
    cls = TorchZero if impl == "torch" else ZeroRedundancyOptimizer
    opt = cls(model.parameters(), torch.optim.Adam, **kwargs)
    gen = torch.Generator().manual_seed(1)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2
    return model, opt


def local_state_bytes(opt: Any) -> int:
    """Bytes of the optimizer state tensors this rank holds (flat: its buffers, padding in)."""
    if hasattr(opt.optim, "units"):
        return sum(
            b.numel() * b.element_size()
            for unit in opt.optim.units()
            if unit is not None
            for f in unit.state.fields
            for b in f.buffers
            if f.granularity.value == "elementwise"
        )
    seen, total = set(), 0
    for entry in opt.optim.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                key = (value.untyped_storage().data_ptr(), value.storage_offset())
                if key not in seen:
                    seen.add(key)
                    total += value.numel() * value.element_size()
    return total


def measure(rank: int, world: int, model: str, repeat: int) -> dict[str, Any]:
    built = {v: build(v, MODELS[model]) for v in VARIANTS}
    times: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for i in range(repeat + 2):
        order = list(VARIANTS) if i % 2 == 0 else list(VARIANTS)[::-1]
        for v in order:
            dist.barrier()
            start = time.perf_counter()
            built[v][1].step()
            if i >= 2:  # two rounds of warm-up
                times[v].append(time.perf_counter() - start)
    return {"times": times, "state": {v: local_state_bytes(o) for v, (_, o) in built.items()}}


def run_case(world: int, model: str, repeat: int) -> dict[str, Any]:
    per_rank = spawn(measure, world, model, repeat, backend="gloo", timeout=1200)
    slowest = {
        v: [max(r["times"][v][i] for r in per_rank) for i in range(repeat)] for v in VARIANTS
    }
    median = {v: statistics.median(ts) for v, ts in slowest.items()}
    state = {v: [r["state"][v] for r in per_rank] for v in VARIANTS}
    return {
        "world_size": world,
        "model": model,
        "median_step_s": median,
        "ratio_vs_torch": {v: median[v] / median[BASELINE] for v in VARIANTS},
        "state_bytes_per_rank": state,
        "max_state_over_total_div_w": {
            v: max(s) * world / sum(s) if sum(s) else 1.0 for v, s in state.items()
        },
    }


def print_table(rows: list[dict[str, Any]]) -> None:
    header = ("model", "W", "variant", "step ms", "vs torch", "max-rank state MB", "max/(total/W)")
    widths = (12, 2, 23, 9, 8, 17, 13)
    print("\n" + " ".join(f"{h:>{w}}" for h, w in zip(header, widths)))
    for r in rows:
        for v in VARIANTS:
            cells = (
                r["model"],
                r["world_size"],
                v,
                f"{r['median_step_s'][v] * 1e3:.1f}",
                f"{r['ratio_vs_torch'][v]:.2f}x",
                f"{max(r['state_bytes_per_rank'][v]) / 2**20:.1f}",
                f"{r['max_state_over_total_div_w'][v]:.3f}",
            )
            print(" ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
    print("(step: median over rounds of the slowest rank's step(); vs torch: ratio of medians)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument(
        "--models", nargs="+", default=["mlp_12x1024", "gpt_d384_l6"], choices=list(MODELS)
    )
    parser.add_argument("--repeat", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="the small model, few rounds")
    args = parser.parse_args()
    if args.quick:
        args.models, args.repeat = ["mlp_24x512"], 3
    cases = [(w, m) for m in args.models for w in args.worlds]
    rows = [run_case(w, m, args.repeat) for w, m in tqdm(cases, desc="bench_zero_step")]
    print("\nAdam on gloo (CPU), one intra-op thread per rank")
    print_table(rows)
    write_results(OUT, rows)


if __name__ == "__main__":
    main()
