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


@pytest.mark.parametrize("record", TORCH_COMPAT, ids=ids)
def test_state_keys_are_the_keys_torch_keeps_in_its_order(record):
    p = torch.nn.Parameter(torch.ones(3))
    opt = record.torch_class([p], **FULL_STATE.get(record.torch_class, {}))
    p.grad = torch.full((3,), 0.5)
    opt.step()
    kept = [key for _, key, keeps in record.state_keys if keeps]
    assert list(opt.state[p]) == kept
    assert record.eager == (record.torch_class is torch.optim.Adagrad)


def test_only_the_exact_class_has_a_record():
    class Sub(torch.optim.Adam):
        pass

    assert torch_compat(torch.optim.Adam).factory.__name__ == "adam"
    assert torch_compat(Sub) is None
    assert len({r.torch_class for r in TORCH_COMPAT}) == len(TORCH_COMPAT) == 11


def test_a_record_refuses_state_keys_of_fields_its_state_lacks():
    sgd = torch_compat(torch.optim.SGD)
    with pytest.raises(ValueError, match=r"TorchCompat: expected state keys of TraceState"):
        TorchCompat(torch.optim.SGD, sgd.factory, sgd.state_type, (("nope", "x", True),))
