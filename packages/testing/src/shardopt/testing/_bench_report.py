"""The bench's results across ranks: one row per (model, world size, variant); table, JSON, PNG."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardopt.testing._bench_run import Variant, VariantResult
from shardopt.testing._plan_cli import format_bytes

__all__ = ["BenchRow", "bench_json", "merge_ranks", "render_bench_table", "write_bench_png"]

_BASELINE = Variant.DDP_ZERO


@dataclass(frozen=True, slots=True)
class BenchRow:
    """One variant's figures over the ranks: times and peak of the slowest/fullest rank."""

    model: str
    world_size: int
    variant: str
    parameters: int
    step_s: float
    iteration_s: float
    comm_bytes: int  # sent (= received) per rank and step, ring model of the counted buffers
    handed_bytes: int  # bytes of the buffers handed to collectives per rank and step (counted)
    peak_bytes: int
    consolidate_s: float | None


def merge_ranks(per_rank: Sequence[Sequence[VariantResult]]) -> list[BenchRow]:
    """The rows of one world: each variant's maxima over the ranks."""
    rows = []
    for results in zip(*per_rank):
        first = results[0]
        w = first.world_size
        consolidate = [r.consolidate_s for r in results if r.consolidate_s is not None]
        rows.append(
            BenchRow(
                model=first.model,
                world_size=w,
                variant=first.variant.value,
                parameters=first.parameters,
                step_s=max(r.step_s for r in results),
                iteration_s=max(r.iteration_s for r in results),
                comm_bytes=max(r.traffic.sent(w) for r in results),
                handed_bytes=max(
                    r.traffic.all_reduce + r.traffic.reduce_scatter + r.traffic.all_gather
                    for r in results
                ),
                peak_bytes=max(r.peak_bytes for r in results),
                consolidate_s=max(consolidate) if consolidate else None,
            )
        )
    return rows


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.1f} ms"


def render_bench_table(rows: Sequence[BenchRow]) -> str:
    """One section per (model, world size); each figure with its ratio to torch's ZeRO."""
    header = [
        "variant",
        "step()",
        "vs",
        "iteration",
        "vs",
        "comm/step",
        "vs",
        "peak/rank",
        "vs",
        "consolidate",
        "vs",
    ]
    lines = []
    for key in dict.fromkeys((r.model, r.world_size) for r in rows):
        group = [r for r in rows if (r.model, r.world_size) == key]
        base = next(r for r in group if r.variant == _BASELINE.value)
        lines.append(
            f"\n{key[0]} ({group[0].parameters:,} parameters), W={key[1]}, ratios "
            f"against {_BASELINE.value}"
        )
        table = [header]
        for r in group:
            table.append(
                [
                    r.variant,
                    _ms(r.step_s),
                    _ratio(r.step_s, base.step_s),
                    _ms(r.iteration_s),
                    _ratio(r.iteration_s, base.iteration_s),
                    format_bytes(r.comm_bytes),
                    _ratio(r.comm_bytes, base.comm_bytes),
                    format_bytes(r.peak_bytes),
                    _ratio(r.peak_bytes, base.peak_bytes),
                    _ms(r.consolidate_s),
                    _ratio(r.consolidate_s, base.consolidate_s),
                ]
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        for row in table:
            cells = [row[0].ljust(widths[0])] + [c.rjust(n) for c, n in zip(row[1:], widths[1:])]
            lines.append("  ".join(cells))
    return "\n".join(lines).lstrip("\n")


def machine() -> dict[str, Any]:
    """Where the bench ran."""
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


def bench_json(rows: Sequence[BenchRow], config: dict[str, Any]) -> dict[str, Any]:
    """The rows with the machine and the configuration, as plain data."""
    return {"machine": machine(), "config": config, "rows": [asdict(r) for r in rows]}


def write_bench_png(rows: Sequence[BenchRow], path: str) -> str:
    """Bars of each figure relative to torch's ZeRO, per (model, world size); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = list(dict.fromkeys((r.model, r.world_size) for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    metrics = (
        ("step_s", "step() time"),
        ("iteration_s", "iteration time"),
        ("comm_bytes", "bytes sent per step"),
        ("peak_bytes", "peak bytes per rank"),
    )
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 4))
    width = 0.8 / len(variants)
    for ax, (attr, title) in zip(axes, metrics):
        for j, v in enumerate(variants):
            ratios = []
            for key in keys:
                by = {r.variant: r for r in rows if (r.model, r.world_size) == key}
                base = getattr(by[_BASELINE.value], attr)
                ratios.append(getattr(by[v], attr) / base if base else 0.0)
            ax.bar([i + j * width for i in range(len(keys))], ratios, width, label=v)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(keys))])
        ax.set_xticklabels([f"{m}\nW={w}" for m, w in keys], fontsize=7)
        ax.set_title(f"{title} / torch ZeRO", fontsize=9)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
