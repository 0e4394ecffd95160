"""shardopt bench --quick: the machinery runs and its outputs have their structure (no timings
are checked: they belong to the bench, not to tests)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from shardopt.devtools.bench._cli import add_bench_parser
from shardopt.devtools.bench._report import (
    RATIOS,
    merge_run,
    render_bench_table,
    summarize,
    write_bench_png,
)
from shardopt.devtools.bench._run import BenchConfig, RankRun, Variant, VariantRun, _Runner, _Slot
from shardopt.testing import spawn


def bench(argv: list[str]) -> int:
    """``shardopt bench ARGV`` through the bench's own parser."""
    parser = argparse.ArgumentParser(prog="shardopt")
    add_bench_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["bench", *argv])
    return args.run(args)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str]:
    out = tmp_path_factory.mktemp("bench")
    argv = ["--quick", "--world-size", "2", "--repeats", "2", "--warmup", "0"]
    argv += ["--out-dir", str(out)]
    assert bench(argv) == 0
    with open(out / "bench.json", encoding="utf-8") as file:
        return json.load(file), str(out / "bench.png")


def test_every_variant_runs_in_every_run_with_per_round_times(quick):
    data, _ = quick
    config = data["config"]
    assert (config["model"], config["iters"], config["repeats"]) == ("tiny-mlp", 2, 2)
    runs = data["runs"]
    assert [(r["run"], r["variant"]) for r in runs] == [
        (run, v.value) for run in range(2) for v in Variant
    ]
    for r in runs:
        assert r["error"] is None, r["variant"]
        assert r["world_size"] == 2
        assert len(r["steps_s"]) == len(r["iterations_s"]) == 2
        assert all(0 < s <= i for s, i in zip(r["steps_s"], r["iterations_s"]))
        assert min(r["peak_bytes"], r["comm_bytes"], r["handed_bytes"]) > 0
        assert (r["consolidate_s"] is None) == (r["variant"] == Variant.DDP_ADAM.value)
        assert r["ratios"]["iteration_vs_zero"] is not None
    baseline = [r for r in runs if r["variant"] == Variant.DDP_ZERO.value]
    assert all(r["ratios"]["step_vs_zero"] == 1.0 for r in baseline)
    assert data["machine"]["torch"] == torch.__version__


def test_summary_rows_give_median_and_min_max_of_every_ratio(quick):
    data, _ = quick
    rows = data["rows"]
    assert [r["variant"] for r in rows] == [v.value for v in Variant]
    for row in rows:
        assert (row["runs"], row["errors"]) == (2, [])
        for name in RATIOS:
            s = row["ratios"][name]
            if name == "consolidate_vs_zero" and row["variant"] == Variant.DDP_ADAM.value:
                assert s is None
                continue
            assert s["min"] <= s["median"] <= s["max"], (row["variant"], name)
    assert {t["ratio"] for t in data["targets"]} >= {"iteration_vs_zero", "step_vs_zero"}


def test_launched_early_is_reported_for_the_hooked_variants_only(quick):
    data, _ = quick
    for row in data["rows"]:
        hooked = row["variant"] in (Variant.STAGE2.value, Variant.STAGE2_OVERLAP.value)
        early = row["launched_early"]
        assert (early is not None) == hooked, row["variant"]
        if hooked:
            assert 0.0 <= early["min"] <= early["max"] <= 1.0
            assert row["buckets"] >= 1


def test_sharded_variants_count_a_reduce_scatter_and_an_all_gather(quick):
    data, _ = quick
    by = {r["variant"]: r for r in data["rows"]}
    for v in (Variant.STAGE1, Variant.STAGE2, Variant.STAGE2_OVERLAP):
        assert by[v.value]["collectives"] >= 2, v
    # the same gradient bytes reduced, whoever does it
    assert by[Variant.STAGE1.value]["comm_bytes"] >= by[Variant.DDP_ADAM.value]["comm_bytes"] // 2


def test_bench_writes_a_png(quick):
    _, png = quick
    with open(png, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def failing_turn(rank: int, world: int) -> list[str | None]:
    """A variant that raises on rank 1 only: both ranks agree it failed, then go on."""
    broken, fine = _Slot(Variant.DROP_IN), _Slot(Variant.STAGE1)

    def boom() -> None:
        if rank == 1:
            raise RuntimeError("not ported yet")

    broken.attempt(boom)
    fine.attempt(lambda: None)
    return [broken.run.error, fine.run.error]


def test_a_variant_failing_on_one_rank_fails_on_every_rank_and_the_others_go_on():
    first, second = spawn(failing_turn, 2, backend="gloo", timeout=60.0)
    assert first == ["failed on another rank", None]
    assert second[0].startswith("RuntimeError: not ported yet")
    assert second[1] is None


def test_a_failed_variant_is_reported_with_its_error(tmp_path):
    def ok(v: Variant) -> VariantRun:
        run = VariantRun(v, parameters=10, steps=[1.0, 2.0], iterations=[3.0, 4.0])
        run.consolidate_s = None if v is Variant.DDP_ADAM else 0.5
        return run

    failed = VariantRun(Variant.DROP_IN, parameters=10, error="ImportError: not yet")
    ranks = [RankRun(r, 2, (ok(Variant.DDP_ADAM), ok(Variant.DDP_ZERO), failed)) for r in (0, 1)]
    rows = summarize(merge_run(0, ranks))
    drop_in = rows[-1]
    assert (drop_in.runs, drop_in.errors) == (0, ["ImportError: not yet"])
    assert all(s is None for s in drop_in.ratios.values())
    config = {
        "model": "tiny-mlp",
        "repeats": 1,
        "iters": 2,
        "warmup": 0,
        "variants": ["DDP_ADAM", "DDP_ZERO", "DROP_IN"],
        "bucket_numel": 1 << 21,
    }
    text = render_bench_table(rows, config)
    assert "FAILED: ImportError: not yet" in text
    assert "not measured (ImportError: not yet)" in text
    assert write_bench_png(rows, str(tmp_path / "b.png")).endswith("b.png")


def consolidated(rank: int, world: int, model: str) -> dict[str, dict | None]:
    """Two iterations of each sharded variant; rank 0's consolidated state dicts."""
    out = {}
    config = BenchConfig(model=model)
    for variant in Variant:
        if not variant.sharded_state:
            continue
        runner = _Runner(variant, config, rank)
        for i in range(2):
            runner.iteration(i)
        runner.settle()
        out[variant.value] = runner.state_dict_on_0()
    return out


@pytest.mark.parametrize("model", ["tiny-mlp", "tiny-gpt"])
def test_the_timed_consolidations_give_torch_zeros_full_adam_state_dict(model):
    """What the consolidate column times: every shardopt variant's dict equals torch's ZeRO's
    (same keys, dtypes and shapes, moments equal up to rounding), on rank 0 only."""
    first, other = spawn(consolidated, 2, model, backend="gloo", timeout=120.0)
    assert all(sd is None for sd in other.values())
    zero = first[Variant.DDP_ZERO.value]
    for variant in (Variant.DROP_IN, Variant.STAGE1, Variant.STAGE2, Variant.STAGE2_OVERLAP):
        ours = first[variant.value]
        assert list(ours["state"]) == list(zero["state"]), variant
        assert [g["params"] for g in ours["param_groups"]] == [
            g["params"] for g in zero["param_groups"]
        ]
        for key, entry in zero["state"].items():
            assert list(ours["state"][key]) == list(entry), (variant, key)
            for name, value in entry.items():
                mine, where = ours["state"][key][name], (variant, key, name)
                assert (mine.dtype, mine.shape) == (value.dtype, value.shape), where
                assert torch.allclose(mine, value, rtol=1e-5, atol=1e-8), where


def test_bench_refuses_unknown_models(tmp_path):
    with pytest.raises(ValueError, match="bench: expected models among"):
        bench(["--model", "resnet", "--out-dir", str(tmp_path)])
