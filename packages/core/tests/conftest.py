"""Shared fixtures of the core tests: a mixed-shape pytree and a runner against torch.optim."""

from __future__ import annotations

import sys
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree

from shardopt.core import Transformation, apply_updates
from shardopt.core.blocks import tree_leaves

# [Note: shared test helpers]
# Fixtures live here; plain helpers and parameter tables that several test modules share (gradient
# skips, torch optimizers driven by a schedule, option ids, the factory table) live in
# _core_helpers.py. The tests run with --import-mode=importlib, where a test module can import
# neither conftest nor a sibling module by name, so this folder is put on sys.path; the module's
# name is unique across the packages' test folders, which share one sys.path and sys.modules.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

# Per-dtype relative tolerances of the equivalence tables (issue 2): the error of a tensor is
# max|ours - torch| / max(max|torch|, tiny), so a tensor near zero is judged on its scale.
RTOL = {torch.float64: 1e-12, torch.float32: 1e-6}


def make_params(dtype: torch.dtype, seed: int = 0) -> dict[str, Any]:
    """A pytree with 0-d, 1-d, 2-d and 4-d leaves, nested in dicts, lists and tuples."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)

    return {
        "scalar": rand(),
        "bias": rand(7),
        "weight": rand(5, 3),
        "conv": rand(2, 3, 2, 2),
        "nested": [rand(4), (rand(3, 3),)],
    }


def rel_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    """max|ours - ref| / max|ref| (a tiny floor keeps an all-zero reference finite)."""
    scale = max(ref.abs().max().item(), torch.finfo(ref.dtype).tiny) if ref.numel() else 1.0
    return (ours - ref).abs().max().item() / scale if ref.numel() else 0.0


@dataclass
class EquivalenceRun:
    """Both runs after the last step: our params/state and the torch optimizer."""

    params: Any  # our final pytree
    state: Any  # our final optimizer state
    torch_params: Any  # torch's final pytree (same structure)
    torch_opt: torch.optim.Optimizer
    names: list[str]  # leaf names, in leaf order

    def torch_state(self, key: str) -> list[torch.Tensor | None]:
        """``torch_opt.state[p][key]`` for each leaf in order (None where absent)."""
        leaves = pytree.tree_leaves(self.torch_params)
        return [self.torch_opt.state[p].get(key) for p in leaves]

    def assert_params_close(self, rtol: float | None = None) -> None:
        for name, a, b in zip(
            self.names, pytree.tree_leaves(self.params), pytree.tree_leaves(self.torch_params)
        ):
            tol = RTOL[b.dtype] if rtol is None else rtol
            err = rel_error(a, b.detach())
            assert err <= tol, f"param {name}: relative error {err:.3e} > {tol:.0e}"

    def assert_state_close(self, ours: list[Any], key: str, rtol: float | None = None) -> None:
        """Compares a list of our per-leaf state tensors with torch's ``state[p][key]``."""
        for name, a, b in zip(self.names, ours, self.torch_state(key)):
            assert b is not None, f"torch has no state {key!r} for {name}"
            tol = RTOL[b.dtype] if rtol is None else rtol
            if b.dtype not in RTOL and rtol is None:
                tol = RTOL[torch.float32]
            err = rel_error(a.to(b.dtype), b)
            assert err <= tol, f"state {key} of {name}: relative error {err:.3e} > {tol:.0e}"

    def assert_params_equal(self) -> None:
        """Bitwise equality of every parameter."""
        for name, a, b in zip(
            self.names, pytree.tree_leaves(self.params), pytree.tree_leaves(self.torch_params)
        ):
            assert torch.equal(a, b.detach()), f"param {name} differs bitwise"

    def assert_state_equal(self, ours: list[torch.Tensor], key: str) -> None:
        """Bitwise equality of our per-leaf state tensors (cast to torch's dtype) with torch's."""
        for name, a, b in zip(self.names, ours, self.torch_state(key)):
            assert b is not None, f"torch has no state {key!r} for {name}"
            assert torch.equal(a.to(b.dtype), b), f"state {key} of {name} differs bitwise"

    def assert_state_matches(
        self, state: Any, keys: Mapping[str, str], *, bitwise: Collection[str] | None = None
    ) -> None:
        """For each ``key: field`` of ``keys``, the leaves of ``state.<field>`` against torch's
        ``state[p][key]``: close to tolerance, and bitwise equal for the keys in ``bitwise``
        (every key if ``None``)."""
        for key, field in keys.items():
            ours = tree_leaves(getattr(state, field))
            self.assert_state_close(ours, key)
            if bitwise is None or key in bitwise:
                self.assert_state_equal(ours, key)


def run_equivalence(
    tx: Transformation,
    torch_cls: Callable[..., torch.optim.Optimizer],
    torch_kwargs: dict[str, Any],
    dtype: torch.dtype,
    *,
    steps: int = 50,
    seed: int = 0,
    skip: Callable[[int, int], bool] = lambda step, leaf: False,
) -> EquivalenceRun:
    """Runs ``tx`` and ``torch_cls(**torch_kwargs)`` for ``steps`` on the same fresh random grads.

    ``skip(step, leaf_index)`` says which leaves get no gradient at a step (``None`` for us,
    ``p.grad = None`` for torch).
    """
    params = make_params(dtype, seed)
    leaves, spec = pytree.tree_flatten(params)
    names = [pytree.keystr(p) for p, _ in pytree.tree_flatten_with_path(params)[0]]
    torch_leaves = [p.clone().requires_grad_(True) for p in leaves]
    opt = torch_cls(torch_leaves, **torch_kwargs)
    state = tx.init(params)
    gen = torch.Generator().manual_seed(seed + 1)
    for step in range(steps):
        grads = [
            None
            if skip(step, i)
            else torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype)
            for i, p in enumerate(leaves)
        ]
        for tp, g in zip(torch_leaves, grads):
            tp.grad = None if g is None else g.clone()
        opt.step()
        updates, state = tx.update(pytree.tree_unflatten(grads, spec), state, params)
        params = apply_updates(params, updates)
        leaves = pytree.tree_leaves(params)
    return EquivalenceRun(params, state, pytree.tree_unflatten(torch_leaves, spec), opt, names)


@pytest.fixture
def equivalence() -> Callable[..., EquivalenceRun]:
    """The :func:`run_equivalence` runner."""
    return run_equivalence


@pytest.fixture
def mixed_params() -> Callable[..., dict[str, Any]]:
    """The :func:`make_params` factory."""
    return make_params
