"""Where ``shardopt plan`` gets parameters: a preset, a ``module:function`` factory, or JSON."""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from shardopt.cli._plan_cli_predict import ParamSpec
from shardopt.cli.models import PRESETS
from shardopt.core import TensorSpec

__all__ = ["load_params", "params_of"]

# [Note: shapes JSON]
# A JSON file of shapes is a list whose items are a shape (``[768, 3072]``), a
# ``[shape, dtype]`` pair, or an object ``{"shape": [...], "dtype": "bfloat16", "name": "w",
# "trainable": false}`` (all keys but ``shape`` optional); or an object mapping names to such
# items. The dtype defaults to float32, the name to ``params[i]``.


def params_of(source: nn.Module | Iterable[Any]) -> list[ParamSpec]:
    """The ParamSpecs of a module's parameters, or of an iterable of tensors or (name, tensor).

    Example:
        >>> with torch.device("meta"):
        ...     model = nn.Linear(3, 2)
        >>> [(p.name, p.spec.shape) for p in params_of(model)]
        [('weight', (2, 3)), ('bias', (2,))]
    """
    items = source.named_parameters() if isinstance(source, nn.Module) else source
    out = []
    for i, item in enumerate(items):
        name, tensor = item if isinstance(item, tuple) else (f"params[{i}]", item)
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"plan: expected tensors from the factory, got {type(tensor).__name__}")
        out.append(ParamSpec(name, TensorSpec.from_tensor(tensor), tensor.requires_grad))
    if not out:
        raise ValueError("plan: expected at least one parameter, got none")
    return out


def _json_item(name: str, item: Any) -> ParamSpec:
    where = f"plan: shapes JSON item {name}"
    if isinstance(item, dict):
        unknown = set(item) - {"shape", "dtype", "name", "trainable"}
        if "shape" not in item or unknown:
            raise ValueError(
                f"{where}: expected a 'shape' key and no others than dtype, name, "
                f"trainable, got keys {sorted(item)}"
            )
        shape, dtype = item["shape"], item.get("dtype", "float32")
        name, trainable = item.get("name", name), item.get("trainable", True)
    elif isinstance(item, list) and len(item) == 2 and isinstance(item[1], str):
        (shape, dtype), trainable = item, True
    else:
        shape, dtype, trainable = item, "float32", True
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise ValueError(f"{where}: expected a shape as a list of ints >= 0, got {shape!r}")
    if not isinstance(trainable, bool):
        raise ValueError(f"{where}: expected trainable true or false, got {trainable!r}")
    try:
        spec = TensorSpec(tuple(shape), dtype, "cpu")
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return ParamSpec(str(name), spec, trainable)


def _from_json(path: str) -> list[ParamSpec]:
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
    except OSError as exc:
        raise ValueError(f"plan: cannot read {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"plan: {path} is not valid JSON: {exc}") from None
    if isinstance(data, dict):
        items = list(data.items())
    elif isinstance(data, list):
        items = [(f"params[{i}]", item) for i, item in enumerate(data)]
    else:
        raise ValueError(f"plan: expected a JSON list or object of shapes in {path}")
    if not items:
        raise ValueError(f"plan: expected at least one shape in {path}, got none")
    return [_json_item(name, item) for name, item in items]


def _from_factory(target: str) -> list[ParamSpec]:
    module_name, _, attr = target.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` does: modules of this directory
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"plan: cannot load the factory {target!r}: {exc}") from None
    with torch.device("meta"):
        model = factory()
    return params_of(model)


def load_params(source: str, dtype: torch.dtype | None = None) -> list[ParamSpec]:
    """The parameters of a preset name, a ``module:function`` or a ``.json`` path.

    Factories are called without arguments under ``torch.device("meta")`` (no memory is used)
    and may return a module or an iterable of tensors. ``dtype`` casts the floating parameters
    (like ``model.to(dtype)``). See [Note: shapes JSON].

    Example:
        >>> [p.spec.shape for p in load_params("mlp-12x1024")][:2]
        [(1024, 1024), (1024,)]
    """
    if source in PRESETS:
        with torch.device("meta"):
            params = params_of(PRESETS[source]())
    elif ":" in source and not os.path.exists(source):
        params = _from_factory(source)
    elif source.endswith(".json") or os.path.exists(source):
        params = _from_json(source)
    else:
        raise ValueError(
            f"plan: expected a preset ({', '.join(PRESETS)}), a module:function or a JSON "
            f"file, got {source!r}"
        )
    if dtype is None:
        return params
    out = []
    for p in params:
        floating = getattr(torch, p.spec.dtype).is_floating_point
        spec = TensorSpec(p.spec.shape, str(dtype).removeprefix("torch."), p.spec.device)
        out.append(ParamSpec(p.name, spec, p.trainable) if floating else p)
    return out
