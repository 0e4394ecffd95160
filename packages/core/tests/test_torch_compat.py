"""The torch compatibility records: each names torch's hyperparameters and state keys exactly."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch

from shardopt.core.blocks import TORCH_COMPAT, TorchCompat, torch_compat

# Options that make torch create every state key it can (momentum buffers, amsgrad, centered).
FULL_STATE: dict[type, dict[str, Any]] = {
    torch.optim.SGD: {"lr": 0.1, "momentum": 0.9},
    torch.optim.Adam: {"amsgrad": True},
    torch.optim.AdamW: {"amsgrad": True},
    torch.optim.RMSprop: {"momentum": 0.9, "centered": True},
}
# torch arguments a factory does not take: they must stay at torch's default to map to core.
UNSUPPORTED = {"differentiable"}


def ids(record: TorchCompat) -> str:
    return record.torch_class.__name__


@pytest.mark.parametrize("record", TORCH_COMPAT, ids=ids)
def test_a_factory_takes_torchs_hyperparameters_by_name_with_torchs_defaults(record):
    theirs = dict(inspect.signature(record.torch_class.__init__).parameters)
    ours = dict(inspect.signature(record.factory).parameters)
    names = set(theirs) - {"self", "params"} - record.implementation
    assert names - set(ours) <= UNSUPPORTED, sorted(names - set(ours))
    for name in names & set(ours):
        default = theirs[name].default
        if isinstance(default, (int, float, bool, tuple)):
            assert ours[name].default == default, name


def _kept_keys(record: TorchCompat, param: torch.Tensor, options: dict[str, Any]) -> list[str]:
    """The keys of ``record`` torch keeps, less those whose core state leaf is None."""
    tx = record.factory(**options)
    state = next(s for s in tx.init([param.detach()]) if type(s) is record.state_type)
    return [
        key
        for name, key, keeps in record.state_keys
        if keeps and getattr(state, name)[0] is not None
    ]


# Shapes a record is checked on: Muon takes matrices only; Adafactor keeps other keys for them.
SHAPES = {"Muon": [(3, 2)], "Adafactor": [(3,), (3, 2), (2, 3, 2)]}


@pytest.mark.parametrize(
    ("record", "shape"),
    [(r, s) for r in TORCH_COMPAT for s in SHAPES.get(r.torch_class.__name__, [(3,)])],
    ids=lambda x: ids(x) if isinstance(x, TorchCompat) else "x".join(map(str, x)),
)
def test_state_keys_are_the_keys_torch_keeps_in_its_order(record, shape):
    p = torch.nn.Parameter(torch.ones(shape))
    options = FULL_STATE.get(record.torch_class, {})
    opt = record.torch_class([p], **options)
    p.grad = torch.full(shape, 0.5)
    opt.step()
    assert list(opt.state[p]) == _kept_keys(record, p, options)
    assert record.eager == (record.torch_class is torch.optim.Adagrad)


def test_only_the_exact_class_has_a_record():
    class Sub(torch.optim.Adam):
        pass

    assert torch_compat(torch.optim.Adam).factory.__name__ == "adam"
    assert torch_compat(Sub) is None
    newer = sum(not hasattr(torch.optim, name) for name in ("Muon", "Adafactor"))  # torch < 2.9
    assert len({r.torch_class for r in TORCH_COMPAT}) == len(TORCH_COMPAT) == 13 - newer


def test_a_record_refuses_state_keys_of_fields_its_state_lacks():
    sgd = torch_compat(torch.optim.SGD)
    with pytest.raises(ValueError, match=r"TorchCompat: expected state keys of TraceState"):
        TorchCompat(torch.optim.SGD, sgd.factory, sgd.state_type, (("nope", "x", True),))
