"""Item g: ``shardopt demo`` end to end in a subprocess, its final loss and comparison line."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

from shardopt.devtools.gpu_check._report import Item, Status

__all__ = ["demo_command", "demo_item", "parse_demo_output", "run_demo"]

_FINAL = re.compile(
    r"^final loss: (\S+) \(single process, torch\.optim\.AdamW: (\S+), first step: (\S+)\)"
)
_EQUIVALENCE = re.compile(r"^equivalence: .* = (\S+)")


def demo_command(python: str, device: str, steps: int, png: str) -> list[str]:
    """The demo's command line: one rank on ``device`` (NCCL picked for cuda), ``steps`` steps.

    Example:
        >>> demo_command("py", "cuda", 30, "d.png")[3:]
        ['--device', 'cuda', '--world-size', '1', '--steps', '30', '--out', 'd.png']
    """
    return [python, "-m", "shardopt.demo", "--device", device, "--world-size", "1",
            "--steps", str(steps), "--out", png]  # fmt: skip


def parse_demo_output(text: str) -> dict[str, object]:
    """The demo's final loss, the single-process reference's, the first step's, and the
    comparison line with its max difference, from the demo's printed report (missing ones
    absent).

    Example:
        >>> out = ("final loss: 2.5000 (single process, torch.optim.AdamW: 2.5001, first step: "
        ...        "4.1000)\\nequivalence: max |a - b| over the final parameters = 3e-07")
        >>> found = parse_demo_output(out)
        >>> found["final_loss"], found["first_loss"], found["max_abs_diff"]
        (2.5, 4.1, 3e-07)
    """
    found: dict[str, object] = {}
    for line in text.splitlines():
        line = line.strip()
        if m := _FINAL.match(line):
            found.update(final_loss=float(m[1]), reference_loss=float(m[2]), first_loss=float(m[3]))
        elif m := _EQUIVALENCE.match(line):
            found.update(comparison=line, max_abs_diff=float(m[1]))
    return found


def demo_item(returncode: int, output: str) -> Item:
    """PASS when the demo exits 0 and its final loss is finite and below the first step's."""
    figures = parse_demo_output(output)
    tail = " ".join(output.strip().splitlines()[-2:])
    if returncode != 0:
        return Item("g/demo", Status.FAIL, f"exit status {returncode}: {tail}", figures)
    final, first = figures.get("final_loss"), figures.get("first_loss")
    if not isinstance(final, float) or not isinstance(first, float):
        return Item("g/demo", Status.FAIL, f"no final loss in the demo's output: {tail}", figures)
    if not (math.isfinite(final) and final < first):
        return Item("g/demo", Status.FAIL, f"final loss {final} not below first {first}", figures)
    return Item("g/demo", Status.PASS, str(figures.get("comparison", "")), figures)


def run_demo(device: str, out_dir: str, steps: int, timeout: float) -> Item:
    """Runs the demo with this interpreter; its PNG goes to ``out_dir``."""
    cmd = demo_command(sys.executable, device, steps, os.path.join(out_dir, "demo.png"))
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return Item("g/demo", Status.FAIL, f"ran past {timeout:.0f} s: {' '.join(cmd)}")
    item = demo_item(done.returncode, done.stdout + done.stderr)
    item.figures["steps"] = steps
    return item
