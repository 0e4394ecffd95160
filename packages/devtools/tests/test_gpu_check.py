"""shardopt gpu-check on the CPU: its arguments, report, arithmetic, parsers, the one-line exit
without CUDA, and items b and c run on gloo (d, e and f skip with a reason)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from shardopt.cli import build_parser
from shardopt.devtools.gpu_check import _runner
from shardopt.devtools.gpu_check._demo_item import demo_item, parse_demo_output
from shardopt.devtools.gpu_check._junit import junit_items, pytest_command, pytest_run_item
from shardopt.devtools.gpu_check._report import (
    Item,
    Report,
    Status,
    environment,
    failed_item,
    write_report,
)
from shardopt.devtools.gpu_check._stats import (
    adamw_bytes,
    bandwidth_fraction,
    fits_in_memory,
    interleaved_orders,
    median,
    ratio,
)
from shardopt.devtools.gpu_check._syncs import SYNC_WARNING, culprit, recording_syncs
from shardopt.testing import World

REPO = Path(__file__).resolve().parents[3]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
JUNIT = (
    '<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite '
    'name="pytest" errors="1" failures="1" skipped="1" tests="4">'
    '<testcase classname="packages.functional.tests.test_gpu" name="test_ok" time="1.5"/>'
    '<testcase classname="packages.functional.tests.optim.test_ddp_hooks" name="test_nccl" '
    'time="0.000"><skipped type="pytest.skip" message="needs 2 CUDA device(s), found 1">'
    "plugin.py:57: needs 2 CUDA device(s), found 1</skipped></testcase>"
    '<testcase classname="packages.functional.tests.test_gpu" name="test_bad[1]" time="2.0">'
    '<failure message="AssertionError: assert 0.1 &lt;= 1e-05">trace</failure></testcase>'
    '<testcase classname="packages.functional.tests.test_gpu" name="test_setup" time="0.1">'
    '<error message="failed on setup with &quot;boom&quot;">trace</error></testcase>'
    "</testsuite></testsuites>"
)
DEMO = (
    "shardopt demo: a 2,000-parameter character GPT, 1 ranks (nccl, cuda), stage 2\n"
    "final loss: 2.5000 (single process, torch.optim.AdamW: 2.5001, first step: 4.1000)\n"
    "equivalence: max |shardopt - single-process torch.optim.AdamW(fused=True)| over the final "
    "parameters = 3e-07\n"
)


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["gpu-check", *argv])


@NO_CUDA
def test_without_cuda_the_check_prints_one_line_exits_0_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "report"
    assert _runner.main(["--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "sees no CUDA device" in lines[0]
    assert not out.exists()


@NO_CUDA
def test_ci_nox_sh_gpu_needs_no_nox_and_prints_one_line_without_cuda(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "SHARDOPT_GPU_REPORT": str(tmp_path / "r")}
    done = subprocess.run(
        ["sh", "ci/nox.sh", "-s", "gpu", "--", "--items", "b"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [done.stdout.strip()]
    assert "no CUDA device" in done.stdout
    assert not (tmp_path / "r").exists()


def test_the_report_folder_is_out_then_the_environment_then_out_gpu(monkeypatch):
    monkeypatch.delenv("SHARDOPT_GPU_REPORT", raising=False)
    assert _runner.default_out() == "out/gpu"
    monkeypatch.setenv("SHARDOPT_GPU_REPORT", "/tmp/elsewhere")
    assert _runner.default_out() == "/tmp/elsewhere"
    args = parse(["--out", "mine"])
    assert args.out == "mine"
    assert args.run is _runner.run_gpu_check


def test_items_run_in_a_fixed_order_and_unknown_letters_are_refused():
    assert _runner.parse_items("f,a,c") == ["a", "c", "f"]
    assert sorted(_runner.parse_items("all")) == sorted(_runner.ITEMS)
    for bad in ("z", "", "ab,x"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected 'all' or letters"):
            _runner.parse_items(bad)


def test_the_report_lists_every_item_in_json_and_markdown(tmp_path):
    report = Report({"device_name": "NVIDIA H100", "torch": "2.11.0", "nccl": "2.21.5"})
    report.items += [
        Item("b/AdamW/float32", Status.PASS, "within 1e-05", {"worst_rel_error": 3e-8}),
        Item("d/stage 2", Status.FAIL, "2 host syncs", {"syncs": ["shardopt/a.py:3 in f (2x)"]}),
        Item("e/1B", Status.SKIP, "needs 16 GiB", {"ratio": math.nan}),
    ]
    json_path, md_path = write_report(report, str(tmp_path / "new"))
    data = json.loads(Path(json_path).read_text())
    assert data["counts"] == {"PASS": 1, "FAIL": 1, "SKIP": 1}
    assert [i["status"] for i in data["items"]] == ["PASS", "FAIL", "SKIP"]
    assert data["items"][2]["figures"]["ratio"] == "nan"
    assert data["environment"]["device_name"] == "NVIDIA H100"
    md = Path(md_path).read_text()
    assert "| d/stage 2 | FAIL |  | 2 host syncs |" in md
    assert "- shardopt/a.py:3 in f (2x)" in md
    assert "| b/AdamW/float32 | PASS | worst_rel_error=3e-08 | within 1e-05 |" in md


def test_the_environment_names_versions_and_device():
    env = environment(torch, "cpu")
    assert {"date", "python", "torch", "cuda", "nccl", "device_name"} <= env.keys()
    assert env["torch"] == torch.__version__


def raises() -> list[Item]:
    raise RuntimeError("NCCL error: unhandled cuda error")


def test_a_failing_item_is_recorded_with_its_error_and_the_next_still_runs():
    report = Report({})
    _runner.run_item(report, "b", raises, left=100.0)
    _runner.run_item(report, "c", lambda: [Item("c/x", Status.PASS)], left=100.0)
    first, second = report.items
    assert first.status is Status.FAIL
    assert first.reason.startswith("RuntimeError: NCCL error: unhandled cuda error (at ")
    assert "in raises" in first.reason
    assert second.status is Status.PASS
    assert failed_item("x", ValueError("v")).reason == "ValueError: v"


def test_items_after_the_time_budget_are_skipped_without_running():
    report = Report({})
    _runner.run_item(report, "e", raises, left=0.0)
    assert report.items[0].status is Status.SKIP
    assert "budget" in report.items[0].reason


def test_junit_cases_become_items_with_skip_reasons_and_failure_messages():
    items = junit_items(JUNIT)
    assert [(i.name, i.status) for i in items] == [
        ("a/test_gpu::test_ok", Status.PASS),
        ("a/test_ddp_hooks::test_nccl", Status.SKIP),
        ("a/test_gpu::test_bad[1]", Status.FAIL),
        ("a/test_gpu::test_setup", Status.FAIL),
    ]
    assert items[1].reason == "needs 2 CUDA device(s), found 1"
    assert items[2].reason == "AssertionError: assert 0.1 <= 1e-05"
    assert items[0].seconds == 1.5


def test_the_pytest_run_passes_on_0_skips_on_5_and_fails_otherwise():
    assert pytest_run_item(0, "3 passed", 3).status is Status.PASS
    assert pytest_run_item(5, "", 0).status is Status.SKIP
    failed = pytest_run_item(1, "1 failed", 3)
    assert failed.status is Status.FAIL
    assert failed.figures == {"exit_status": 1, "test_cases": 3}


def test_the_pytest_command_selects_gpu_tests_and_loads_the_plugin_only_if_asked():
    with_plugin = pytest_command("py", "j.xml", ["t1", "t2"], with_plugin=True)
    without = pytest_command("py", "j.xml", ["t1", "t2"], with_plugin=False)
    assert "pytest -m gpu" in " ".join(with_plugin)
    assert "shardopt.testing.pytest_plugin" in with_plugin
    assert "shardopt.testing.pytest_plugin" not in without
    assert without[-2:] == ["t1", "t2"]
    assert "--junitxml=j.xml" in without


def test_a_fused_adamw_step_moves_seven_tensors_and_is_compared_to_a_copy():
    assert adamw_bytes(1_000_000) == 28_000_000
    assert adamw_bytes(10, element_size=2) == 140
    # 28 MB in 10 ms against a copy of 2 x 10 MB in 5 ms: 2.8 TB/s over 4 TB/s
    assert bandwidth_fraction(28_000_000, 0.01, 20_000_000, 0.005) == pytest.approx(0.7)
    assert fits_in_memory(16 * 10**9, 80 * 2**30)
    assert not fits_in_memory(16 * 10**9, 16 * 10**9)


def test_medians_and_ratios_ignore_nothing_and_refuse_a_zero_baseline():
    assert median([5.0, 1.0, 3.0, 100.0]) == 4.0
    assert math.isnan(median([]))
    assert ratio(1.0, 2.0) == 0.5
    assert math.isnan(ratio(1.0, 0.0))
    assert math.isnan(ratio(math.nan, 1.0))


def test_interleaved_rounds_put_every_variant_first_equally_often():
    orders = interleaved_orders(["a", "b", "c"], 6)
    assert all(sorted(o) == ["a", "b", "c"] for o in orders)
    assert [o[0] for o in orders].count("b") == 2


def test_step_times_pass_only_when_both_ratios_are_at_most_one():
    from shardopt.devtools.gpu_check._perf import step_time_items

    times = {
        "torch_adamw": [2.0, 2.0, 9.0],
        "torch_zero": [4.0, 4.0, 4.0],
        "fast": [1.0, 2.0, 3.0],
        "between": [3.0, 3.0, 3.0],
    }
    items = {i.name: i for i in step_time_items(times, ("torch_adamw", "torch_zero"))}
    assert set(items) == {"f/fast", "f/between"}
    assert items["f/fast"].status is Status.PASS
    assert items["f/fast"].figures["ratio_vs_torch_adamw"] == 1.0
    assert items["f/between"].status is Status.FAIL
    assert items["f/between"].figures["ratio_vs_torch_zero"] == 0.75
    assert items["f/between"].figures["ratio_vs_torch_adamw"] == 1.5


FAKE_SHARDOPT = """
import warnings


def sync_twice():
    for _ in range(2):
        warnings.warn("called a synchronizing CUDA operation", UserWarning)


def sync_once():
    warnings.warn("called a synchronizing CUDA operation", UserWarning)
"""


def test_every_sync_warning_is_listed_with_the_shardopt_frame_that_caused_it():
    path = os.path.join(os.sep, "site", "shardopt", "functional", "_fake.py")
    scope: dict[str, object] = {}
    exec(compile(FAKE_SHARDOPT, path, "exec"), scope)
    with recording_syncs() as found:
        scope["sync_twice"]()
        scope["sync_once"]()
    assert found == [
        "shardopt/functional/_fake.py:7 in sync_twice",
        "shardopt/functional/_fake.py:7 in sync_twice",
        "shardopt/functional/_fake.py:11 in sync_once",
    ]
    with warnings.catch_warnings(record=True) as after:
        warnings.simplefilter("always")
        warnings.warn(SYNC_WARNING, UserWarning, stacklevel=1)
    assert len(after) == 1  # the recorder is gone, warnings behave as before


def test_a_sync_outside_shardopt_is_named_as_such():
    frames = [
        type(
            "F",
            (),
            {"filename": "/x/shardopt/devtools/gpu_check/_perf.py", "lineno": 9, "name": "f"},
        ),
        type("F", (), {"filename": "/x/torch/_tensor.py", "lineno": 3, "name": "item"}),
    ]
    assert culprit(frames) == "(outside shardopt) torch/_tensor.py:3 in item"


def test_the_demo_passes_when_it_exits_0_and_its_loss_fell():
    found = parse_demo_output(DEMO)
    assert found["final_loss"] == 2.5
    assert found["reference_loss"] == 2.5001
    assert found["max_abs_diff"] == 3e-07
    assert demo_item(0, DEMO).status is Status.PASS
    assert demo_item(0, DEMO).reason.startswith("equivalence: max |shardopt")
    assert demo_item(1, DEMO + "Traceback: boom").status is Status.FAIL
    assert demo_item(0, "no report here").status is Status.FAIL
    risen = DEMO.replace("first step: 4.1000", "first step: 1.0000")
    assert demo_item(0, risen).status is Status.FAIL


@pytest.mark.world(1, backend="gloo", timeout=120)
def test_on_cpu_items_b_and_c_pass_on_gloo_and_d_e_f_skip(world: World, tmp_path):
    args = parse(["--device", "cpu", "--items", "bcdef", "--out", str(tmp_path)])
    assert _runner.run_gpu_check(args) == 0
    items = json.loads((tmp_path / "report.json").read_text())["items"]
    status = {i["name"]: i["status"] for i in items}
    names = {n.split("/")[1] for n in status if n.startswith("b/")}
    newer = {n for n in ("Muon", "Adafactor") if hasattr(torch.optim, n)}  # torch 2.9 / 2.5
    assert {"SGD", "AdamW", "Adagrad", "Rprop", "ASGD", *newer} <= names
    assert sum(n.startswith("b/") for n in status) == 2 * len(names)
    assert sum(n.startswith("c/") for n in status) == 8
    assert {n: s for n, s in status.items() if s != "PASS"} == {
        "d/host syncs": "SKIP",
        "e/fused AdamW bandwidth": "SKIP",
        "f/step time": "SKIP",
    }
    moved = [i["figures"]["moved"] for i in items if i["name"].startswith("c/shard")]
    assert min(moved) > 1e-4
