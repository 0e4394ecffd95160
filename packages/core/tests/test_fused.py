"""Flat in-place rules of sgd, adam, adamw and adagrad: against the pure path and torch fused."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from shardopt.core import (
    _fused,
    adagrad,
    adam,
    adamw,
    apply_updates,
    linear_warmup,
    sgd,
    update_pieces_,
)
from shardopt.core._fused import FUSED_DEVICES, Kernel, select_kernel, split_state
from shardopt.core.blocks import piece_rule, tree_leaves

from _core_helpers import option_id, torch_form

SIZES = (1, 17, 1000)
STEPS = 20
DTYPES = [torch.float32, torch.float64]
FLOAT32_RTOL = 1e-6

# (name, factory, torch class, options): the options go to both.
CASES: list[tuple[str, Any, Any, dict[str, Any]]] = [
    ("sgd", sgd, torch.optim.SGD, {"lr": 0.05}),
    ("sgd-momentum", sgd, torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (
        "sgd-nesterov-wd-maximize",
        sgd,
        torch.optim.SGD,
        {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1, "maximize": True},
    ),
    ("sgd-tensor_lr", sgd, torch.optim.SGD, {"lr": torch.tensor(0.05), "momentum": 0.9}),
    ("adam", adam, torch.optim.Adam, {"lr": 0.01}),
    (
        "adam-amsgrad-l2-maximize",
        adam,
        torch.optim.Adam,
        {"lr": 0.01, "amsgrad": True, "weight_decay": 0.1, "maximize": True},
    ),
    (
        "adam-decoupled",
        adam,
        torch.optim.Adam,
        {"lr": 0.01, "weight_decay": 0.1, "decoupled_weight_decay": True},
    ),
    ("adam-tensor_lr", adam, torch.optim.Adam, {"lr": torch.tensor(0.01)}),
    ("adamw", adamw, torch.optim.AdamW, {"lr": 0.01}),
    ("adamw-amsgrad-maximize", adamw, torch.optim.AdamW, {"amsgrad": True, "maximize": True}),
    ("adagrad", adagrad, torch.optim.Adagrad, {"lr": 0.05}),
    (
        "adagrad-all_options",
        adagrad,
        torch.optim.Adagrad,
        {
            "lr": 0.05,
            "lr_decay": 0.05,
            "weight_decay": 0.1,
            "initial_accumulator_value": 0.2,
            "maximize": True,
        },
    ),
    ("adagrad-tensor_lr", adagrad, torch.optim.Adagrad, {"lr": torch.tensor(0.05)}),
]
CASE_IDS = [c[0] for c in CASES]


def make_flat(dtype: torch.dtype) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(n, generator=gen, dtype=torch.float64).to(dtype) for n in SIZES]


def make_grads(
    gen: torch.Generator, step: int, dtype: torch.dtype, skips: bool
) -> list[torch.Tensor | None]:
    """Fresh gradients; with ``skips`` tensor ``i`` has none when ``(step + i) % 3 == 0``."""
    return [
        None
        if skips and (step + i) % 3 == 0
        else torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
        for i, n in enumerate(SIZES)
    ]


def assert_close(ours: list[torch.Tensor], ref: list[torch.Tensor], rtol: float) -> None:
    for i, (a, b) in enumerate(zip(ours, ref)):
        err = ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        assert err <= rtol, f"tensor {i} (size {SIZES[i]}): relative error {err:.2e} > {rtol}"


def run_flat_and_pure(tx: Any, dtype: torch.dtype, skips: bool) -> tuple[Any, ...]:
    """``STEPS`` of update_pieces_ and of the pure path on the same gradients."""
    flat, pure = make_flat(dtype), make_flat(dtype)
    flat_state, pure_state = tx.init(flat), tx.init(pure)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = make_grads(gen, step, dtype, skips)
        update_pieces_(tx, flat, grads, flat_state)
        updates, pure_state = tx.update(grads, pure_state, pure)
        pure = apply_updates(pure, updates)
    return flat, flat_state, pure, pure_state


def force_kernel(monkeypatch: pytest.MonkeyPatch, kernel: Kernel) -> None:
    if kernel is Kernel.FOREACH:
        monkeypatch.setattr(_fused, "select_kernel", lambda *args, **kwargs: Kernel.FOREACH)


@pytest.mark.parametrize("kernel", [Kernel.FUSED, Kernel.FOREACH], ids=str)
@pytest.mark.parametrize("skips", [False, True], ids=["all_grads", "none_grads"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("name", "factory", "torch_cls", "options"), CASES, ids=CASE_IDS)
def test_update_pieces_matches_the_pure_path_for_20_steps(
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    factory: Any,
    torch_cls: Any,
    options: dict[str, Any],
    dtype: torch.dtype,
    skips: bool,
    kernel: Kernel,
) -> None:
    """Parameters and every state tensor agree within float32 tolerance, by either kernel."""
    force_kernel(monkeypatch, kernel)
    tx = factory(**options)
    assert piece_rule(tx) is not None
    flat, flat_state, pure, pure_state = run_flat_and_pure(tx, dtype, skips)
    assert_close(flat, pure, FLOAT32_RTOL)
    for ours, ref in zip(tree_leaves(flat_state), tree_leaves(pure_state)):
        if isinstance(ref, torch.Tensor):
            assert_close([ours.reshape(-1)], [ref.reshape(-1)], FLOAT32_RTOL)


# SGD's rule does not call torch's fused kernel on CPU (see [Note: SGD on CPU is foreach]): it is
# compared with torch's for-loop and foreach SGD below instead.
TORCH_FUSED_CASES = [
    (*case, skips) for case in CASES for skips in (False, True) if case[1] is not sgd
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("name", "factory", "torch_cls", "options", "skips"),
    TORCH_FUSED_CASES,
    ids=[f"{c[0]}-{'none_grads' if c[4] else 'all_grads'}" for c in TORCH_FUSED_CASES],
)
def test_update_pieces_equals_torch_fused_bitwise(
    name: str,
    factory: Any,
    torch_cls: Any,
    options: dict[str, Any],
    skips: bool,
    dtype: torch.dtype,
) -> None:
    """The same fused kernel with the same arguments and float32 step counts: bitwise equal.

    Adam, AdamW and Adagrad only: SGD on CPU runs foreach ops (see the SGD tests below).
    """
    tx = factory(**options)
    ours = make_flat(dtype)
    state = tx.init(ours)
    theirs = [p.clone().requires_grad_(True) for p in make_flat(dtype)]
    cls, torch_options = torch_form(torch_cls, options)
    opt = cls(theirs, fused=True, **torch_options)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = make_grads(gen, step, dtype, skips)
        update_pieces_(tx, ours, grads, state)
        for p, g in zip(theirs, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b.detach())


# Every combination torch accepts (nesterov needs momentum > 0 and dampening == 0).
SGD_OPTIONS = [
    {"momentum": m, "dampening": d, "nesterov": n, "weight_decay": w, "maximize": x}
    for m, d, n, w, x in itertools.product(
        (0.0, 0.9), (0.0, 0.3), (False, True), (0.0, 0.1), (False, True)
    )
    if not n or (m > 0 and d == 0)
]
LR_KINDS = {"float_lr": 0.05, "tensor_lr": torch.tensor(0.05)}
# (dtype, torch's foreach flag). In float16/bfloat16 torch's CPU foreach SGD differs from its
# for-loop (its foreach mul rounds the momentum to the dtype first): the rule follows the loop.
SGD_TORCH_PATHS = [
    *[(dtype, foreach) for dtype in DTYPES for foreach in (False, True)],
    (torch.bfloat16, False),
    (torch.float16, False),
]


def momentum_buffers(state: Any) -> list[torch.Tensor]:
    main = split_state(state)[0]
    return [] if main is None else tree_leaves(main.momentum)


@pytest.mark.parametrize(
    ("dtype", "foreach"),
    SGD_TORCH_PATHS,
    ids=[f"{d}-{'torch_foreach' if f else 'torch_for_loop'}" for d, f in SGD_TORCH_PATHS],
)
@pytest.mark.parametrize("skips", [False, True], ids=["all_grads", "none_grads"])
@pytest.mark.parametrize("lr_kind", list(LR_KINDS))
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=option_id)
def test_update_pieces_sgd_equals_torch_sgd_bitwise_on_cpu(
    options: dict[str, Any], lr_kind: str, skips: bool, dtype: torch.dtype, foreach: bool
) -> None:
    """20 steps of parameters and momentum buffers: the same ops in torch's order, to the bit."""
    lr = LR_KINDS[lr_kind]
    tx = sgd(lr, **options)
    ours = make_flat(dtype)
    state = tx.init(ours)
    theirs = [p.clone().requires_grad_(True) for p in make_flat(dtype)]
    opt = torch.optim.SGD(theirs, lr=lr, foreach=foreach, **options)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        grads = make_grads(gen, step, dtype, skips)
        update_pieces_(tx, ours, grads, state)
        for p, g in zip(theirs, grads):
            p.grad = None if g is None else g.clone()
        opt.step()
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert torch.equal(a, b.detach()), f"tensor {i} (size {SIZES[i]})"
    for buf, p in zip(momentum_buffers(state), theirs):
        assert torch.equal(buf, opt.state[p]["momentum_buffer"])


SPLIT_NUMEL = 1000


def cut(x: torch.Tensor, cuts: tuple[int, ...]) -> list[torch.Tensor]:
    """Views of ``x`` between consecutive ``cuts`` (0 and its length added)."""
    bounds = [0, *cuts, x.numel()]
    return [x[a:b] for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("cuts", [(1, 7, 17, 33), (3, 500, 999)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("lr_kind", list(LR_KINDS))
@pytest.mark.parametrize("options", SGD_OPTIONS, ids=option_id)
def test_update_pieces_sgd_is_split_invariant(
    options: dict[str, Any], lr_kind: str, dtype: torch.dtype, cuts: tuple[int, ...]
) -> None:
    """A tensor stepped whole or as pieces at odd offsets (a shard's cuts): the same bits, for
    parameters and momentum buffers, over 20 steps with a missing gradient every third step.

    float32 and float64 only: in float16/bfloat16 torch's CPU ``add`` with alpha is itself
    split-dependent (see [Note: SGD on CPU is foreach]).
    """
    tx = sgd(LR_KINDS[lr_kind], **options)
    gen = torch.Generator().manual_seed(0)
    whole = torch.randn(SPLIT_NUMEL, generator=gen, dtype=torch.float64).to(dtype)
    split = whole.clone()
    pieces = cut(split, cuts)
    whole_state, pieces_state = tx.init([whole]), tx.init(pieces)
    for step in range(STEPS):
        g = torch.randn(SPLIT_NUMEL, generator=gen, dtype=torch.float64).to(dtype)
        skip = step % 3 == 2
        update_pieces_(tx, [whole], [None if skip else g], whole_state)
        update_pieces_(tx, pieces, [None] * len(pieces) if skip else cut(g, cuts), pieces_state)
    assert torch.equal(split, whole)
    bufs = momentum_buffers(pieces_state)
    if bufs:
        assert torch.equal(torch.cat(bufs), momentum_buffers(whole_state)[0])


@pytest.mark.parametrize(
    ("factory", "options"),
    [
        (sgd, {"momentum": 0.9}),
        (adam, {"amsgrad": True}),
        (adamw, {}),
        (adagrad, {"lr_decay": 0.01}),
    ],
    ids=["sgd", "adam", "adamw", "adagrad"],
)
def test_update_pieces_with_a_schedule_matches_the_pure_path(factory: Any, options: Any) -> None:
    """Counts differ between tensors (None gradients): each gets its own scheduled lr."""
    tx = factory(linear_warmup(0.05, 10), **options)
    flat, flat_state, pure, pure_state = run_flat_and_pure(tx, torch.float32, skips=True)
    assert_close(flat, pure, FLOAT32_RTOL)
    for ours, ref in zip(tree_leaves(flat_state), tree_leaves(pure_state)):
        if isinstance(ref, torch.Tensor):
            assert_close([ours.reshape(-1)], [ref.reshape(-1)], FLOAT32_RTOL)


def per_parameter_trees(state: Any) -> list[list[torch.Tensor]]:
    """The per-parameter lists in a factory's chain state (counts, moments, buffers, sums)."""
    return [value for part in state for value in part if isinstance(value, list)]


@pytest.mark.parametrize(("name", "factory", "torch_cls", "options"), CASES, ids=CASE_IDS)
def test_update_pieces_updates_in_place_and_skips_none_gradients(
    name: str, factory: Any, torch_cls: Any, options: dict[str, Any]
) -> None:
    """The state keeps its tensor objects and storage; a None gradient leaves its parameter and
    its state alone; the gradients are not modified."""
    tx = factory(**options)
    params = make_flat(torch.float32)
    state = tx.init(params)
    trees = per_parameter_trees(state)  # empty for plain sgd
    objects = [list(tree) for tree in trees]
    pointers = [[x.data_ptr() for x in tree] for tree in trees]
    copies = [[x.clone() for x in tree] for tree in trees]
    param_copies = [p.clone() for p in params]
    grads = [None, torch.randn(SIZES[1]), torch.randn(SIZES[2])]
    grad_copies = [g.clone() for g in grads[1:]]
    update_pieces_(tx, params, grads, state)
    assert per_parameter_trees(state) == trees
    for tree, objs, ptrs, olds in zip(trees, objects, pointers, copies):
        assert all(a is b for a, b in zip(tree, objs))
        assert [x.data_ptr() for x in tree] == ptrs
        assert torch.equal(tree[0], olds[0])
    assert torch.equal(params[0], param_copies[0])
    assert not torch.equal(params[2], param_copies[2])
    for g, copy in zip(grads[1:], grad_copies):
        assert torch.equal(g, copy)


def test_update_pieces_counts_only_the_parameters_with_gradients() -> None:
    tx = adam(0.01)
    params = make_flat(torch.float32)
    state = tx.init(params)
    update_pieces_(tx, params, [None, torch.ones(SIZES[1]), torch.ones(SIZES[2])], state)
    counts = [float(c) for c in tree_leaves(_fused.split_state(state)[0].count)]
    assert counts == [0.0, 1.0, 1.0]


@pytest.mark.parametrize(
    ("factory", "options"),
    [
        (adam, {"betas": (torch.tensor(0.9), torch.tensor(0.999))}),
        (sgd, {"weight_decay": torch.tensor(0.1), "momentum": 0.9}),
        (adagrad, {"weight_decay": torch.tensor(0.1)}),
    ],
    ids=["adam-tensor_betas", "sgd-tensor_weight_decay", "adagrad-tensor_weight_decay"],
)
def test_update_pieces_falls_back_to_the_pure_path_for_tensor_hyperparameters(
    factory: Any, options: Any
) -> None:
    """The fused kernels take floats: these run the pure path and copy back, bitwise equal."""
    tx = factory(**options)
    flat, flat_state, pure, pure_state = run_flat_and_pure(tx, torch.float32, skips=True)
    for a, b in zip([*flat, *tree_leaves(flat_state)], [*pure, *tree_leaves(pure_state)]):
        assert (a is None and b is None) or torch.equal(a, b)


def test_update_pieces_and_the_pure_path_can_take_turns_on_one_state() -> None:
    """The rule advances every count of the chain (here lr schedule and decoupled decay)."""
    tx = adamw(linear_warmup(0.01, 5), weight_decay=0.1)
    params, ref = make_flat(torch.float32), make_flat(torch.float32)
    state, ref_state = tx.init(params), tx.init(ref)
    gen = torch.Generator().manual_seed(1)
    for step in range(10):
        grads = make_grads(gen, step, torch.float32, skips=True)
        if step % 2:
            update_pieces_(tx, params, grads, state)
        else:
            updates, state = tx.update(grads, state, params)
            params = apply_updates(params, updates)
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = apply_updates(ref, updates)
    assert_close(params, ref, FLOAT32_RTOL)
    for a, b in zip(tree_leaves(state), tree_leaves(ref_state)):
        if isinstance(b, torch.Tensor) and b.dim() == 0:
            assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("params", "grads", "fused_on", "kernel"),
    [
        ([torch.zeros(3)], [torch.ones(3)], FUSED_DEVICES, Kernel.FUSED),
        (
            [torch.zeros(3, dtype=torch.bfloat16)],
            [torch.ones(3, dtype=torch.bfloat16)],
            FUSED_DEVICES,
            Kernel.FUSED,
        ),
        ([torch.zeros(3)], [torch.ones(3)], frozenset(), Kernel.FOREACH),
        ([torch.zeros(3)], [torch.ones(3)], frozenset({"cuda"}), Kernel.FOREACH),
        ([torch.zeros(3)], [torch.ones(3, dtype=torch.float64)], FUSED_DEVICES, Kernel.PURE),
        (
            [torch.zeros(3, dtype=torch.complex64)],
            [torch.ones(3, dtype=torch.complex64)],
            FUSED_DEVICES,
            Kernel.PURE,
        ),
        ([torch.zeros(4, 3).t()], [torch.ones(3, 4)], FUSED_DEVICES, Kernel.FOREACH),
    ],
    ids=[
        "float32",
        "bfloat16",
        "not_fusable",
        "fused_on_cuda_only",
        "grad_dtype_differs",
        "complex",
        "transposed",
    ],
)
def test_select_kernel(params: Any, grads: Any, fused_on: frozenset[str], kernel: Kernel) -> None:
    assert select_kernel(params, grads, fused_on=fused_on) is kernel


def test_update_pieces_handles_non_contiguous_parameters() -> None:
    """A transposed parameter goes to the foreach kernels (fused ones walk memory in order)."""
    tx = adam(0.1, amsgrad=True)
    param, grad = torch.randn(4, 5).t(), torch.randn(5, 4)
    ref = param.clone()
    state, ref_state = tx.init([param]), tx.init([ref])
    for _ in range(3):
        update_pieces_(tx, [param], [grad], state)
        updates, ref_state = tx.update([grad], ref_state, [ref])
        ref = apply_updates([ref], updates)[0]
    assert_close([param.reshape(-1)], [ref.reshape(-1)], FLOAT32_RTOL)
