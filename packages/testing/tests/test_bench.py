"""shardopt bench --quick: every variant runs, the counts match plan's, the outputs are written."""

from __future__ import annotations

import json

import pytest
import torch

from shardopt.functional import DEFAULT_BUCKET_NUMEL
from shardopt.testing import spawn
from shardopt.testing._bench_run import MODELS, BenchConfig, Variant, _Runner
from shardopt.testing._cli import main
from shardopt.testing._plan_cli_cost import Setup, predict
from shardopt.testing._plan_cli_source import params_of


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, str, str]:
    out = tmp_path_factory.mktemp("bench")
    assert main(["bench", "--quick", "--world-size", "2", "--out-dir", str(out)]) == 0
    with open(out / "bench.json", encoding="utf-8") as file:
        return json.load(file), str(out / "bench.png"), str(out)


def test_bench_quick_runs_every_variant_on_every_quick_model(quick):
    data, _, _ = quick
    rows = data["rows"]
    assert [(r["model"], r["variant"]) for r in rows] == [
        (m, v.value) for m in ("tiny-mlp", "tiny-gpt") for v in Variant
    ]
    for r in rows:
        assert r["world_size"] == 2
        assert 0 < r["step_s"] <= r["iteration_s"]
        assert r["peak_bytes"] > 0
        assert (r["consolidate_s"] is None) == (r["variant"] == Variant.DDP_ADAM.value)
    assert data["machine"]["torch"] == torch.__version__


@pytest.mark.parametrize("setup", [Setup.DDP, Setup.STAGE1, Setup.STAGE2])
def test_bench_counted_bytes_equal_plans_prediction(quick, setup):
    data, _, _ = quick
    variant = {
        Setup.DDP: Variant.DDP_ADAM,
        Setup.STAGE1: Variant.STAGE1,
        Setup.STAGE2: Variant.STAGE2,
    }[setup]
    for r in data["rows"]:
        if r["variant"] != variant.value:
            continue
        with torch.device("meta"):
            params = params_of(MODELS[r["model"]].build())
        # shard() picks broadcasts and reduces for CPU tensors on gloo
        p = predict(params, 2, setup, bucket_numel=DEFAULT_BUCKET_NUMEL, algorithm="rooted")
        assert r["comm_bytes"] == p.traffic.sent(2), r["model"]
        held = max(rank.total for rank in p.ranks)
        assert r["peak_bytes"] >= held, r["model"]  # the peak holds at least what stays


def consolidated(rank: int, world: int, model: str) -> dict[str, dict | None]:
    """Two iterations of each variant with a sharded state; rank 0's consolidated state dicts."""
    out = {}
    for variant in (Variant.DDP_ZERO, Variant.STAGE1, Variant.STAGE2):
        runner = _Runner(model, variant, BenchConfig(models=(model,)), rank)
        for i in range(2):
            runner.forward_backward(i)
            runner.step()
        out[variant.value] = runner.state_dict_on_0()
    return out


@pytest.mark.parametrize("model", ["tiny-mlp", "tiny-gpt"])
def test_the_timed_consolidations_give_torch_zeros_full_adam_state_dict(model):
    """What the consolidate column times: shardopt's dict equals torch's ZeRO's (same keys,
    dtypes and shapes, moments equal up to rounding), on rank 0 only."""
    first, other = spawn(consolidated, 2, model, backend="gloo", timeout=120.0)
    assert all(sd is None for sd in other.values())
    zero = first[Variant.DDP_ZERO.value]
    for variant in (Variant.STAGE1, Variant.STAGE2):
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


def test_bench_writes_a_png(quick):
    _, png, _ = quick
    with open(png, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_bench_refuses_unknown_models(tmp_path, capsys):
    assert main(["bench", "--models", "resnet", "--out-dir", str(tmp_path)]) == 2
    assert "bench: expected models among" in capsys.readouterr().err
