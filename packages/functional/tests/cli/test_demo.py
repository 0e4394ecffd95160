"""shardopt demo: a tiny run end to end (report, PNG), the command line, torchrun, the corpus."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from shardopt.cli._cli import main
from shardopt.cli._demo_data import VOCAB, decode, encode, read_corpus, sample_batch
from shardopt.cli._demo_report import format_report
from shardopt.cli._demo_train import DemoConfig, train_rank
from shardopt.testing import spawn

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
TINY = DemoConfig(
    steps=3, batch=2, length=16, width=16, depth=1, heads=2, corpus_bytes=20_000, sample_chars=12
)
TINY_ARGS = ["--steps", "2", "--batch", "2", "--width", "16", "--depth", "1", "--corpus-kib", "20"]


def is_png(path: str) -> bool:
    with open(path, "rb") as file:
        return file.read(8) == PNG_MAGIC


@pytest.mark.parametrize("stage", [1, 2])
def test_demo_reports_loss_memory_equivalence_and_sample_and_writes_a_png(tmp_path, stage):
    config = dataclasses.replace(TINY, stage=stage, out=str(tmp_path / "demo.png"))
    # A forkserver world (seconds less than launch's elastic agent; launch runs the demo in the
    # tests of the command below and under torchrun).
    report, other = spawn(train_rank, 2, config, "gloo", backend="gloo", timeout=120.0)
    assert other is None  # only rank 0 reports
    assert (report.steps, len(report.reference_losses)) == (3, 3)
    assert all(math.isfinite(x) and x > 0 for x in report.losses)
    assert report.losses[0] == pytest.approx(report.reference_losses[0], rel=1e-5)
    assert report.max_abs_diff < 1e-5  # same data, same gradients, same fused AdamW kernel
    ddp, _, ours = (report.memory[k] for k in report.memory)
    assert list(report.memory) == [
        "DDP + AdamW",
        "torch ZeroRedundancyOptimizer",
        f"shardopt stage {stage}",
    ]
    assert 0 <= ours.params - ddp.params < 2 * 16 * 4  # a flat buffer, padded: no copy
    assert ours.optimizer < 0.6 * ddp.optimizer  # half the moments, plus padding and counts
    assert (ours.grads < 0.6 * ddp.grads) == (stage == 2)
    assert len(report.sample) == config.sample_chars
    assert report.png == config.out
    assert is_png(config.out)
    text = format_report(report)
    assert "final loss" in text
    assert "max |shardopt - single-process torch.optim.AdamW(fused=True)|" in text


def test_shardopt_demo_command_runs_stage1_and_writes_the_png(tmp_path):
    out = tmp_path / "sub" / "demo.png"
    assert main(["demo", "--stage", "1", *TINY_ARGS, "--out", str(out)]) == 0
    assert is_png(str(out))


def test_python_m_shardopt_demo_runs_under_torchrun(tmp_path):
    out = tmp_path / "demo.png"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "shardopt.demo",
        *TINY_ARGS,
        "--out",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 ranks (gloo, cpu)" in done.stdout
    assert done.stdout.count("equivalence:") == 1  # rank 0 alone reports
    assert is_png(str(out))


def test_demo_refuses_a_third_stage():
    with pytest.raises(ValueError, match="demo: expected --stage 1 or 2, got 3"):
        DemoConfig(stage=3)


def test_corpus_is_python_source_of_the_size_asked_for():
    text = read_corpus(50_000)
    assert len(text) >= 50_000
    assert "def " in text
    assert decode(encode(text[:1000])) == "".join(c if c in VOCAB else "?" for c in text[:1000])


def test_each_rank_trains_on_its_own_rows_of_the_same_global_batch():
    data = encode(read_corpus(5_000))
    x, y = sample_batch(data, 7, 6, 10)
    again, _ = sample_batch(data, 7, 6, 10)
    other, _ = sample_batch(data, 8, 6, 10)
    assert torch.equal(x, again)
    assert not torch.equal(x, other)
    assert torch.equal(x[:, 1:], y[:, :-1])
