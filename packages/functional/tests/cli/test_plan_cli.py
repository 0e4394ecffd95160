"""shardopt plan: predictions equal the bytes of real runs; the command's table, JSON and errors."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from importlib import metadata
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn

from shardopt.cli._cli import main
from shardopt.cli._plan_cli_predict import DDP, predict
from shardopt.cli._plan_cli_source import load_params, params_of
from shardopt.cli.measure import count_collectives, measure_ddp, measure_sharded, traffic_of
from shardopt.cli.models import PRESETS
from shardopt.core import DEFAULT_BUCKET_NUMEL, adamw, plan_partition, with_state_dtype
from shardopt.functional import RankBytes, Traffic, register_grad_hooks, shard
from shardopt.testing import spawn

BF16, F32 = torch.bfloat16, torch.float32


class Config(NamedTuple):
    """One run of the exactness test: ``shard``'s options (``state``: Adam's moments under
    ``with_state_dtype``), ``plan_partition``'s strategy and bucket_numel, and the model's
    dtype (None: MixedNet's float32 and bfloat16 layers; BF16: all of it in bfloat16)."""

    stage: int
    strategy: str
    master: torch.dtype | None
    bucket: int | None
    algorithm: str
    averaged: bool
    state: torch.dtype | None
    comm: torch.dtype | None = None
    remainders: bool = False
    model: torch.dtype | None = None


# Every kind of group, bucket, staging and collective, and bfloat16 state beside float32 and
# bfloat16 params and float32 masters. bucket_numel counts all ranks: 8 and 16 cut every group
# into several buckets (greedy ones with unequal shards), None makes one bucket per group. With
# a comm dtype: widened staging (W x the largest shard of scratch), one all-to-all per bucket
# under either algorithm, even and uneven shards, oversized buckets and single ones.
CONFIGS = [
    Config(DDP, "flat", None, None, "collective", True, None),
    Config(1, "flat", None, None, "collective", True, None),
    Config(1, "greedy", None, 8, "collective", True, BF16),
    Config(1, "flat", F32, 16, "exchange", False, None),
    Config(1, "greedy", None, 8, "exchange", False, None),
    Config(1, "flat", None, 8, "collective", False, BF16),
    Config(2, "flat", None, 16, "collective", False, None),
    Config(2, "greedy", None, None, "exchange", False, None),
    Config(2, "greedy", None, 8, "collective", False, None),
    Config(2, "flat", F32, 8, "collective", False, None),
    Config(2, "flat", F32, 8, "exchange", False, BF16),
    Config(2, "flat", None, 8, "exchange", False, None),
    # gradients on a bfloat16 wire
    Config(1, "flat", None, 16, "collective", False, None, comm=BF16),
    Config(1, "greedy", None, 8, "exchange", False, None, comm=BF16),
    Config(2, "greedy", None, 8, "collective", False, None, comm=BF16),
    Config(2, "flat", None, None, "exchange", False, None, comm=BF16),
    Config(2, "flat", F32, 8, "collective", False, BF16, comm=BF16, model=BF16),
    Config(1, "greedy", F32, 16, "exchange", False, BF16, comm=BF16, model=BF16),
]
# masters as 16-bit remainders: of the bfloat16 layer only (MixedNet), of every layer (BF16)
REMAINDERS = [
    Config(2, "flat", F32, 8, "collective", False, BF16, comm=BF16, remainders=True, model=BF16),
    Config(1, "greedy", F32, None, "exchange", False, None, remainders=True),
    Config(2, "greedy", F32, 8, "exchange", False, None, remainders=True, model=BF16),
]
CONFIGS += REMAINDERS


class MixedNet(nn.Module):
    """float32 and bfloat16 layers, interleaved, and a frozen float32 scale."""

    def __init__(self, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.first = nn.Linear(5, 7)
        self.middle = nn.Linear(7, 6).to(torch.bfloat16)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 6), requires_grad=False)
        self.last = nn.Linear(6, 3)
        if dtype is not None:  # all of it
            self.to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x.to(self.first.weight.dtype))).to(torch.bfloat16)
        h = torch.tanh(self.middle(h)).to(self.scale.dtype) * self.scale
        return self.last(h.to(self.last.weight.dtype))


def backward(model: nn.Module, rank: int) -> None:
    gen = torch.Generator().manual_seed(rank)
    model(torch.randn(4, 5, generator=gen)).square().mean().backward()


def run_config(rank: int, world: int, config: Config) -> tuple[RankBytes, Traffic, list]:
    """Two steps of ``config``; the bytes held after them and the collectives of the second."""
    stage, strategy, master, bucket, algorithm, averaged, state_dtype = config[:7]
    torch.manual_seed(0)
    model = MixedNet(config.model)
    params = [p for p in model.parameters() if p.requires_grad]
    if stage == DDP:
        opt = torch.optim.AdamW(params)
        for _ in range(2):
            opt.zero_grad()
            backward(model, rank)
            with count_collectives() as log:
                for p in params:  # what DDP's buckets do, one bucket per gradient
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            opt.step()
        return measure_ddp(model.parameters(), opt), traffic_of(log), log.others()
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    tx = adamw() if state_dtype is None else with_state_dtype(adamw(), state_dtype)
    sharded = shard(
        tx,
        plan,
        stage=stage,
        grads_averaged=averaged,
        master_dtype=master,
        algorithm=algorithm,
        comm_dtype=config.comm,
        master_remainders=config.remainders,
    )
    state = sharded.init(params)
    if not averaged:
        register_grad_hooks(params, state)
    for _ in range(2):
        for p in params:
            p.grad = None
        with count_collectives() as log:
            backward(model, rank)
            if averaged:  # what DDP does before a stage 1 step that is told so
                for p in params:
                    dist.all_reduce(p.grad)
                    p.grad.div_(world)
            state = sharded.step(params, None, state)
    return measure_sharded(model.parameters(), state), traffic_of(log), log.others()


def run_all(rank: int, world: int) -> list[tuple[RankBytes, Traffic, list]]:
    return [run_config(rank, world, config) for config in CONFIGS]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_predictions_equal_real_tensor_bytes_and_counted_collectives(world):
    results = spawn(run_all, world, backend="gloo", timeout=120.0)
    for config, *per_rank in zip(CONFIGS, *results):
        stage, strategy, master, bucket, algorithm, averaged, state_dtype = config[:7]
        params = params_of(MixedNet(config.model))
        p = predict(
            params,
            world,
            stage,
            strategy=strategy,
            master_dtype=master,
            state_dtype=state_dtype,
            bucket_numel=bucket,
            algorithm=algorithm,
            grads_averaged=averaged and stage != DDP,
            comm_dtype=config.comm,
            master_remainders=config.remainders,
        )
        for rank, (held, traffic, others) in enumerate(per_rank):
            where = f"{p.label} {config} rank {rank}"
            assert held == p.ranks[rank], where
            assert traffic == p.traffic, where
            assert others == [], where


def test_stage2_saves_gradients_and_state_but_not_traffic_against_ddp():
    params = load_params("gpt2-small")
    ddp, stage2 = (predict(params, 8, s, bucket_numel=1 << 22) for s in (DDP, 2))
    assert stage2.max_rank().optimizer * 8 < ddp.max_rank().optimizer * 1.01
    assert stage2.max_rank().grads * 8 < ddp.max_rank().grads * 1.01
    assert stage2.traffic.sent(8) == pytest.approx(ddp.traffic.sent(8), rel=1e-4)


@pytest.mark.parametrize("stage", [1, 2])
def test_staging_is_bounded_by_the_bucket_at_every_world_size(stage):
    """gpt2-xl's float32 staging, from 8 to 1024 ranks: two buffers of one bucket each. A
    bucket closes once it holds bucket_numel elements, so it has fewer than 2 * bucket_numel
    (plus the flat padding); the embedding, larger than that, is staged on its own, transiently
    (with a per-rank bucket, stage 2 held twice the full gradients at W = 1024)."""
    params = load_params("gpt2-xl")
    for w in (8, 64, 1024):
        p = predict(params, w, stage, bucket_numel=DEFAULT_BUCKET_NUMEL)
        bound = 2 * (2 * DEFAULT_BUCKET_NUMEL + w * 16) * 4
        assert 0 < p.max_rank().buffers <= bound, w


@pytest.mark.parametrize(
    ("preset", "tensors", "numel"),
    [
        ("gpt2-small", 148, 124_439_808),
        ("gpt2-xl", 580, 1_557_611_200),
        ("llama-7b", 291, 6_738_415_616),
        ("mlp-12x1024", 24, 12_595_200),
    ],
)
def test_presets_have_the_published_parameter_counts(preset, tensors, numel):
    with torch.device("meta"):
        model = PRESETS[preset]()
    params = params_of(model)
    assert (len(params), sum(p.spec.numel for p in params)) == (tensors, numel)


def test_plan_table_lists_every_stage_and_strategy_for_every_world_size(capsys):
    assert main(["plan", "gpt2-xl", "-w", "8", "1024"]) == 0
    out = capsys.readouterr().out
    assert "1,557,611,200 parameters" in out
    for w in (8, 1024):
        section = out.split(f"world size {w}\n")[1].split("\n\n")[0]
        labels = [line.split("  ")[0] for line in section.splitlines()[1:]]
        assert labels == ["DDP", "stage 1 flat", "stage 1 greedy", "stage 2 flat", "stage 2 greedy"]


def test_plan_json_holds_the_exact_bytes(capsys):
    assert (
        main(["plan", "gpt2-small", "-w", "4", "--stage", "1", "--strategy", "flat", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    (entry,) = data["results"]
    expected = predict(load_params("gpt2-small"), 4, 1, bucket_numel=DEFAULT_BUCKET_NUMEL)
    assert entry["max_rank_total"] == max(r.total for r in expected.ranks)
    assert entry["traffic"]["all_gather_bytes"] == expected.traffic.all_gather
    assert data["parameters"] == 124_439_808


def test_bfloat16_state_halves_the_moments_of_the_shardopt_rows_only(capsys):
    argv = ["plan", "gpt2-small", "-w", "4", "--stage", "0", "2", "--strategy", "flat", "--json"]
    results = []
    for extra in ([], ["--state-dtype", "bfloat16"]):
        assert main(argv + extra) == 0
        results.append(json.loads(capsys.readouterr().out)["results"])
    (ddp, wide), (ddp_again, narrow) = results
    assert ddp == ddp_again  # torch.optim's state: not ours to narrow
    # wide: 2 float32 moments per element of the 1/4 shard + a float32 count per piece; narrow:
    # the same moments in bfloat16, 2 bytes each saved
    saved = wide["max_rank_bytes"]["optimizer"] - narrow["max_rank_bytes"]["optimizer"]
    counts = narrow["max_rank_bytes"]["optimizer"] - saved
    assert saved == 2 * 2 * (124_439_808 // 4)
    assert 0 < counts < 4 * 2 * 148
    assert counts % 4 == 0


@pytest.mark.parametrize(
    ("base", "flag", "halved"),
    [
        ([], ["--comm-dtype", "bfloat16"], ("traffic", "reduce_scatter_bytes")),
        (
            ["--dtype", "bfloat16", "--master-dtype", "float32"],
            ["--master-remainders"],
            ("max_rank_bytes", "master"),
        ),
    ],
    ids=["comm-dtype-halves-gradient-traffic", "remainders-halve-master-bytes"],
)
def test_a_wire_or_remainder_flag_halves_its_bytes_in_the_shardopt_rows_only(
    base, flag, halved, capsys
):
    argv = ["plan", "gpt2-small", "-w", "4", "--stage", "0", "1", "2", "--strategy", "flat"]
    results = []
    for extra in ([], flag):
        assert main([*argv, *base, *extra, "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out)["results"])
    (ddp, *before), (ddp_again, *after) = results
    assert ddp == ddp_again  # DDP's all-reduce and torch.optim's state: unchanged
    section, key = halved
    for old, new in zip(before, after):
        assert new[section][key] * 2 == old[section][key] > 0, old["label"]
        # the parameters' gathers and the other state are as they were
        assert new["traffic"]["all_gather_bytes"] == old["traffic"]["all_gather_bytes"]
        for column in ("params", "grads", "optimizer"):
            assert new["max_rank_bytes"][column] == old["max_rank_bytes"][column], column


def test_bfloat16_everything_holds_2_plus_8_over_w_bytes_per_parameter_beside_staging(capsys):
    """bfloat16 parameters (2 bytes), and per owned element a bfloat16 gradient shard (2), two
    bfloat16 moments (2 + 2) and a 16-bit remainder of the float32 master (2)."""
    argv = ["plan", "gpt2-small", "-w", "8", "64", "--stage", "2", "--strategy", "flat"]
    flags = ["--dtype", "bfloat16", "--master-dtype", "float32", "--state-dtype", "bfloat16"]
    assert main([*argv, *flags, "--comm-dtype", "bfloat16", "--master-remainders"]) == 0
    table = capsys.readouterr().out
    params = load_params("gpt2-small", torch.bfloat16)
    for w in (8, 64):
        p = predict(
            params,
            w,
            2,
            master_dtype=F32,
            state_dtype=BF16,
            bucket_numel=DEFAULT_BUCKET_NUMEL,
            comm_dtype=BF16,
            master_remainders=True,
        )
        top = max(p.ranks, key=lambda r: r.total)
        held = (top.total - top.buffers) / 124_439_808
        assert held == pytest.approx(2 + 8 / w, rel=1e-3), w  # padding and counts aside
        row = table.split(f"world size {w}\n")[1].splitlines()[1].split()
        assert row[-4] == f"{top.total / 124_439_808:.3f}", row  # the B/param column


def test_plan_reads_a_json_of_shapes_and_a_factory(tmp_path, capsys):
    path = tmp_path / "shapes.json"
    path.write_text(json.dumps([[3, 4], [[5], "bfloat16"], {"shape": [2], "trainable": False}]))
    params = load_params(str(path))
    assert [(p.spec.shape, p.spec.dtype, p.trainable) for p in params] == [
        ((3, 4), "float32", True),
        ((5,), "bfloat16", True),
        ((2,), "float32", False),
    ]
    assert main(["plan", f"{__name__}:MixedNet", "-w", "2", "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["parameters"] == 5 * 7 + 7 + 7 * 6 + 6 + 6 + 6 * 3 + 3
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "gpt2-small", "-w", "0"], "expected world sizes in [1, 4096], got 0"),
        (["plan", "gpt2-small", "-w", "4097"], "expected world sizes in [1, 4096], got 4097"),
        (["plan", "no-such-model"], "expected a preset"),
        (["plan", "shardopt.testing:no_such_factory"], "cannot load the factory"),
        (["plan", "missing.json"], "cannot read missing.json"),
        (["plan", "gpt2-small", "--bucket-numel", "-1"], "expected --bucket-numel >= 0"),
        (
            ["plan", "gpt2-small", "--dtype", "bfloat16", "--master-remainders"],
            "expected --master-remainders with --master-dtype float32",
        ),
        (
            ["plan", "gpt2-small", "--master-dtype", "float32", "--master-remainders"],
            "expected --master-remainders with bfloat16 parameters (e.g. --dtype bfloat16), "
            "got float32",
        ),
        (
            ["plan", "gpt2-xl", "--dtype=float16", "--master-dtype=float32", "--master-remainders"],
            "expected --master-remainders with bfloat16 parameters",
        ),
        (["demo", "--backend", "nccl", "--world-size", "9999"], "expected --backend nccl only"),
    ],
)
def test_cli_reports_bad_input_on_one_line_without_a_traceback(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"shardopt {argv[0]}: error: "), err
    assert message in err, err
    assert "Traceback" not in err, err
    assert err.count("\n") == 1, err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for CPU-only torch")
def test_demo_refuses_cuda_where_torch_has_none_on_one_line(capsys):
    assert main(["demo", "--device", "cuda", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("shardopt demo: error: demo: expected --device cuda only"), err


def test_demo_without_the_demo_extra_says_what_to_install_on_one_line(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "tqdm" else real(name, *a)
    )
    assert main(["demo", "--steps", "1"]) == 2
    assert capsys.readouterr().err == (
        "shardopt demo: error: needs tqdm, the [demo] extra: "
        "pip install 'shardopt-functional[demo]'\n"
    )


def test_version_names_shardopt_and_torch(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    # the installed distribution's version: a PyPI wheel's has no local tag (2.4.1, not +cu121)
    assert capsys.readouterr().out == f"shardopt 0.1.0 (torch {metadata.version('torch')})\n"


def test_plan_finds_a_factory_in_the_current_directory(tmp_path, monkeypatch, capsys):
    (tmp_path / "cwd_model_for_plan.py").write_text(
        "import torch\n\ndef build():\n    return torch.nn.Linear(10, 4)\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["plan", "cwd_model_for_plan:build", "-w", "2", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"] == 44


def test_plan_imports_neither_pytest_nor_the_test_harness():
    code = (
        "import sys; from shardopt.cli import main; main(['plan', 'gpt2-small', '-w', '8']); "
        "print([m for m in ('pytest', 'shardopt.testing') if m in sys.modules])"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert run.stdout.strip().splitlines()[-1] == "[]", run.stdout


def test_plan_prices_a_hybrid_mesh_per_link_kind(capsys):
    assert (
        main(["plan", "gpt2-small", "--mesh", "2x4", "-w", "8", "--stage", "0", "2", "--json"]) == 0
    )
    results = json.loads(capsys.readouterr().out)["results"]
    flat = {(r["label"], r["replicas"]): r for r in results}
    hybrid, sharded = flat[("stage 2 flat", 2)], flat[("stage 2 flat", 1)]
    assert (hybrid["world_size"], sharded["world_size"]) == (4, 8)
    # the state is sharded over 4 ranks instead of 8: twice the optimizer bytes per rank
    ratio = hybrid["max_rank_bytes"]["optimizer"] / sharded["max_rank_bytes"]["optimizer"]
    assert ratio == pytest.approx(2.0, rel=1e-3)
    # across replicas: a ring all-reduce of one rank's gradient shard (1/4 of the gradients)
    grads = flat[("DDP", 2)]["max_rank_bytes"]["grads"]  # DDP holds all of them
    assert hybrid["traffic"]["sent_per_rank_to_replicas"] == pytest.approx(grads / 4, rel=1e-3)
    assert flat[("DDP", 2)]["world_size"] == 8


def test_plan_refuses_a_malformed_mesh(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "gpt2-small", "--mesh", "2x0"])
    assert "expected a mesh RxS of positive sizes, got '2x0'" in capsys.readouterr().err
