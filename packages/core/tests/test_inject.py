"""inject_hyperparams against torch.optim under LR schedulers; set_hyperparams and its refusals."""

from __future__ import annotations

import math
import pickle
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from shardopt.core import (
    InjectHyperparamsState,
    Transformation,
    adam,
    adamw,
    apply_updates,
    inject_hyperparams,
    muon,
    rmsprop,
    set_hyperparams,
    sgd,
    update_pieces_,
)
from shardopt.core._fused import split_state
from shardopt.core.blocks import needs_whole_tensors, piece_rule, tree_leaves, tree_map

DTYPES = [torch.float64, torch.float32]
Scheduler = Callable[[torch.optim.Optimizer], Any]


def step_lr(opt: torch.optim.Optimizer) -> Any:
    """StepLR multiplying the lr by 0.95 at every step."""
    return torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.95)


def cosine_lambda_lr(opt: torch.optim.Optimizer) -> Any:
    """LambdaLR on a cosine decay over the 50 steps: a new lr at every step."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 * (1 + math.cos(math.pi * t / 50)))


def under_scheduler(
    torch_cls: type[torch.optim.Optimizer], scheduler: Scheduler, used: list[Any]
) -> type[torch.optim.Optimizer]:
    """``torch_cls`` stepping ``scheduler`` after each step; records the lr of each step."""

    class Scheduled(torch_cls):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, **kwargs)
            self.scheduler = scheduler(self)

        def step(self, closure: Any = None) -> Any:
            used.append(self.param_groups[0]["lr"])
            loss = super().step(closure)
            self.scheduler.step()
            return loss

    return Scheduled


def driven(tx: Transformation, used: list[Any]) -> Transformation:
    """``tx`` whose state gets the lr torch used at its last step before each update."""

    def update(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return tx.update(updates, set_hyperparams(state, lr=used[-1]), params)

    return Transformation(tx.init, update)


# (id, factory, torch class, options, scheduler, torch keys compared bitwise: None for all of
# the state and the parameters, else these state keys only). Bitwise where the plain factory's
# own tables are (test_adam, test_sgd, test_rmsprop): Adam without decoupled decay, AdamW without
# weight decay, RMSprop without momentum; SGD's momentum buffer without weight decay.
CASES: list[tuple[str, Any, Any, dict[str, Any], Scheduler, tuple[str, ...] | None]] = [
    ("sgd-momentum", sgd, torch.optim.SGD, {"momentum": 0.9}, step_lr, ("momentum_buffer",)),
    (
        "sgd-nesterov-decay",
        sgd,
        torch.optim.SGD,
        {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
        cosine_lambda_lr,
        (),
    ),
    ("adam", adam, torch.optim.Adam, {}, cosine_lambda_lr, None),
    (
        "adam-amsgrad-l2",
        adam,
        torch.optim.Adam,
        {"amsgrad": True, "weight_decay": 0.1},
        step_lr,
        None,
    ),
    ("adamw", adamw, torch.optim.AdamW, {}, step_lr, ()),
    ("adamw-no_decay", adamw, torch.optim.AdamW, {"weight_decay": 0.0}, cosine_lambda_lr, None),
    ("rmsprop", rmsprop, torch.optim.RMSprop, {}, step_lr, None),
    (
        "rmsprop-centered-momentum",
        rmsprop,
        torch.optim.RMSprop,
        {"centered": True, "momentum": 0.5},
        cosine_lambda_lr,
        (),
    ),
]
TORCH_KEYS = {  # torch key -> field of the optimizer's own state
    "sgd": {"momentum_buffer": "momentum"},
    "adam": {"step": "count", "exp_avg": "mu", "exp_avg_sq": "nu"},
    "adamw": {"step": "count", "exp_avg": "mu", "exp_avg_sq": "nu"},
    "rmsprop": {"step": "count", "square_avg": "square_avg"},
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("factory", "torch_cls", "options", "scheduler", "bitwise"),
    [c[1:] for c in CASES],
    ids=[c[0] for c in CASES],
)
def test_an_lr_changed_every_step_matches_torch_under_its_scheduler_for_50_steps(
    equivalence: Any,
    factory: Any,
    torch_cls: Any,
    options: dict[str, Any],
    scheduler: Scheduler,
    bitwise: tuple[str, ...] | None,
    dtype: torch.dtype,
) -> None:
    """Parameters and state within 1e-12 (float64) / 1e-6 (float32), bitwise where the plain
    factory is; the lr is a new Python float at every step and stays one in the state."""
    used: list[Any] = []
    tx = inject_hyperparams(factory, lr=0.01, **options)
    run = equivalence(
        driven(tx, used),
        under_scheduler(torch_cls, scheduler, used),
        {"lr": 0.01, **options},
        dtype,
    )
    assert len(set(used)) == 50  # a new lr at each step
    assert type(run.state.hyperparams["lr"]) is float
    assert run.state.hyperparams["lr"] == used[-1]
    run.assert_params_close()
    keys = TORCH_KEYS[factory.__name__]
    run.assert_state_matches(split_state(run.state.inner)[0], keys, bitwise=bitwise)
    if bitwise is None:
        run.assert_params_equal()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_0d_tensor_lr_changed_every_step_matches_torch_with_that_tensor_bitwise(
    equivalence: Any, dtype: torch.dtype
) -> None:
    """torch's tensor-lr arithmetic, as the plain factory with a tensor lr: the state holds the
    very tensor torch's param group holds."""
    used: list[Any] = []

    def tensor_lr(opt: torch.optim.Optimizer) -> Any:
        class Decay:
            def step(self) -> None:
                opt.param_groups[0]["lr"] = opt.param_groups[0]["lr"] * 0.9

        return Decay()

    lr = torch.tensor(0.01)
    tx = inject_hyperparams(adam, lr=lr, weight_decay=0.1)
    run = equivalence(
        driven(tx, used),
        under_scheduler(torch.optim.Adam, tensor_lr, used),
        {"lr": lr, "weight_decay": 0.1},
        dtype,
    )
    assert run.state.hyperparams["lr"] is used[-1]
    assert isinstance(used[-1], torch.Tensor)
    assert len({float(x) for x in used}) == 50
    run.assert_params_equal()
    run.assert_state_matches(split_state(run.state.inner)[0], TORCH_KEYS["adam"])


def test_the_lr_gets_its_gradient_under_torch_func_grad() -> None:
    """d loss(p - lr g) / d lr = -g . grad loss at the new point, through set_hyperparams."""
    p, g = torch.tensor([1.0, -2.0, 0.5]), torch.tensor([0.3, 0.1, -0.4])
    state = inject_hyperparams(sgd, lr=0.1).init([p])

    def loss(lr: torch.Tensor) -> torch.Tensor:
        tx = inject_hyperparams(sgd, lr=0.1)
        updates, _ = tx.update([g], set_hyperparams(state, lr=lr), [p])
        return apply_updates([p], updates)[0].square().sum()

    lr = torch.tensor(0.25)
    got = torch.func.grad(loss)(lr)
    torch.testing.assert_close(got, (2 * (p - lr * g) * -g).sum())


def test_the_param_gradient_under_torch_func_grad_is_the_plain_factorys() -> None:
    params = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor(0.5)}

    def loss_after_steps(tx: Transformation) -> Callable[[Any], torch.Tensor]:
        def loss(p: Any) -> torch.Tensor:
            state = tx.init(p)
            for _ in range(3):
                grads = tree_map(lambda x: 2 * x, p)
                updates, state = tx.update(grads, state, p)
                p = apply_updates(p, updates)
            return sum(x.square().sum() for x in tree_leaves(p))

        return loss

    plain = torch.func.grad(loss_after_steps(adam(0.1, amsgrad=True)))(params)
    injected = torch.func.grad(loss_after_steps(inject_hyperparams(adam, lr=0.1, amsgrad=True)))
    assert all(torch.equal(a, b) for a, b in zip(tree_leaves(plain), tree_leaves(injected(params))))


@pytest.mark.parametrize(
    ("factory", "options"), [(c[1], c[3]) for c in CASES], ids=[c[0] for c in CASES]
)
def test_the_piece_rule_is_the_plain_factorys_and_matches_the_pure_path(
    factory: Any, options: dict[str, Any]
) -> None:
    """update_pieces_ of the injected form runs the plain factory's in-place rule: bitwise equal to
    it with the lr changed every other step, and within float32 tolerance of the pure path."""
    tx = inject_hyperparams(factory, lr=0.05, **options)
    assert piece_rule(tx) is not None
    gen = torch.Generator().manual_seed(0)
    flat = [torch.randn(n, generator=gen) for n in (1, 17, 100)]
    plain, pure = [p.clone() for p in flat], [p.clone() for p in flat]
    state, pure_state = tx.init(flat), tx.init(pure)
    plain_state = factory(lr=0.05, **options).init(plain)
    for step in range(20):
        lr = 0.05 * 0.9 ** (step // 2)
        grads = [torch.randn(p.shape, generator=gen) for p in flat]
        state = set_hyperparams(state, lr=lr)
        update_pieces_(tx, flat, grads, state)
        update_pieces_(factory(lr=lr, **options), plain, grads, plain_state)
        updates, pure_state = tx.update(grads, set_hyperparams(pure_state, lr=lr), pure)
        pure = apply_updates(pure, updates)
    assert all(torch.equal(a, b) for a, b in zip(flat, plain))
    for a, b in zip(tree_leaves(state.inner), tree_leaves(plain_state)):
        assert not isinstance(a, torch.Tensor) or torch.equal(a, b)
    for a, b in zip(flat, pure):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_set_hyperparams_is_pure_and_shares_the_inner_state() -> None:
    state = inject_hyperparams(adam, lr=0.1, betas=[0.9, 0.99]).init([torch.zeros(3)])
    new = set_hyperparams(state, lr=0.05)
    assert isinstance(new, InjectHyperparamsState)
    assert new.inner is state.inner
    assert state.hyperparams == {"lr": 0.1, "betas": (0.9, 0.99)}  # kept; a list became a tuple
    assert new.hyperparams == {"lr": 0.05, "betas": (0.9, 0.99)}


def test_the_state_is_a_pytree_whose_rebuilt_hyperparams_still_know_their_factory() -> None:
    """tree_map (and torch.func) see the values as leaves; the rebuilt state still validates,
    and pickles."""
    state = inject_hyperparams(sgd, lr=0.1, momentum=0.9).init([torch.zeros(2)])
    paths = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(state)[0]]
    assert paths[:2] == [".hyperparams['lr']", ".hyperparams['momentum']"]
    doubled = pytree.tree_map(lambda x: 2 * x, state)
    assert doubled.hyperparams == {"lr": 0.2, "momentum": 1.8}
    with pytest.raises(ValueError, match=re.escape("set_hyperparams: sgd: expected 0 <= lr")):
        set_hyperparams(doubled, lr=-1.0)
    assert set_hyperparams(pickle.loads(pickle.dumps(state)), lr=0.3).hyperparams["lr"] == 0.3


REFUSED = [
    (
        "unknown_name",
        adam,
        {"lr": 0.1},
        {"lrr": 0.2},
        "set_hyperparams: expected hyperparameters of adam among ['lr'], got lrr=0.2",
    ),
    (
        "invalid_lr",
        adam,
        {"lr": 0.1},
        {"lr": -1.0},
        "set_hyperparams: adam: expected 0 <= lr, got -1.0",
    ),
    (
        "invalid_betas",
        adam,
        {"lr": 0.1, "betas": (0.9, 0.999)},
        {"betas": (1.5, 0.999)},
        "set_hyperparams: adam: expected 0 <= betas[0] < 1, got 1.5",
    ),
    (
        "sgd_momentum_from_0",
        sgd,
        {"lr": 0.1, "momentum": 0.0},
        {"momentum": 0.9},
        "set_hyperparams: expected changes that keep the structure of the state of sgd (set "
        "them at construction), got momentum=0.9",
    ),
    (
        "sgd_weight_decay_from_0",
        sgd,
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0},
        {"lr": 0.2, "weight_decay": 0.01},
        "set_hyperparams: expected changes that keep the structure of the state of sgd (set "
        "them at construction), got lr=0.2, weight_decay=0.01",
    ),
    (
        "adam_amsgrad",
        adam,
        {"lr": 0.1, "amsgrad": False},
        {"amsgrad": True},
        "set_hyperparams: expected changes that keep the structure of the state of adam (set "
        "them at construction), got amsgrad=True",
    ),
    (
        "rmsprop_centered",
        rmsprop,
        {"lr": 0.1, "centered": False},
        {"centered": True},
        "set_hyperparams: expected changes that keep the structure of the state of rmsprop (set "
        "them at construction), got centered=True",
    ),
]


@pytest.mark.parametrize(
    ("factory", "start", "change", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED]
)
def test_set_hyperparams_refuses_what_the_state_cannot_serve(
    factory: Any, start: dict[str, Any], change: dict[str, Any], message: str
) -> None:
    state = inject_hyperparams(factory, **start).init([torch.zeros(2)])
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        set_hyperparams(state, **change)


@pytest.mark.parametrize(
    ("factory", "start", "change"),
    [
        (sgd, {"lr": 0.1, "momentum": 0.9}, {"momentum": 0.5, "lr": torch.tensor(0.2)}),
        (adamw, {"lr": 0.1, "weight_decay": 0.01}, {"weight_decay": 0.02}),
        (rmsprop, {"lr": 0.1, "centered": True, "alpha": 0.9}, {"alpha": 0.95}),
    ],
)
def test_set_hyperparams_takes_changes_that_keep_the_state(
    factory: Any, start: dict[str, Any], change: dict[str, Any]
) -> None:
    state = inject_hyperparams(factory, **start).init([torch.zeros(2)])
    new = set_hyperparams(state, **change)
    assert all(new.hyperparams[k] is v or new.hyperparams[k] == v for k, v in change.items())


def test_set_hyperparams_refuses_a_state_not_from_inject_hyperparams() -> None:
    message = "set_hyperparams: expected the state of inject_hyperparams, got tuple"
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        set_hyperparams(adam(0.1).init([torch.zeros(1)]), lr=0.2)  # type: ignore[arg-type]


def test_inject_hyperparams_refuses_what_the_factory_refuses() -> None:
    with pytest.raises(ValueError, match=re.escape("adam: expected 0 <= lr, got -1.0")):
        inject_hyperparams(adam, lr=-1.0)


def test_the_injected_form_needs_whole_tensors_where_the_factory_does() -> None:
    assert needs_whole_tensors(inject_hyperparams(muon, lr=0.02))
    assert not needs_whole_tensors(inject_hyperparams(adam, lr=0.02))
