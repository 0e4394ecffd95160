"""Plain helpers and tables shared by the core tests (see [Note: shared test helpers])."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from shardopt.core.blocks import tree_map

Schedule = Callable[[torch.Tensor], Any]

# (factory name, learning rate, options): every factory, with a few option variants each. Used by
# test_func.py and test_purity.py. Not here: muon (2-D params only) and asgd (its float32 step
# size, as torch's, is too coarse for central differences in the lr): their own tests cover them.
FACTORY_CASES: list[tuple[str, float, dict[str, Any]]] = [
    ("sgd", 0.1, {}),
    ("sgd", 0.1, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    ("sgd", 0.1, {"momentum": 0.9, "dampening": 0.5, "maximize": True}),
    ("adam", 0.01, {}),
    ("adam", 0.01, {"amsgrad": True, "weight_decay": 0.01}),
    ("adamw", 0.01, {}),
    ("adamw", 0.01, {"amsgrad": True, "maximize": True}),
    ("adagrad", 0.1, {}),
    ("adagrad", 0.1, {"lr_decay": 0.01, "weight_decay": 0.01, "initial_accumulator_value": 0.1}),
    ("rmsprop", 0.01, {}),
    ("rmsprop", 0.01, {"centered": True, "momentum": 0.9, "weight_decay": 0.01}),
    ("adamax", 0.02, {}),
    ("adamax", 0.02, {"weight_decay": 0.01, "maximize": True}),
    ("nadam", 0.02, {}),
    ("nadam", 0.02, {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("radam", 0.01, {}),
    ("radam", 0.01, {"decoupled_weight_decay": True, "weight_decay": 0.01}),
    ("adadelta", 1.0, {}),
    ("adadelta", 1.0, {"rho": 0.95, "weight_decay": 0.01}),
    ("rprop", 0.01, {}),
    ("rprop", 0.01, {"etas": (0.4, 1.3), "step_sizes": (1e-4, 1.0)}),
    ("adafactor", 0.01, {}),
    ("adafactor", 0.01, {"eps": (1e-30, 1e-3), "d": 2.0, "weight_decay": 0.01, "maximize": True}),
]


def case_id(name: str, options: dict[str, Any]) -> str:
    """The id of a :data:`FACTORY_CASES` row: the factory name and its option names."""
    return "-".join([name, *options])


def option_id(options: dict[str, Any]) -> str:
    """The id of an options row: its ``k=v`` pairs, or ``defaults`` if it has none."""
    return ",".join(f"{k}={v}" for k, v in options.items()) or "defaults"


def is_matrix(params: Any) -> Any:
    """A mask of ``params``: True for the leaves of 2 or more dimensions."""
    return tree_map(lambda p: p.dim() >= 2, params)


def decay_label(params: Any) -> Any:
    """Labels of ``params``: ``"decay"`` for the leaves of 2 or more dimensions, else no_decay."""
    return tree_map(lambda p: "decay" if p.dim() >= 2 else "no_decay", params)


def skip_every_third(step: int, leaf: int) -> bool:
    """Each leaf gets no gradient on every third step (a different step for each leaf)."""
    return (step + leaf) % 3 == 0


def no_skip(step: int, leaf: int) -> bool:
    """Every leaf gets a gradient at every step."""
    return False


def learning_rate_and_skip(lr_kind: str, value: float) -> tuple[Any, Callable[[int, int], bool]]:
    """``value`` and no skips for ``"float_lr"``; else a float32 0-d tensor and skipped grads."""
    if lr_kind == "float_lr":
        return value, no_skip
    return torch.tensor(value), skip_every_third


def scheduled(cls: type[torch.optim.Optimizer], schedule: Schedule) -> type[torch.optim.Optimizer]:
    """``cls`` whose ``step`` first sets the lr to ``schedule(number of steps taken)``."""

    class Scheduled(cls):  # type: ignore[misc, valid-type]
        def step(self, closure: Any = None) -> Any:
            taken = getattr(self, "taken", 0)
            for group in self.param_groups:
                group["lr"] = float(schedule(torch.tensor(float(taken))))
            self.taken = taken + 1
            return super().step(closure)

    return Scheduled


def lambda_lr_scheduled(
    torch_cls: type[torch.optim.Optimizer], schedule: Schedule
) -> type[torch.optim.Optimizer]:
    """``torch_cls`` with ``lr=1`` and a LambdaLR setting the lr to ``schedule(step)`` each step."""

    class Scheduled(torch_cls):  # type: ignore[misc, valid-type]
        def __init__(self, params: Any, **kwargs: Any) -> None:
            super().__init__(params, lr=1.0, **kwargs)
            self.scheduler = torch.optim.lr_scheduler.LambdaLR(
                self, lambda step: float(schedule(torch.tensor(float(step))))
            )

        def step(self, closure: Any = None) -> Any:
            loss = super().step(closure)
            self.scheduler.step()
            return loss

    return Scheduled


def assert_torch_signature(ours: Callable[..., Any], theirs: Callable[..., Any]) -> None:
    """Each parameter of ``ours`` has the default and the kind of torch's parameter of its name."""
    torch_params = inspect.signature(theirs).parameters
    for name, param in inspect.signature(ours).parameters.items():
        assert param.default == torch_params[name].default, name
        assert param.kind == torch_params[name].kind, name


def assert_rejected_like_torch(
    factory: Callable[..., Any],
    torch_cls: type[torch.optim.Optimizer],
    kwargs: dict[str, Any],
    message: str,
) -> None:
    """``factory(**kwargs)`` raises a ValueError containing ``message``; torch also rejects them
    (torch 2.4 rejects a tensor hyperparameter of several elements with a RuntimeError)."""
    with pytest.raises(ValueError, match=re.escape(message)):
        factory(**kwargs)
    with pytest.raises((ValueError, RuntimeError)):
        torch_cls([torch.zeros(1, requires_grad=True)], **kwargs)


def torch_form(cls: Any, options: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``cls`` and ``options`` as this torch takes them: before 2.7, ``torch.optim.Adam`` has no
    ``decoupled_weight_decay``, and ``torch.optim.AdamW`` is that rule (same weight decay)."""
    key = "decoupled_weight_decay"
    if cls is not torch.optim.Adam or key not in options:
        return cls, options
    if key in inspect.signature(torch.optim.Adam).parameters:
        return cls, options
    rest = {k: v for k, v in options.items() if k != key}
    if not options[key]:
        return cls, rest
    return torch.optim.AdamW, {**rest, "weight_decay": rest.get("weight_decay", 0.0)}
