"""Muon and Adafactor sharded whole-matrix: each rank owns whole matrices of a greedy plan
balanced by cost, and the sharded run matches torch.optim.Muon / Adafactor in one process."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from shardopt.core import adafactor, muon, newton_schulz_flops, plan_partition
from shardopt.functional import register_grad_hooks, shard
from shardopt.testing import requires_torch

NEEDS_MUON = requires_torch("2.9", "torch.optim.Muon")
NEEDS_ADAFACTOR = requires_torch("2.5", "torch.optim.Adafactor")
NEEDS = {"muon": NEEDS_MUON, "adafactor": NEEDS_ADAFACTOR}
STEPS = 20
OPTIMIZERS = {
    "muon": (lambda: muon(lr=0.02), lambda ps: torch.optim.Muon(ps, lr=0.02)),
    "adafactor": (lambda: adafactor(lr=0.01), lambda ps: torch.optim.Adafactor(ps, lr=0.01)),
}


def matrices() -> nn.Module:
    """Three bias-free layers: 2-D parameters only (what torch.optim.Muon takes)."""
    torch.manual_seed(0)
    layers = [nn.Linear(6, 16, bias=False), nn.Tanh(), nn.Linear(16, 12, bias=False), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(12, 3, bias=False))


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen)


def reference(name: str, ranks: list[int]) -> list[torch.Tensor]:
    """torch.optim's optimizer in one process on the batches of ``ranks`` at once."""
    model = matrices()
    opt = OPTIMIZERS[name][1](list(model.parameters()))
    for step in range(STEPS):
        xs, ys = zip(*(batch(step, r) for r in ranks))
        nn.functional.mse_loss(model(torch.cat(xs)), torch.cat(ys)).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()]


def train(rank: int, world: int, name: str, stage: int, same_batch: bool) -> list[torch.Tensor]:
    model = matrices()
    params = list(model.parameters())
    plan = plan_partition(
        params, world, strategy="greedy", cost=lambda t: newton_schulz_flops(t.shape)
    )
    sharded = shard(OPTIMIZERS[name][0](), plan, stage=stage)
    state = sharded.init(params)
    if stage == 2:
        register_grad_hooks(params, state)
    for step in range(STEPS):
        x, y = batch(step, 0 if same_batch else rank)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS[n]) for n in sorted(OPTIMIZERS)])
@pytest.mark.parametrize(("world", "stage"), [(1, 1), (2, 1), (2, 2), (3, 2), (4, 2)])
def test_sharded_whole_matrices_match_torch_on_equal_gradients(run_world, name, world, stage):
    """Every rank has the same batch, so the averaged gradient is exactly one process's."""
    expected = reference(name, [0])
    for params in run_world(train, world, name, stage, True):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("name", "atol"),
    [
        pytest.param("muon", 1e-2, marks=NEEDS_MUON),
        pytest.param("adafactor", 1e-5, marks=NEEDS_ADAFACTOR),
    ],
)
def test_sharded_whole_matrices_match_torch_on_the_full_batch(run_world, name, atol):
    """Different batches: the average is the full batch's up to float32 rounding, which Muon's
    bfloat16 Newton-Schulz iterations turn into bfloat16 differences of its updates."""
    expected = reference(name, [0, 1])
    for params in run_world(train, 2, name, 2, False):
        for p, e in zip(params, expected):
            torch.testing.assert_close(p, e, rtol=0, atol=atol)


def refused(rank: int, world: int, strategy: str) -> str:
    model = matrices() if strategy == "flat" else with_biases()
    params = list(model.parameters())
    if strategy == "flat":
        tx, plan = muon(), plan_partition(params, world)
    else:  # Adafactor needs the biases whole too: a mixed plan that cuts them is refused
        matrix = lambda t: len(t.shape) == 2  # noqa: E731
        tx, plan = adafactor(), plan_partition(params, world, strategy="mixed", whole=matrix)
    try:
        shard(tx, plan).init(params)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.parametrize(
    ("strategy", "message"),
    [
        ("flat", "shard: expected a plan of whole tensors (strategy='greedy' or 'mixed')"),
        ("mixed", "shard: expected every tensor updated by a transformation that needs it whole "
         "to be owned whole, got tensors [1, 3] cut by the mixed plan"),
    ],
)  # fmt: skip
def test_a_plan_that_cuts_what_needs_whole_tensors_is_refused_on_every_rank(
    run_world: Any, strategy: str, message: str
) -> None:
    for got in run_world(refused, 2, strategy):
        assert got.startswith(message)


def with_biases() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def muon_and_adamw(rank: int, world: int) -> list[torch.Tensor]:
    """The recipe: Muon on the matrices, AdamW on the biases, through core's partition."""
    from shardopt.core import adamw, partition

    model = with_biases()
    params = list(model.parameters())
    tx = partition(
        {"muon": muon(lr=0.02), "adamw": adamw(lr=1e-3)},
        lambda ps: ["muon" if p.dim() == 2 else "adamw" for p in ps],
    )
    plan = plan_partition(
        params, world, strategy="greedy", cost=lambda t: newton_schulz_flops(t.shape)
    )
    sharded = shard(tx, plan, stage=2)
    state = sharded.init(params)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


@NEEDS_MUON
def test_muon_for_matrices_and_adamw_for_the_rest_matches_torchs_two_optimizers(run_world):
    model = with_biases()
    matrices_, rest = [[p for p in model.parameters() if (p.dim() == 2) == m] for m in (1, 0)]
    opts = [torch.optim.Muon(matrices_, lr=0.02), torch.optim.AdamW(rest, lr=1e-3)]
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    for _ in range(STEPS):
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for params in run_world(muon_and_adamw, 2):
        for p, e in zip(params, model.parameters()):
            torch.testing.assert_close(p, e.detach(), rtol=1e-5, atol=1e-6)


# Checkpoints in torch's format ([Note: shaped state]): Muon on matrices; Adafactor on a model
# with biases too (matrices keep row_var and col_var, vectors a variance).
CHECKPOINTED = {
    "muon": (matrices, getattr(torch.optim, "Muon", None), muon, {"lr": 0.02}),
    "adafactor": (with_biases, getattr(torch.optim, "Adafactor", None), adafactor, {"lr": 0.01}),
}
HALF = STEPS // 2


def model_batch(name: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = batch(step, 0)
    if name == "adafactor":  # with_biases takes 8 features and returns 4
        x, y = torch.cat([x, x[:, :2]], 1), torch.cat([y, y[:, :1]], 1)
    return x, y


def torch_run(name: str, steps: range, sd: dict[str, Any] | None = None) -> Any:
    """torch.optim's optimizer over ``steps`` (after loading ``sd`` if given): (params, opt)."""
    make, cls, _, hyper = CHECKPOINTED[name]
    model = make()
    if sd is not None:  # the parameters after the first half, as the sharded run has them
        for p, q in zip(model.parameters(), torch_run(name, range(HALF))[0]):
            p.data.copy_(q)
    opt = cls(list(model.parameters()), **hyper)
    if sd is not None:
        opt.load_state_dict(sd)
    for step in steps:
        nn.functional.mse_loss(
            model(model_batch(name, step)[0]), model_batch(name, step)[1]
        ).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in model.parameters()], opt


def checkpointed(rank: int, world: int, name: str, stage: int) -> Any:
    """HALF steps sharded, consolidated on rank 0; then a fresh sharded state loaded from torch's
    dict of the same HALF steps runs the rest: (consolidated dict or None, final params)."""
    from shardopt.functional import consolidate_state_dict, load_torch_state_dict, torch_hyperparams

    make, cls, factory, hyper = CHECKPOINTED[name]
    out = []
    for loaded in (False, True):
        model = make()
        params = list(model.parameters())
        if loaded:
            for p, q in zip(params, torch_run(name, range(HALF))[0]):
                p.data.copy_(q)
        plan = plan_partition(
            params, world, strategy="greedy", cost=lambda t: newton_schulz_flops(t.shape)
        )
        sharded = shard(factory(**hyper), plan, stage=stage)
        state = sharded.init(params)
        if loaded:
            load_torch_state_dict(state, torch_run(name, range(HALF))[1].state_dict())
        if stage == 2:
            register_grad_hooks(params, state)
        for step in range(HALF, STEPS) if loaded else range(HALF):
            x, y = model_batch(name, step)
            nn.functional.mse_loss(model(x), y).backward()
            state = sharded.step(params, None, state)
            model.zero_grad()
        if loaded:
            out.append([p.detach() for p in params])
        else:
            out.append(consolidate_state_dict(state, torch_hyperparams(cls, **hyper)))
    return out


@pytest.mark.parametrize("name", [pytest.param(n, marks=NEEDS[n]) for n in sorted(CHECKPOINTED)])
@pytest.mark.parametrize(("world", "stage"), [(1, 1), (2, 1), (2, 2), (3, 1), (4, 2)])
def test_whole_matrix_state_consolidates_to_torchs_dict_and_loads_back(
    run_world, name, world, stage
):
    expected = torch_run(name, range(HALF))[1].state_dict()
    final = torch_run(name, range(STEPS))[0]
    results = run_world(checkpointed, world, name, stage)
    assert [sd is None for sd, _ in results] == [False] + [True] * (world - 1)
    sd = results[0][0]
    assert sd["param_groups"] == expected["param_groups"]
    assert list(sd["state"]) == list(expected["state"])
    for index, entry in expected["state"].items():
        assert list(sd["state"][index]) == list(entry)  # torch's keys in torch's order
        for key, value in entry.items():
            torch.testing.assert_close(sd["state"][index][key], value, rtol=1e-5, atol=1e-6)
    resumed = torch_run(name, range(HALF, STEPS), sd)[0]  # torch continues from our dict
    for _, params in results:
        for p, q, e in zip(params, resumed, final):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(q, e, rtol=1e-5, atol=1e-6)


def dcp_run(rank: int, world: int, path: str, save: bool) -> list[torch.Tensor] | None:
    """Adafactor, stage 2: the first HALF steps saved with DCP, or the rest after loading them
    (the parameters from torch's run, as a model checkpoint would bring them)."""
    from shardopt.functional import load_checkpoint, save_checkpoint

    model = with_biases()
    params = list(model.parameters())
    if not save:
        for p, q in zip(params, torch_run("adafactor", range(HALF))[0]):
            p.data.copy_(q)
    sharded = shard(adafactor(lr=0.01), plan_partition(params, world, strategy="greedy"), stage=2)
    state = sharded.init(params)
    if not save:
        load_checkpoint(state, path)
    register_grad_hooks(params, state)
    for step in range(HALF) if save else range(HALF, STEPS):
        x, y = model_batch("adafactor", step)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    if save:
        save_checkpoint(state, path)
        return None
    return [p.detach() for p in params]


@NEEDS_ADAFACTOR
@pytest.mark.parametrize(("saved", "loaded"), [(4, 2), (1, 3)])
def test_adafactors_factored_state_reshards_through_dcp(run_world, tmp_path, saved, loaded):
    path = str(tmp_path / "ckpt")
    run_world(dcp_run, saved, path, True)
    final = torch_run("adafactor", range(STEPS))[0]
    for params in run_world(dcp_run, loaded, path, False):
        for p, e in zip(params, final):
            torch.testing.assert_close(p, e, rtol=1e-5, atol=1e-6)


# A mixed plan: the hidden matrices whole (Muon), the rest cut like a flat plan (AdamW), one
# plan and one schedule. The embedding is a matrix too, but AdamW's: labels are resolved on the
# whole tensors, so the recipe labels it by name (here by shape, which names it).
class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh())
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.hidden(self.embed(x).mean(1)))


HIDDEN = {(16, 8), (8, 16)}  # the hidden matrices' shapes (the Tagger's shapes are distinct)


def is_hidden(name: str, p: torch.Tensor) -> bool:
    return name.startswith("hidden") and p.dim() == 2


def tagger_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(step)
    return torch.randint(0, 11, (16, 5), generator=gen), torch.randn(16, 3, generator=gen)


def tagger_plan(model: Tagger, world: int) -> Any:
    """A mixed plan of the Tagger: its hidden matrices whole (balanced by Newton-Schulz flops),
    the rest cut (the Tagger's shapes are distinct, so a shape names its parameter)."""
    named = list(model.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    whole = [is_hidden(n, p) for n, p in named]
    plan = plan_partition(
        [p for _, p in named],
        world,
        strategy="mixed",
        whole=lambda t: whole[shapes.index(tuple(t.shape))],
        cost=lambda t: newton_schulz_flops(t.shape),
    )
    assert [plan.is_whole(t) for t in range(len(named))] == whole
    return plan


def mixed_recipe(rank: int, world: int, stage: int) -> list[torch.Tensor]:
    from shardopt.core import adamw, partition

    model = Tagger()
    params = list(model.parameters())
    tx = partition(
        {"muon": muon(lr=0.02), "adamw": adamw(lr=1e-2)},
        lambda ps: ["muon" if tuple(p.shape) in HIDDEN else "adamw" for p in ps],
    )
    plan = tagger_plan(model, world)
    sharded = shard(tx, plan, stage=stage)
    state = sharded.init(params)
    if stage == 2:
        register_grad_hooks(params, state)
    for step in range(STEPS):
        x, y = tagger_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return [p.detach() for p in params]


@NEEDS_MUON
@pytest.mark.parametrize(("world", "stage"), [(1, 1), (2, 1), (2, 2), (3, 2), (4, 1), (4, 2)])
def test_a_mixed_plan_runs_muon_on_whole_matrices_and_adamw_on_cut_tensors_like_torch(
    run_world, world, stage
):
    model = Tagger()
    named = list(model.named_parameters())
    matrices_ = [p for n, p in named if is_hidden(n, p)]
    rest = [p for n, p in named if not is_hidden(n, p)]
    opts = [torch.optim.Muon(matrices_, lr=0.02), torch.optim.AdamW(rest, lr=1e-2)]
    for step in range(STEPS):
        x, y = tagger_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for params in run_world(mixed_recipe, world, stage):
        for p, e in zip(params, model.parameters()):
            torch.testing.assert_close(p, e.detach(), rtol=1e-5, atol=1e-6)


def adamw_on_a_mixed_plan(rank: int, world: int) -> tuple[list[torch.Tensor], Any]:
    """An elementwise optimizer on a mixed plan: whole and cut pieces alike to it."""
    from shardopt.core import adamw
    from shardopt.functional import consolidate_state_dict, torch_hyperparams

    model = Tagger()
    params = list(model.parameters())
    sharded = shard(adamw(lr=1e-2), tagger_plan(model, world), stage=2)
    state = sharded.init(params)
    register_grad_hooks(params, state)
    for step in range(HALF):
        x, y = tagger_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    sd = consolidate_state_dict(state, torch_hyperparams(torch.optim.AdamW, lr=1e-2))
    return [p.detach() for p in params], sd


@pytest.mark.parametrize("world", [2, 3])
def test_adamw_on_a_mixed_plan_matches_torch_and_consolidates_to_its_dict(run_world, world):
    model = Tagger()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(HALF):
        x, y = tagger_batch(step)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    results = run_world(adamw_on_a_mixed_plan, world)
    expected = opt.state_dict()
    sd = results[0][1]
    assert list(sd["state"]) == list(expected["state"])
    for i, entry in expected["state"].items():
        for key, value in entry.items():
            torch.testing.assert_close(sd["state"][i][key], value, rtol=1e-5, atol=1e-6)
    for params, _ in results:
        for p, e in zip(params, model.parameters()):
            torch.testing.assert_close(p, e.detach(), rtol=1e-5, atol=1e-6)


def bf16_adafactor(rank: int, world: int, sd: Any) -> Any:
    """Adafactor with bfloat16 state on a greedy plan: 3 steps consolidated, or ``sd`` loaded
    into a fresh state and consolidated back."""
    from shardopt.core import with_state_dtype
    from shardopt.functional import consolidate_state_dict, load_torch_state_dict

    model = with_biases()
    params = list(model.parameters())
    tx = with_state_dtype(adafactor(lr=0.01), torch.bfloat16)
    sharded = shard(tx, plan_partition(params, world, strategy="greedy"))
    state = sharded.init(params)
    if sd is not None:
        load_torch_state_dict(state, sd)
    for step in range(3) if sd is None else ():
        x, y = model_batch("adafactor", step)
        nn.functional.mse_loss(model(x), y).backward()
        state = sharded.step(params, None, state)
        model.zero_grad()
    return consolidate_state_dict(state)


@NEEDS_ADAFACTOR
def test_bfloat16_factored_state_consolidates_in_bfloat16_at_any_world_size(run_world):
    """The dtypes of shaped state travel with it ([Note: shaped state]): W = 1 and W = 3 give the
    same dict bitwise, in bfloat16, and a dict loaded at W = 2 consolidates back unchanged."""
    one = run_world(bf16_adafactor, 1, None)[0]
    three = run_world(bf16_adafactor, 3, None)[0]
    back = run_world(bf16_adafactor, 2, one)[0]
    dtypes = {k: v.dtype for e in one["state"].values() for k, v in e.items()}
    assert dtypes == {
        "step": torch.float32,
        "row_var": torch.bfloat16,
        "col_var": torch.bfloat16,
        "variance": torch.bfloat16,
    }
    for other in (three, back):
        assert list(other["state"]) == list(one["state"])
        for i, entry in one["state"].items():
            assert list(other["state"][i]) == list(entry)
            for key, value in entry.items():
                assert other["state"][i][key].dtype == value.dtype
                assert torch.equal(other["state"][i][key], value), (i, key)
