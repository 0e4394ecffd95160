"""The bench's results: each run's ranks merged, the runs summarised (median and min-max of every
ratio), and the table, JSON and PNG made of them."""

from __future__ import annotations

import os
import platform
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch

from shardopt.devtools.bench._run import (
    BASELINE,
    REFERENCE,
    RankRun,
    Variant,
    VariantRun,
    median_or_none,
    slowest,
)

__all__ = [
    "RATIOS",
    "TARGETS",
    "RunResult",
    "SummaryRow",
    "bench_json",
    "merge_run",
    "render_bench_table",
    "summarize",
    "write_bench_png",
]

# name -> (figure, variant it is divided by)
RATIOS: dict[str, tuple[str, Variant]] = {
    "step_vs_zero": ("step_s", BASELINE),
    "iteration_vs_zero": ("iteration_s", BASELINE),
    "step_vs_adam": ("step_s", REFERENCE),
    "iteration_vs_adam": ("iteration_s", REFERENCE),
    "consolidate_vs_zero": ("consolidate_s", BASELINE),
}

_PER_ROUND = {"step_s": "steps_s", "iteration_s": "iterations_s"}

# The targets: (variant, ratio, at most)
TARGETS: tuple[tuple[Variant, str, float], ...] = (
    (Variant.STAGE2_OVERLAP, "iteration_vs_zero", 0.85),
    (Variant.STAGE2_OVERLAP, "iteration_vs_adam", 1.0),
    (Variant.STAGE2_OVERLAP, "step_vs_zero", 0.5),
    (Variant.DROP_IN, "step_vs_zero", 1.0),
    (Variant.DROP_IN, "consolidate_vs_zero", 0.05),
    (Variant.STAGE1, "consolidate_vs_zero", 0.05),
    (Variant.STAGE2, "consolidate_vs_zero", 0.05),
    (Variant.STAGE2_OVERLAP, "consolidate_vs_zero", 0.05),
)


@dataclass(frozen=True, slots=True)
class RunResult:
    """One variant in one run (one world), its ranks merged (see [Note: bench protocol])."""

    run: int
    world_size: int
    variant: str
    parameters: int
    buckets: int
    step_s: float | None  # median over rounds of the slowest rank's step()
    iteration_s: float | None  # likewise, forward + backward + step()
    steps_s: list[float]  # per timed round, the slowest rank's
    iterations_s: list[float]
    launched_early: float | None  # median over rounds of the smallest fraction over ranks
    comm_bytes: int | None  # sent (= received) per rank and step, ring model of the buffers
    handed_bytes: int | None  # bytes of the buffers handed to collectives per rank and step
    collectives: int | None  # reduce-scatter/all-gather (or reduce/broadcast) calls per step
    peak_bytes: int | None  # the fullest rank's
    consolidate_s: float | None  # the slowest rank's
    ratios: dict[str, float | None]  # ratio of this run's medians (see RATIOS)
    paired_ratios: dict[str, float | None]  # median over rounds of the same round's ratio
    error: str | None


def _merge_variant(run: int, world: int, runs: Sequence[VariantRun]) -> dict[str, Any]:
    first = runs[0]
    error = next((r.error for r in runs if r.error and r.error != "failed on another rank"), None)
    error = error or next((r.error for r in runs if r.error), None)
    steps = slowest([r.steps for r in runs]) if error is None else []
    iterations = slowest([r.iterations for r in runs]) if error is None else []
    early = [min(x) for x in zip(*(r.launched_early for r in runs))] if error is None else []
    traffic = [r.traffic for r in runs if r.traffic is not None]
    consolidate = [r.consolidate_s for r in runs if r.consolidate_s is not None]
    whole = error is None and len(traffic) == len(runs)
    return {
        "run": run,
        "world_size": world,
        "variant": first.variant.value,
        "parameters": max(r.parameters for r in runs),
        "buckets": first.buckets,
        "step_s": median_or_none(steps),
        "iteration_s": median_or_none(iterations),
        "steps_s": steps,
        "iterations_s": iterations,
        "launched_early": median_or_none(early),
        "comm_bytes": max(t.sent(world) for t in traffic) if whole else None,
        "handed_bytes": (
            max(t.all_reduce + t.reduce_scatter + t.all_gather for t in traffic) if whole else None
        ),
        "collectives": max(t.collectives for t in traffic) if whole else None,
        "peak_bytes": max(r.peak_bytes for r in runs) if error is None else None,
        "consolidate_s": max(consolidate) if error is None and consolidate else None,
        "error": error,
    }


def merge_run(run: int, per_rank: Sequence[RankRun]) -> list[RunResult]:
    """The results of one run (one world): each variant's ranks merged, with its ratios."""
    world = per_rank[0].world_size
    merged = [_merge_variant(run, world, runs) for runs in zip(*(r.variants for r in per_rank))]
    by_variant = {m["variant"]: m for m in merged}
    out = []
    for m in merged:
        ratios: dict[str, float | None] = {}
        paired: dict[str, float | None] = {}
        for name, (attr, base) in RATIOS.items():
            other = by_variant.get(base.value, {})
            value, b = m[attr], other.get(attr)
            ratios[name] = value / b if value is not None and b else None
            if attr in _PER_ROUND:
                xs, bs = m[_PER_ROUND[attr]], other.get(_PER_ROUND[attr]) or []
                per_round = [x / y for x, y in zip(xs, bs) if y]
                paired[name] = median_or_none(per_round)
        out.append(RunResult(**m, ratios=ratios, paired_ratios=paired))
    return out


@dataclass(frozen=True, slots=True)
class Spread:
    """A figure over the runs: its median, smallest and largest (None: no run had it)."""

    median: float
    min: float
    max: float

    @staticmethod
    def of(values: Sequence[float | None]) -> Spread | None:
        xs = [v for v in values if v is not None]
        return Spread(statistics.median(xs), min(xs), max(xs)) if xs else None


@dataclass(frozen=True, slots=True)
class SummaryRow:
    """One variant at one world size over the runs."""

    world_size: int
    variant: str
    parameters: int
    buckets: int
    runs: int  # runs where it ran through
    step_s: Spread | None
    iteration_s: Spread | None
    ratios: dict[str, Spread | None]
    paired_ratios: dict[str, Spread | None]
    launched_early: Spread | None
    comm_bytes: int | None
    handed_bytes: int | None
    collectives: int | None
    peak_bytes: int | None
    consolidate_s: Spread | None
    errors: list[str]


def summarize(results: Sequence[RunResult]) -> list[SummaryRow]:
    """One row per (world size, variant) in first-seen order: medians and min-max over runs."""
    rows = []
    for key in dict.fromkeys((r.world_size, r.variant) for r in results):
        group = [r for r in results if (r.world_size, r.variant) == key]
        ok = [r for r in group if r.error is None]

        def largest(attr: str, ok: list[RunResult] = ok) -> int | None:
            xs = [getattr(r, attr) for r in ok if getattr(r, attr) is not None]
            return max(xs) if xs else None

        rows.append(
            SummaryRow(
                world_size=key[0],
                variant=key[1],
                parameters=group[0].parameters,
                buckets=group[0].buckets,
                runs=len(ok),
                step_s=Spread.of([r.step_s for r in ok]),
                iteration_s=Spread.of([r.iteration_s for r in ok]),
                ratios={n: Spread.of([r.ratios[n] for r in ok]) for n in RATIOS},
                paired_ratios={
                    n: Spread.of([r.paired_ratios[n] for r in ok]) for n in ok[0].paired_ratios
                }
                if ok
                else {},
                launched_early=Spread.of([r.launched_early for r in ok]),
                comm_bytes=largest("comm_bytes"),
                handed_bytes=largest("handed_bytes"),
                collectives=largest("collectives"),
                peak_bytes=largest("peak_bytes"),
                consolidate_s=Spread.of([r.consolidate_s for r in ok]),
                errors=list(dict.fromkeys(r.error for r in group if r.error is not None)),
            )
        )
    return rows


def _ratio(s: Spread | None) -> str:
    if s is None:
        return "-"
    return f"{s.median:.2f}x ({s.min:.2f}-{s.max:.2f})"


def _ms(s: Spread | None) -> str:
    return "-" if s is None else f"{1000 * s.median:.1f} ms"


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    x = float(n)
    for unit in ("B", "KiB", "MiB"):
        if x < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.2f} GiB"


def _grid(table: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    out = []
    for row in table:
        cells = [row[0].ljust(widths[0])] + [c.rjust(n) for c, n in zip(row[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out


def _verdict(rows: Sequence[SummaryRow]) -> list[str]:
    lines = ["targets (worst run = the max of the min-max):"]
    for variant, ratio, limit in TARGETS:
        for row in rows:
            if row.variant != variant.value:
                continue
            s = row.ratios.get(ratio)
            if s is None:
                state = "not measured" + (f" ({row.errors[0]})" if row.errors else "")
            else:
                met = "met" if s.max <= limit else ("median met" if s.median <= limit else "MISSED")
                state = f"{_ratio(s)}: {met}"
            lines.append(f"  W={row.world_size} {variant.value}: {ratio} <= {limit}: {state}")
    return lines


def render_bench_table(rows: Sequence[SummaryRow], config: dict[str, Any]) -> str:
    """One section per world size: times, ratios (median and min-max over runs), bytes, memory,
    consolidation, launched early and failures; then the issue's targets."""
    header = [
        "variant",
        "step()",
        "/ torch ZeRO",
        "iteration",
        "/ torch ZeRO",
        "/ DDP+Adam",
        "comm/step",
        "peak/rank",
        "consolidate",
        "/ torch ZeRO",
    ]
    lines = []
    for w in dict.fromkeys(r.world_size for r in rows):
        group = [r for r in rows if r.world_size == w]
        lines.append(
            f"\n{config['model']} ({group[0].parameters:,} parameters), W={w}, gloo CPU: "
            f"{config['repeats']} runs x {config['iters']} timed rounds ({config['warmup']} "
            "warm-up); times: median over runs of each run's median; ratios: median (min-max) "
            "over runs of each run's ratio of medians"
        )
        table = [header]
        for r in group:
            if r.runs == 0:
                table.append([r.variant, "FAILED"] + [""] * (len(header) - 2))
                continue
            table.append(
                [
                    r.variant,
                    _ms(r.step_s),
                    _ratio(r.ratios["step_vs_zero"]),
                    _ms(r.iteration_s),
                    _ratio(r.ratios["iteration_vs_zero"]),
                    _ratio(r.ratios["iteration_vs_adam"]),
                    _bytes(r.comm_bytes),
                    _bytes(r.peak_bytes),
                    _ms(r.consolidate_s),
                    _ratio(r.ratios["consolidate_vs_zero"]),
                ]
            )
        lines.extend(_grid(table))
        for r in group:
            if r.launched_early is not None:
                e = r.launched_early
                lines.append(
                    f"  {r.variant}: reduce-scatter launched before backward() returns "
                    f"(GradHooks.launched_early): {e.median:.3f} ({e.min:.3f}-{e.max:.3f}); "
                    f"{r.buckets} buckets"
                )
            for error in r.errors:
                lines.append(f"  {r.variant}: FAILED: {error}")
    lines.append("")
    lines.append("variants:")
    for name in config["variants"]:
        lines.append(f"  {Variant[name].value}: {Variant[name].describe(config['bucket_numel'])}")
    lines.append("")
    lines.extend(_verdict(rows))
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


def bench_json(
    rows: Sequence[SummaryRow], results: Sequence[RunResult], config: dict[str, Any]
) -> dict[str, Any]:
    """The summary rows, every run's results, the targets, the machine and the configuration."""
    targets = []
    for variant, ratio, limit in TARGETS:
        for row in rows:
            if row.variant == variant.value:
                s = row.ratios.get(ratio)
                targets.append(
                    {
                        "world_size": row.world_size,
                        "variant": row.variant,
                        "ratio": ratio,
                        "at_most": limit,
                        "median": None if s is None else s.median,
                        "max": None if s is None else s.max,
                        "met_in_every_run": None if s is None else s.max <= limit,
                    }
                )
    return {
        "machine": machine(),
        "config": config,
        "variants": {v.value: v.describe(config["bucket_numel"]) for v in Variant},
        "rows": [asdict(r) for r in rows],
        "targets": targets,
        "runs": [asdict(r) for r in results],
    }


_PANELS = (
    ("iteration_vs_zero", "iteration / DDP + torch ZeRO", 0.85),
    ("iteration_vs_adam", "iteration / DDP + Adam(fused)", 1.0),
    ("step_vs_zero", "step() / DDP + torch ZeRO", 0.5),
    ("consolidate_vs_zero", "consolidation / torch ZeRO (log)", 0.05),
)


def write_bench_png(rows: Sequence[SummaryRow], path: str, title: str = "") -> str:
    """Bars of each ratio's median over runs with min-max whiskers, per world size, every
    variant (a failed one is marked); dashed lines at the targets. Returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = list(dict.fromkeys(r.world_size for r in rows))
    variants = list(dict.fromkeys(r.variant for r in rows))
    fig, axes = plt.subplots(1, len(_PANELS), figsize=(4.6 * len(_PANELS), 5.0))
    width = 0.8 / len(variants)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, (ratio, label, target) in zip(axes, _PANELS):
        for j, v in enumerate(variants):
            xs, ys, lo, hi, failed = [], [], [], [], []
            for i, w in enumerate(worlds):
                row = next((r for r in rows if (r.world_size, r.variant) == (w, v)), None)
                s = None if row is None else row.ratios.get(ratio)
                x = i + (j - (len(variants) - 1) / 2) * width
                if s is None:
                    if row is not None and row.errors:
                        failed.append(x)
                    continue
                xs.append(x)
                ys.append(s.median)
                lo.append(s.median - s.min)
                hi.append(s.max - s.median)
            color = colors[j % len(colors)]
            ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, color=color, label=v)
            for x in failed:
                ax.text(x, 0.02, "failed", rotation=90, fontsize=6, ha="center", va="bottom")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(target, color="red", linewidth=0.8, linestyle="--")
        if ratio == "consolidate_vs_zero":
            ax.set_yscale("log")
        ax.set_xticks(range(len(worlds)))
        ax.set_xticklabels([f"W={w}" for w in worlds])
        ax.set_title(label, fontsize=9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(variants), 6), fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
