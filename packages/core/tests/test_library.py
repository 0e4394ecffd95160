"""The optax-style library of shardopt.core in one process: kinds, hand-computed values, the
moment helpers, and every elementwise or per-tensor transformation run on 1-D pieces of its
tensors under a scope (as ``shard`` gives them on a flat plan) equal to the same run on whole
tensors. Parity with optax itself: packages/functional/tests/integration/test_optax_parity.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import torch

import shardopt.core as so
from shardopt.core import apply_updates
from shardopt.core.blocks import (
    Kind,
    Scope,
    bias_correction,
    in_scope,
    kind_of,
    update_moment,
    update_moment_per_elem_norm,
)

E, PT, WT, SH = Kind.ELEMENTWISE, Kind.PER_TENSOR, Kind.WHOLE_TREE, Kind.SHAPED

KINDS: dict[str, tuple[Callable[[], Any], Kind]] = {
    # the new library
    "lion": (lambda: so.lion(1e-3), E),
    "lamb": (lambda: so.lamb(1e-3), PT),
    "lars": (lambda: so.lars(1e-3), PT),
    "adabelief": (lambda: so.adabelief(1e-3), E),
    "yogi": (lambda: so.yogi(1e-3), E),
    "novograd": (lambda: so.novograd(1e-3), PT),
    "adan": (lambda: so.adan(1e-3), E),
    "lookahead": (lambda: so.lookahead(so.adam(1e-3), 5, 0.5), E),
    "lookahead_of_lamb": (lambda: so.lookahead(so.lamb(1e-3), 5, 0.5), PT),
    "sign_sgd": (lambda: so.sign_sgd(1e-3), E),
    "signum": (lambda: so.signum(1e-3), E),
    "ademamix": (lambda: so.ademamix(1e-3), E),
    "adopt": (lambda: so.adopt(1e-3), E),
    "schedule_free_adamw": (lambda: so.schedule_free_adamw(), E),
    "scale_by_trust_ratio": (lambda: so.scale_by_trust_ratio(), PT),
    "clip_by_block_rms": (lambda: so.clip_by_block_rms(1.0), PT),
    "adaptive_grad_clip": (lambda: so.adaptive_grad_clip(0.01), PT),
    "adaptive_grad_clip_axis": (lambda: so.adaptive_grad_clip(0.01, axis=1), SH),
    "centralize": (lambda: so.centralize(), SH),
    "ema": (lambda: so.ema(0.9), E),
    "apply_if_finite": (lambda: so.apply_if_finite(so.adam(1e-3), 3), WT),
    "apply_if_finite_of_lamb": (lambda: so.apply_if_finite(so.lamb(1e-3), 3), WT | PT),
    "zero_nans": (lambda: so.zero_nans(), PT),
    "add_noise": (lambda: so.add_noise(0.01, 0.55), SH),
    # core's earlier factories
    "adam": (lambda: so.adam(1e-3), E),
    "adamw": (lambda: so.adamw(1e-3), E),
    "sgd": (lambda: so.sgd(0.1, momentum=0.9), E),
    "rmsprop": (lambda: so.rmsprop(1e-3), E),
    "adagrad": (lambda: so.adagrad(1e-2), E),
    "adamax": (lambda: so.adamax(1e-3), E),
    "nadam": (lambda: so.nadam(1e-3), E),
    "radam": (lambda: so.radam(1e-3), E),
    "adadelta": (lambda: so.adadelta(), E),
    "rprop": (lambda: so.rprop(), E),
    "asgd": (lambda: so.asgd(), E),
    "scale": (lambda: so.scale(0.5), E),
    "scale_by_learning_rate": (lambda: so.scale_by_learning_rate(0.1), E),
    "add_decayed_weights": (lambda: so.add_decayed_weights(0.1), E),
    "add_decoupled_weight_decay": (lambda: so.add_decoupled_weight_decay(0.1, 0.1), E),
    "trace": (lambda: so.trace(0.9), E),
    "scale_by_adam": (lambda: so.scale_by_adam(), E),
    "scale_by_adagrad": (lambda: so.scale_by_adagrad(), E),
    "scale_by_rprop": (lambda: so.scale_by_rprop(), E),
    "step_by_learning_rate": (lambda: so.step_by_learning_rate(0.1), E),
    "muon": (lambda: so.muon(), SH),
    "adafactor": (lambda: so.adafactor(), SH),
}


@pytest.mark.parametrize("name", sorted(KINDS))
def test_every_factory_declares_its_kind(name: str) -> None:
    make, kind = KINDS[name]
    assert kind_of(make()) == kind


# --- hand-computed values ---------------------------------------------------------------------


def _step(tx: Any, grads: list[torch.Tensor], params: list[torch.Tensor], state: Any = None) -> Any:
    return tx.update(grads, tx.init(params) if state is None else state, params)


def test_lion_steps_by_the_sign_and_decays() -> None:
    p = [torch.tensor([2.0, -1.0])]
    u, _ = _step(so.lion(0.1, weight_decay=0.5), [torch.tensor([1e-3, 5.0])], p)
    # sign(0.1 g) = (1, 1), plus 0.5 p = (1, -0.5): -0.1 * (2, 0.5)
    torch.testing.assert_close(u[0], torch.tensor([-0.2, -0.05]))


def test_lamb_scales_adams_step_by_the_tensors_trust_ratio() -> None:
    p = [torch.tensor([3.0, 4.0]), torch.zeros(2)]
    u, _ = _step(so.lamb(1.0), [torch.tensor([2.0, -3.0]), torch.tensor([1.0, 1.0])], p)
    # first Adam step is g/|g| = (1, -1) elementwise: |.| = sqrt(2); ||p|| = 5
    torch.testing.assert_close(u[0], torch.tensor([-5.0, 5.0]) / math.sqrt(2), rtol=1e-5, atol=0)
    torch.testing.assert_close(u[1], torch.tensor([-1.0, -1.0]), rtol=1e-5, atol=0)  # ratio 1


def test_lars_trust_ratio_then_momentum() -> None:
    p = [torch.tensor([0.0, 6.0, 8.0])]
    tx = so.lars(1.0, trust_coefficient=0.1, momentum=0.5)
    g = [torch.tensor([0.0, 0.0, 1.0])]
    u1, state = _step(tx, g, p)
    u2, _ = tx.update(g, state, p)
    torch.testing.assert_close(u1[0], torch.tensor([0.0, 0.0, -1.0]))  # 0.1 * 10 / 1
    torch.testing.assert_close(u2[0], torch.tensor([0.0, 0.0, -1.5]))


def test_novograd_second_moment_is_one_number_per_tensor() -> None:
    p = [torch.zeros(2)]
    tx = so.novograd(1.0, b1=0.5, b2=0.5, eps=0.0)
    u1, state = _step(tx, [torch.tensor([3.0, 4.0])], p)
    u2, state = tx.update([torch.tensor([0.0, 5.0])], state, p)
    nu = state[0].nu[0]
    assert nu.shape == ()
    assert float(nu) == 25.0
    torch.testing.assert_close(u1[0], torch.tensor([-0.6, -0.8]))
    torch.testing.assert_close(u2[0], torch.tensor([-0.3, -1.4]))  # 0.5 m + g / 5


def test_clip_by_block_rms_only_shrinks() -> None:
    tx = so.clip_by_block_rms(2.0)
    big, small = torch.full((4,), 4.0), torch.full((2,), 1.0)
    out = tx.update([big, small], tx.init(None))[0]
    torch.testing.assert_close(out, [torch.full((4,), 2.0), small])


def test_adaptive_grad_clip_clips_each_output_row() -> None:
    tx = so.adaptive_grad_clip(0.5, eps=1e-3)
    p = [torch.tensor([[4.0, 0.0], [0.0, 0.0]])]
    g = [torch.tensor([[0.0, 6.0], [3.0, 4.0]])]
    out = tx.update(g, tx.init(p), p)[0][0]
    # row 0: max 0.5*4 = 2 -> scaled to norm 2; row 1: |p| = 0 -> max 0.5e-3
    torch.testing.assert_close(out[0], torch.tensor([0.0, 2.0]))
    torch.testing.assert_close(out[1], torch.tensor([3.0, 4.0]) * 1e-4)


def test_ema_debiased_is_the_gradient_after_one_step() -> None:
    tx = so.ema(0.9)
    u, state = _step(tx, [torch.tensor([4.0])], [torch.zeros(1)])
    torch.testing.assert_close(u[0], torch.tensor([4.0]))
    torch.testing.assert_close(state.ema[0], torch.tensor([0.4]))


def test_apply_if_finite_rejects_then_gives_up_after_max_consecutive_errors() -> None:
    tx = so.apply_if_finite(so.sgd(1.0), max_consecutive_errors=1)
    p, bad = [torch.zeros(1)], [torch.tensor([float("nan")])]
    u1, state = _step(tx, bad, p)
    u2, state = tx.update(bad, state, p)
    u3, state = tx.update([torch.ones(1)], state, p)
    assert float(u1[0]) == 0.0  # rejected
    assert math.isnan(float(u2[0]))  # the second in a row is more than 1: applied
    assert float(u3[0]) == -1.0
    assert int(state.total_notfinite) == 2
    assert int(state.notfinite_count) == 0


def test_apply_if_finite_keeps_the_inner_state_of_a_rejected_step() -> None:
    tx = so.apply_if_finite(so.adam(0.1), max_consecutive_errors=5)
    p = [torch.zeros(2)]
    _, state = _step(tx, [torch.tensor([1.0, float("inf")])], p)
    assert float(state.inner_state[0].count[0]) == 0.0
    assert torch.equal(state.inner_state[0].mu[0], torch.zeros(2))


def test_lookahead_syncs_every_period() -> None:
    tx = so.lookahead(so.sgd(1.0), sync_period=2, slow_step_size=0.25)
    p = [torch.zeros(1)]
    state = tx.init(p)
    for _ in range(4):
        u, state = tx.update([torch.ones(1)], state, p)
        p = apply_updates(p, u)
    # two syncs: slow 0 -> -0.5 -> -1.0 (each 0.25 of the 2 fast steps from it)
    torch.testing.assert_close(p[0], torch.tensor([-1.0]))


def test_schedule_free_eval_params_is_the_average_x() -> None:
    tx = so.schedule_free_adamw(0.1, b1=0.5)
    p = [torch.zeros(1)]
    u, state = _step(tx, [torch.tensor([2.0])], p)
    y = apply_updates(p, u)
    # z = -0.1, x = z (first weight is the whole sum), y = 0.5 x + 0.5 z
    torch.testing.assert_close(so.schedule_free_eval_params(state, y)[0], torch.tensor([-0.1]))


def test_add_noise_is_reproducible_and_decays() -> None:
    tx = so.add_noise(1.0, 1.0, key=7)
    g = [torch.zeros(4000)]
    u1, state = _step(tx, g, g)
    again, _ = _step(tx, g, g)
    u2, _ = tx.update(g, state, g)
    assert torch.equal(u1[0], again[0])
    assert 0.95 < float(u1[0].std()) < 1.05  # std 1
    assert 0.66 < float(u2[0].std()) < 0.75  # std 1/sqrt(2)


def test_zero_nans_replaces_nans_and_records_them() -> None:
    tx = so.zero_nans()
    u, state = _step(tx, [torch.tensor([float("nan"), 1.0]), torch.ones(1)], [torch.zeros(2)] * 2)
    torch.testing.assert_close(u, [torch.tensor([0.0, 1.0]), torch.ones(1)])
    assert [bool(x) for x in state.found_nan] == [True, False]


def test_moment_helpers() -> None:
    g, m = [torch.tensor([2.0]), None], [torch.tensor([1.0]), torch.tensor([3.0])]
    assert update_moment(g, m, 0.5, 2) == [torch.tensor([2.5]), torch.tensor([3.0])]
    out = update_moment_per_elem_norm([torch.tensor([-2.0])], [torch.zeros(1)], 0.5, 3)
    torch.testing.assert_close(out, [torch.tensor([4.0])])
    counts = [torch.tensor(2.0)]
    torch.testing.assert_close(
        bias_correction([torch.tensor([0.19])], 0.9, counts), [torch.ones(1)]
    )


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: so.lion(-1.0), "lion: expected 0 <= lr, got -1.0"),
        (lambda: so.adan(1e-3, b3=1.5), "adan: expected 0 <= b3 <= 1, got 1.5"),
        (lambda: so.lookahead(so.sgd(0.1), 0, 0.5), "lookahead: expected sync_period >= 1"),
        (lambda: so.clip_by_block_rms(0.0), "clip_by_block_rms: expected threshold > 0"),
        (lambda: so.scale_by_trust_ratio().update([torch.ones(1)], None), "expected params"),
    ],
)
def test_bad_input_is_refused_naming_the_api(make: Callable[[], Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        make()


# --- on pieces under a scope ------------------------------------------------------------------


class LocalReducer:
    """Every piece is local: the whole tensor's value is the sum (or max) over its pieces."""

    def combine(
        self,
        values: torch.Tensor,
        ids: Sequence[int],
        op: str,
        parts: Sequence[int] = (),
        trees: int = 1,
        total: bool = False,
    ) -> torch.Tensor:
        if op == "rows":  # one slot per row of every tensor, already summed over the pieces
            return values
        if total:  # every piece is here: the tree's value is over all of them
            if values.numel() == 0:
                return values.new_zeros(1)
            return (values.sum() if op == "sum" else values.max()).reshape(1)
        keys = list(zip(ids, parts or [0] * len(ids)))
        out = values.clone()
        for i, key in enumerate(keys):
            same = values[[j for j, k in enumerate(keys) if k == key]]
            out[i] = same.sum() if op == "sum" else same.max()
        return out


SHAPES = [(3, 4), (5,), (2, 3)]


def _cut(tree: list[Any], at: list[int]) -> list[Any]:
    """Each tensor flattened and cut in two at ``at[i]`` (a piece may be empty)."""
    out = []
    for x, k in zip(tree, at):
        flat = x.reshape(-1)
        out += [flat[:k], flat[k:]]
    return out


def _run_pieces(tx: Any, steps: list[list[torch.Tensor]], params: list[torch.Tensor]) -> Any:
    at = [5, 0, 6]
    scope = Scope(
        [torch.empty(s, device="meta") for s in SHAPES],
        (0, 1, 2),
        (0, 0, 1, 1, 2, 2),
        LocalReducer(),
        None,
        (0, at[0], 0, at[1], 0, at[2]),  # where each piece starts in its tensor
    )
    p = _cut(params, at)
    with in_scope(scope):
        state = tx.init(p)
        for g in steps:
            u, state = tx.update(_cut(g, at), state, p)
            p = apply_updates(p, u)
    return [torch.cat(p[2 * i : 2 * i + 2]) for i in range(len(SHAPES))]


def _run_whole(tx: Any, steps: list[list[torch.Tensor]], params: list[torch.Tensor]) -> Any:
    p, state = params, tx.init(params)
    for g in steps:
        u, state = tx.update(g, state, p)
        p = apply_updates(p, u)
    return [x.reshape(-1) for x in p]


PIECES: dict[str, Callable[[], Any]] = {
    "lion": lambda: so.lion(1e-2),
    "lamb": lambda: so.lamb(1e-2, weight_decay=1e-2),
    "lars": lambda: so.lars(0.1, weight_decay=1e-3),
    "lars_masked": lambda: so.lars(0.1, 1e-3, trust_ratio_mask=[True, False, True]),
    "adabelief": lambda: so.adabelief(1e-2),
    "yogi": lambda: so.yogi(1e-2),
    "novograd": lambda: so.novograd(1e-2, weight_decay=1e-3),
    "adan": lambda: so.adan(1e-2),
    "lookahead": lambda: so.lookahead(so.lamb(1e-2), 2, 0.5),
    "sign_sgd": lambda: so.sign_sgd(1e-2),
    "signum": lambda: so.signum(1e-2),
    "ademamix": lambda: so.ademamix(1e-2),
    "adopt": lambda: so.adopt(1e-2),
    "schedule_free_adamw": lambda: so.schedule_free_adamw(1e-2),
    "trust_ratio_then_sgd": lambda: so.chain(so.scale_by_trust_ratio(0.1, 0.5), so.sgd(0.1)),
    "clip_by_block_rms": lambda: so.chain(so.clip_by_block_rms(0.3), so.sgd(0.1)),
    "ema": lambda: so.chain(so.ema(0.9), so.sgd(0.1)),
    "apply_if_finite": lambda: so.apply_if_finite(so.lamb(1e-2), 2),
    "zero_nans": lambda: so.chain(so.zero_nans(), so.sgd(0.1)),
    "adaptive_grad_clip": lambda: so.chain(so.adaptive_grad_clip(0.05), so.sgd(0.1)),
}


@pytest.mark.parametrize("name", sorted(PIECES))
def test_on_cut_pieces_under_a_scope_as_on_whole_tensors(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=gen) for s in SHAPES]
    steps = [[torch.randn(s, generator=gen) for s in SHAPES] for _ in range(3)]
    steps[1][1][0] = float("nan")  # apply_if_finite rejects it, zero_nans zeroes it
    if name not in {"apply_if_finite", "zero_nans"}:
        steps[1][1][0] = 0.5
    want = _run_whole(PIECES[name](), steps, params)
    got = _run_pieces(PIECES[name](), steps, params)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6 * float(b.abs().max()))


def test_add_noise_draws_a_tensors_noise_by_its_index_among_the_whole_tensors() -> None:
    tx = so.add_noise(1.0, 0.0, key=3)
    whole = [torch.zeros(3), torch.zeros(2, 2)]
    want = tx.update(whole, tx.init(whole))[0][1]
    only_second = Scope(
        [torch.empty(3, device="meta"), torch.empty(2, 2, device="meta")],
        (0, 1),
        (1,),
        LocalReducer(),
    )
    with in_scope(only_second):
        got = tx.update([torch.zeros(2, 2)], tx.init([torch.zeros(2, 2)]))[0][0]
    assert torch.equal(got, want)
