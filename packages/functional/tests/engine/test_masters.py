"""Master weights kept as bfloat16 parameters plus 16-bit remainders (``master_remainders``):
exact against float32 masters in training, half their bytes, float32 in every checkpoint."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardopt.cli.measure import storage_bytes
from shardopt.core import adamw, muon, newton_schulz_flops, partition, plan_partition, sgd
from shardopt.functional import (
    consolidate_state_dict,
    load_checkpoint,
    load_sharded_state_dict,
    load_torch_state_dict,
    save_checkpoint,
    shard,
    sharded_state_dict,
)
from shardopt.functional.engine import _masters as masters_module
from shardopt.functional.engine._masters import join_remainder, split_remainder

from _functional_helpers import small_mlp

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
TIE = 0x8000


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int32) if x.dtype == F32 else x.view(torch.int16)


def low16(x: torch.Tensor) -> torch.Tensor:
    return bits(x) & 0xFFFF


# -- split and join -------------------------------------------------------------------------


def patterns(case: str) -> torch.Tensor:
    """float32 bit patterns (as int32) of one edge case."""
    gen = torch.Generator().manual_seed(7)
    random = torch.randint(-(2**31), 2**31 - 1, (4096,), generator=gen, dtype=torch.int64)
    high = random & ~0xFFFF
    special = [
        0, -(2**31), 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFF7FFF,
        0x7FFF8000, 0x7FFFFFFF, 0xFFFF8000, 0xFFFFFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x00000001,
        0x807FFFFF, 0x00008000, 0x80008000, 0x3F808000, 0x3F818000, 0x7F7F8000,
    ]  # fmt: skip
    table = {
        "random bits": random,
        "ties 0x8000": high | 0x8000,
        "below ties 0x7FFF": high | 0x7FFF,
        "above ties 0x8001": high | 0x8001,
        "subnormals": random & 0x807FFFFF,
        "specials": torch.tensor(special, dtype=torch.int64),
    }
    return table[case].to(torch.int32)  # wraps to the int32 pattern


CASES = ["random bits", "ties 0x8000", "below ties 0x7FFF", "above ties 0x8001", "subnormals"]


@pytest.mark.parametrize("case", [*CASES, "specials"])
def test_join_of_split_gives_back_every_float32_bit_pattern(case):
    x = patterns(case).view(F32)
    hi, lo = split_remainder(x)
    assert hi.dtype == BF16
    assert lo.dtype == torch.int16
    assert torch.equal(bits(join_remainder(hi, lo)), bits(x))


@pytest.mark.parametrize("case", [*CASES, "specials"])
def test_the_bfloat16_half_is_torchs_rounding_but_at_ties_where_it_rounds_away_from_zero(case):
    x = patterns(case).view(F32)
    hi, _ = split_remainder(x)
    ties, nan = low16(x) == TIE, x.isnan()
    ordinary = ~ties & ~nan
    assert torch.equal(bits(hi)[ordinary], bits(x.to(BF16))[ordinary])
    away = (bits(x)[ties & ~nan] >> 16) + 1  # one more unit of magnitude (sign and magnitude)
    assert torch.equal(bits(hi)[ties & ~nan].to(torch.int32), away.to(torch.int16).to(torch.int32))
    magnitude = bits(x) & 0x7FFFFFFF  # the nans whose hi is no nan: see the note
    huge, low_payload = magnitude >= 0x7FFF8000, magnitude < 0x7F808000
    assert hi[nan & ~huge & ~low_payload].isnan().all()
    assert (hi[nan & huge] == 0).all()
    assert hi[nan & low_payload].isinf().all()


def test_ties_under_round_to_even_differ_only_where_bit_16_is_zero():
    x = patterns("ties 0x8000").view(F32)
    finite = x.isfinite() & x.to(BF16).isfinite()
    differ = bits(split_remainder(x)[0]) != bits(x.to(BF16))
    even = (bits(x) & 0x10000) == 0
    assert torch.equal(differ[finite], even[finite])
    assert even[finite].any()
    assert (~even[finite]).any()


def test_split_of_join_gives_back_every_pair_so_untouched_elements_write_back_unchanged():
    gen = torch.Generator().manual_seed(3)
    hi = torch.randint(-(2**15), 2**15, (1 << 16,), generator=gen, dtype=torch.int16)
    lo = torch.randint(-(2**15), 2**15, (1 << 16,), generator=gen, dtype=torch.int16)
    out_hi, out_lo = torch.empty_like(hi).view(BF16), torch.empty_like(lo)
    split_remainder(join_remainder(hi.view(BF16), lo), out_hi, out_lo)
    assert torch.equal(out_hi.view(torch.int16), hi)
    assert torch.equal(out_lo, lo)


@pytest.mark.parametrize("case", CASES)
def test_windows_cut_anywhere_give_the_bits_of_one_pass(case, monkeypatch):
    x = patterns(case).view(F32)
    whole_hi, whole_lo = split_remainder(x)
    monkeypatch.setattr(masters_module, "_CPU_WINDOW", 1000)  # 4096 = 4 windows + 96
    hi, lo = split_remainder(x)
    assert torch.equal(bits(hi), bits(whole_hi))
    assert torch.equal(lo, whole_lo)
    assert torch.equal(bits(join_remainder(hi, lo)), bits(x))


# -- training -------------------------------------------------------------------------------


def model_params() -> list[torch.Tensor]:
    """small_mlp in bfloat16, plus a float16 and a float32 tensor (their own plan groups)."""
    params = [p.detach().to(BF16) for p in small_mlp().parameters()]
    gen = torch.Generator().manual_seed(1)
    return [*params, torch.randn(9, generator=gen).to(F16), torch.randn(5, generator=gen)]


def transformation(name: str) -> Any:
    if name == "adamw":
        return adamw(1e-2)
    if name == "sgd momentum":
        return sgd(0.05, momentum=0.9)
    return partition(  # Muon on the matrices (whole: update_whole_), AdamW on the rest
        {"muon": muon(lr=0.02), "adamw": adamw(1e-2)},
        lambda ps: ["muon" if p.dim() == 2 else "adamw" for p in ps],
    )


def plan_for(name: str, params: list[torch.Tensor], world: int, bucket: int | None) -> Any:
    if name == "muon":
        cost = lambda t: newton_schulz_flops(t.shape)  # noqa: E731
        return plan_partition(params, world, strategy="greedy", cost=cost, bucket_numel=bucket)
    return plan_partition(params, world, bucket_numel=bucket)


def step_grads(step: int, rank: int, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Fixed gradients of ``step`` on ``rank``, in the parameters' dtypes (not their values)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    return [torch.randn(p.shape, generator=gen).to(p.dtype) for p in params]


def trained(
    name: str, stage: int, bucket: int | None, world: int, rank: int, remainders: bool, steps: int
) -> tuple[list[torch.Tensor], Any]:
    params = model_params()
    sharded = shard(
        transformation(name),
        plan_for(name, params, world, bucket),
        stage=stage,
        master_dtype=F32,
        master_remainders=remainders,
    )
    state = sharded.init(params)
    for step in range(steps):
        state = sharded.step(params, step_grads(step, rank, params), state)
    return params, state


def compare_training(
    rank: int, world: int, name: str, stage: int, bucket: int | None
) -> dict[str, Any]:
    """Both runs on the same gradients; what the test asserts, per rank."""
    params_r, state_r = trained(name, stage, bucket, world, rank, True, 5)
    _params_f, state_f = trained(name, stage, bucket, world, rank, False, 5)
    param_buffers = state_r.param_buffers
    groups = range(len(param_buffers.buffers))
    masters = [state_r.master.full(g) for g in groups]
    floats = [state_f.master.full(g) for g in groups]
    owned = [param_buffers.copy_shard_out(g) for g in groups]
    owned_f = [state_f.param_buffers.copy_shard_out(g) for g in groups]
    bf16 = [g for g in groups if param_buffers.buffers[g].dtype == BF16]
    f16 = [g for g in groups if param_buffers.buffers[g].dtype == F16]
    return {
        "stored": [None if m is None else m.dtype for m in state_r.master],
        "dtypes": [b.dtype for b in param_buffers.buffers],
        "masters equal": all(
            (a is None and b is None) or torch.equal(bits(a), bits(b))
            for a, b in zip(masters, floats)
        ),
        "params are the away rounding": all(
            torch.equal(bits(owned[g]), bits(split_remainder(floats[g])[0])) for g in bf16
        ),
        "differ only at ties": all(
            bool((low16(floats[g])[bits(owned[g]) != bits(owned_f[g])] == TIE).all()) for g in bf16
        ),
        "other groups equal": all(
            torch.equal(owned[g], owned_f[g]) for g in groups if g not in bf16
        ),
        "buffers": [b.clone() for b in param_buffers.buffers],
        "moved": any(not torch.equal(p, q) for p, q in zip(params_r, model_params())),
        "bytes": (storage_bytes(state_r.master.stored), storage_bytes(state_f.master.stored)),
        "owned": (sum(owned[g].numel() for g in bf16), sum(owned[g].numel() for g in f16)),
    }


# (optimizer, stage, bucket_numel) per world size: a table, not a product; small buckets make
# several per group, so the update runs bucket by bucket (Muon: whole, all buckets at once)
TRAINING = {
    1: [("adamw", 1, None)],
    2: [("adamw", 2, 64), ("sgd momentum", 1, 32), ("muon", 2, None)],
    3: [("adamw", 1, 48), ("sgd momentum", 2, None)],
}


def compare_all(rank: int, world: int) -> list[dict[str, Any]]:
    return [compare_training(rank, world, *case) for case in TRAINING[world]]


@pytest.mark.parametrize("world", sorted(TRAINING))
def test_remainder_masters_equal_float32_masters_bitwise_after_5_steps_in_half_the_bytes(
    run_world, world
):
    """Per case: the reconstructed masters equal the float32 masters bitwise, the bfloat16
    parameters are those masters rounded (away at ties, so equal to the float32 path's but at
    ties), the same on every rank, and the remainders hold 2 bytes per owned element."""
    per_rank = run_world(compare_all, world)
    expected = {BF16: torch.int16, F16: F32, F32: None}  # float16 keeps float32 masters
    for i, case in enumerate(TRAINING[world]):
        rows = [cases[i] for cases in per_rank]
        for rank, out in enumerate(rows):
            where = f"{case}, rank {rank}"
            assert out["moved"], f"{where}: the parameters did not train"
            assert out["masters equal"], f"{where}: the reconstructed masters differ"
            assert out["other groups equal"], f"{where}: a float16 or float32 group differs"
            assert out["params are the away rounding"], where
            assert out["differ only at ties"], where
            assert all(torch.equal(a, b) for a, b in zip(out["buffers"], rows[0]["buffers"]))
            assert out["stored"] == [expected[d] for d in out["dtypes"]], where
            (with_rem, with_f32), (n_bf16, n_f16) = out["bytes"], out["owned"]
            assert with_rem == 2 * n_bf16 + 4 * n_f16, where
            assert with_f32 == 4 * n_bf16 + 4 * n_f16, where
        assert sum(out["owned"][0] for out in rows) >= sum(
            p.numel() for p in model_params()[:6]
        )  # the bfloat16 elements are all owned somewhere (with padding)


# -- checkpoints ----------------------------------------------------------------------------

NAMES = [f"p{i}" for i in range(8)]


def owned_masters(state: Any) -> list[tuple[int, int, torch.Tensor]]:
    """(plan tensor, first element, float32 masters) of each of this rank's pieces."""
    out = []
    for p in state.param_buffers.pieces:
        full = state.master.full(p.group)
        if full is not None:
            out.append((p.tensor, p.start, full[p.offset : p.offset + p.numel].clone()))
    return out


def fresh(world: int, remainders: bool, bucket: int | None) -> tuple[Any, list[torch.Tensor], Any]:
    params = [torch.zeros_like(p) for p in model_params()]
    plan = plan_partition(params, world, bucket_numel=bucket)
    sharded = shard(adamw(1e-2), plan, master_dtype=F32, master_remainders=remainders)
    return sharded, params, sharded.init(params)


def save_both(rank: int, world: int, root: str) -> dict[bool, Any]:
    """Saves a remainder run and a float32 run (3 steps, the same gradients); their masters."""
    out = {}
    for remainders in (True, False):
        params, state = trained("adamw", 1, 40, world, rank, remainders, 3)
        path = os.path.join(root, f"remainders={remainders}")
        save_checkpoint(state, path, names=NAMES, extra={"model": dict(zip(NAMES, params))})
        out[remainders] = owned_masters(state)
    return out


def load_each(rank: int, world: int, root: str) -> dict[tuple[bool, bool], Any]:
    """Each checkpoint into a fresh remainder state and float32 state: (their masters, whether
    the owned bfloat16 parameters are the masters' bfloat16 halves)."""
    out = {}
    for saved in (True, False):
        for remainders in (True, False):
            _, params, state = fresh(world, remainders, None)
            path = os.path.join(root, f"remainders={saved}")
            load_checkpoint(state, path, names=NAMES, extra={"model": dict(zip(NAMES, params))})
            param_buffers = state.param_buffers
            halves = all(
                torch.equal(bits(param_buffers.copy_shard_out(g)), bits(split_remainder(full)[0]))
                for g in range(len(param_buffers.buffers))
                if (full := state.master.full(g)) is not None
                and param_buffers.buffers[g].dtype == BF16
            )
            out[(saved, remainders)] = (owned_masters(state), halves or not remainders)
    return out


def assembled(rows: list[list[tuple[int, int, torch.Tensor]]]) -> dict[tuple[int, int], int]:
    """Each (tensor, element)'s float32 master bits, from every rank's pieces."""
    out = {}
    for row in rows:
        for t, start, values in row:
            for i, v in enumerate(bits(values).tolist()):
                out[(t, start + i)] = v
    return out


def test_checkpoints_saved_at_2_ranks_load_at_3_with_the_same_float32_masters_bitwise(
    run_world, tmp_path
):
    """Saved with or without remainders, loaded with or without: the same float32 masters."""
    at_2 = run_world(save_both, 2, str(tmp_path))
    at_3 = run_world(load_each, 3, str(tmp_path))
    saved = {r: assembled([row[r] for row in at_2]) for r in (True, False)}
    assert len(saved[True]) == sum(p.numel() for p in model_params()[:7])  # bf16 and f16
    assert saved[True] == saved[False]
    for (with_saved, with_loaded), _ in at_3[0].items():
        where = f"saved with remainders={with_saved}, loaded with {with_loaded}"
        got = assembled([row[(with_saved, with_loaded)][0] for row in at_3])
        assert got == saved[with_saved], where
        assert all(row[(with_saved, with_loaded)][1] for row in at_3), where


def state_dicts(rank: int, world: int) -> dict[str, Any]:
    """A remainder state's sharded state dict into a fresh state; then a torch state dict
    into the trained state itself."""
    _, state = trained("adamw", 1, 40, world, rank, True, 3)
    sd = sharded_state_dict(state)
    _, _, loaded = fresh(world, True, 40)
    masters = [None if m is None else m.clone() for m in sd["master"]]
    load_sharded_state_dict(loaded, {**sd, "master": masters})
    stored = [(a, b) for a, b in zip(loaded.master, state.master) if a is not None]
    out = {
        "sd dtypes": [None if m is None else m.dtype for m in sd["master"]],
        "sd masters": assembled([owned_masters(loaded)]) == assembled([owned_masters(state)]),
        "sd stored": all(torch.equal(a, b) for a, b in stored),
        "remainders before": any(bool((m != 0).any()) for m in state.master.stored[:1]),
    }
    torch_sd = consolidate_state_dict(state)
    dist.broadcast_object_list(box := [torch_sd], src=0)
    load_torch_state_dict(state, box[0])
    param_buffers = state.param_buffers
    out["remainders after"] = any(bool((m != 0).any()) for m in state.master.stored[:1])
    out["masters are params"] = all(
        torch.equal(state.master.full(g), param_buffers.copy_shard_out(g).float())
        for g in range(2)  # the bfloat16 and float16 groups
    )
    return out


@pytest.fixture(scope="module")
def dicts() -> list[dict[str, Any]]:
    from shardopt.testing import spawn

    return spawn(state_dicts, 2, backend="gloo", timeout=120.0)


def test_a_sharded_state_dict_gives_float32_masters_and_loads_them_back_exactly(dicts):
    for row in dicts:
        assert row["sd dtypes"] == [F32, F32, None]  # bfloat16, float16, float32 groups
        assert row["sd masters"]
        assert row["sd stored"]


def test_a_torch_state_dict_load_restarts_the_masters_from_the_parameters(dicts):
    for row in dicts:
        assert row["remainders before"]
        assert not row["remainders after"]
        assert row["masters are params"]


# -- errors ---------------------------------------------------------------------------------

ERRORS = [
    ({"master_remainders": True}, "master_dtype=torch.float32 with master_remainders=True"),
    ({"master_remainders": True, "master_dtype": torch.float64}, "got master_dtype=torch.float64"),
    ({"master_remainders": 1, "master_dtype": F32}, "master_remainders a bool, got 1"),
]


def shard_errors(rank: int, world: int) -> list[str]:
    params = model_params()
    out = []
    for kwargs, _ in ERRORS:
        try:
            shard(adamw(), plan_partition(params, world), **kwargs)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
    return out


def test_master_remainders_without_float32_masters_raises_on_every_rank_naming_shard(run_world):
    for messages in run_world(shard_errors, 2):
        for (_, words), message in zip(ERRORS, messages):
            assert message.startswith("shard: expected"), message
            assert words in message, message
