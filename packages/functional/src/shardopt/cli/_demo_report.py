"""The demo's report: final loss, per-rank memory, the equivalence check, a sample; text and PNG."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from shardopt.cli._plan_cli import format_bytes
from shardopt.functional import RankBytes

__all__ = ["DemoReport", "format_report", "write_png"]


@dataclass(frozen=True, slots=True)
class DemoReport:
    """What a demo run measured (rank 0's view; per-rank bytes are maxima over the ranks).

    ``memory`` maps a setup (DDP + AdamW, torch's ZeroRedundancyOptimizer, shardopt) to the
    bytes of its real tensors on the fullest rank; ``max_abs_diff`` compares the final
    parameters with a single-process ``torch.optim.AdamW`` run on the same data.
    """

    world_size: int
    stage: int
    backend: str
    device: str
    parameters: int
    corpus_bytes: int
    corpus_dir: str
    losses: tuple[float, ...]
    reference_losses: tuple[float, ...]
    step_times: tuple[float, ...]
    memory: Mapping[str, RankBytes]
    max_abs_diff: float
    sample: str
    png: str | None = None

    def __post_init__(self) -> None:
        if not self.losses or len(self.losses) != len(self.step_times):
            raise ValueError(
                f"DemoReport: expected one loss and one step time per step, got "
                f"{len(self.losses)} and {len(self.step_times)}"
            )

    @property
    def steps(self) -> int:
        """The number of optimizer steps taken."""
        return len(self.losses)

    @property
    def final_loss(self) -> float:
        """The mean over ranks of the last step's loss."""
        return self.losses[-1]


def _median(xs: tuple[float, ...]) -> float:
    s = sorted(xs)
    return s[len(s) // 2]


def format_report(report: DemoReport) -> str:
    """The report as a few lines of text."""
    r = report
    lines = [
        f"shardopt demo: a {r.parameters:,}-parameter character GPT, {r.world_size} ranks "
        f"({r.backend}, {r.device}), stage {r.stage}, {r.steps} steps, "
        f"median step {1000 * _median(r.step_times):.1f} ms",
        f"corpus: {r.corpus_bytes // 1024} KiB of Python sources from {r.corpus_dir}",
        f"final loss: {r.final_loss:.4f} (single process, torch.optim.AdamW: "
        f"{r.reference_losses[-1]:.4f}, first step: {r.losses[0]:.4f})",
        "bytes per rank (max over ranks):",
    ]
    width = max(len(name) for name in r.memory)
    header = ("params", "grads", "optimizer", "buffers", "total")
    lines.append("  " + " " * width + "".join(h.rjust(12) for h in header))
    for name, held in r.memory.items():
        cells = (held.params, held.grads, held.optimizer + held.master, held.buffers, held.total)
        lines.append("  " + name.ljust(width) + "".join(format_bytes(c).rjust(12) for c in cells))
    lines.append(
        "  (real tensors between steps; buffers: shardopt's collective staging; DDP assumed with "
        "gradient_as_bucket_view=True)"
    )
    verdict = " (bitwise equal)" if r.max_abs_diff == 0 else ""
    lines.append(
        f"equivalence: max |shardopt - single-process torch.optim.AdamW(fused=True)| over the "
        f"final parameters = {r.max_abs_diff:.3g}{verdict}"
    )
    lines.append("sample: " + repr(r.sample))
    if r.png is not None:
        lines.append(f"wrote {r.png}")
    return "\n".join(lines)


def write_png(report: DemoReport, path: str) -> str:
    """Draws the loss curves and per-rank memory bars into ``path`` (matplotlib, Agg); returns
    the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    steps = range(1, report.steps + 1)
    left.plot(
        steps, report.losses, label=f"shardopt stage {report.stage}, {report.world_size} ranks"
    )
    left.plot(steps, report.reference_losses, "--", label="single-process torch.optim.AdamW")
    left.set(xlabel="step", ylabel="cross-entropy loss", title="training loss")
    left.legend()
    names = list(report.memory)
    bottoms = [0.0] * len(names)
    kinds = (
        ("params", "parameters"),
        ("grads", "gradients"),
        ("optimizer", "optimizer state"),
        ("buffers", "collective buffers"),
    )
    for attr, label in kinds:
        values = [getattr(report.memory[n], attr) / 2**20 for n in names]
        if attr == "optimizer":
            values = [v + report.memory[n].master / 2**20 for v, n in zip(values, names)]
        right.bar(names, values, bottom=bottoms, label=label)
        bottoms = [b + v for b, v in zip(bottoms, values)]
    right.set(ylabel="MiB per rank (max over ranks)", title="memory per rank")
    right.tick_params(axis="x", labelsize=8)
    right.set_ylim(top=max(bottoms) * 1.35)
    right.legend(fontsize=8, ncols=2, loc="upper right")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
