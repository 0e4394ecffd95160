"""Injected hyperparameters in checkpoints: saved by value, checked and set again on load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from shardopt.core import set_hyperparams
from shardopt.functional.checkpoint._checkpoint_keys import sanitised_key
from shardopt.functional.engine._state import ShardedState, injected_states

__all__ = [
    "HyperparamWrites",
    "checked_hyperparams",
    "hyperparam_placeholders",
    "saved_hyperparams",
    "typed_like",
    "write_hyperparams",
]

# (the live hyperparameter dict of an injected state, its checked new values)
HyperparamWrites = list[tuple[dict[str, Any], dict[str, Any]]]

# [Note: hyperparameters of a sharded state]
# ``shard(inject_hyperparams(factory, lr=...), plan)`` keeps the hyperparameters in
# ``state.inner`` ([Note: hyperparameters in the state] in shardopt.core). The engine reads them
# and never shards them: they are the same on every rank and no update writes them. So they are
# not fields (a list is kept as a tuple), do not stop the per-bucket update ([Note: update and
# gather pipeline]) and are not the replicated tensors of ``outside_tensors`` (a 0-d tensor lr
# included), nor torch.optim state (its ``param_groups`` are the caller's, as before). A new
# value is a new state, ``state._replace(inner=set_hyperparams(state.inner, lr=...))``: the
# plan, buffers, fields and hooks are kept, nothing is re-sharded. Checkpoints keep them: the
# sharded state dict under ``"hyperparams"`` and DCP under ``optim.hyperparams.<key>``, ``key``
# the sanitised path of the value (``lr`` for a state injected at the top). A load checks the
# saved values with ``set_hyperparams`` (the factory's validation, the same state structure),
# then, with everything else, writes them into the state's hyperparameter dicts in place, as it
# writes the state's tensors in place. DCP loads the ones its checkpoint has (one saved without
# them leaves the state's as they are).


def _entries(state: ShardedState) -> dict[str, tuple[Any, str]]:
    """key -> (injected state, hyperparameter name), for every injected hyperparameter."""
    out: dict[str, tuple[Any, str]] = {}
    for path, injected in injected_states(state.inner):
        for name in injected.hyperparams:
            key = sanitised_key(f"{path}.{name}")
            if key in out:
                raise ValueError(f"checkpoints: expected distinct hyperparameter keys, got {key}")
            out[key] = (injected, name)
    return out


def saved_hyperparams(state: ShardedState) -> dict[str, Any]:
    """The injected hyperparameters of ``state`` by checkpoint key, as they are (not copied).

    Example:
        >>> from types import SimpleNamespace
        >>> from shardopt.core import adam, inject_hyperparams
        >>> inner = inject_hyperparams(adam, lr=0.1).init([torch.zeros(2)])
        >>> saved_hyperparams(SimpleNamespace(inner=inner))
        {'lr': 0.1}
    """
    return {key: s.hyperparams[name] for key, (s, name) in _entries(state).items()}


def hyperparam_placeholders(state: ShardedState, keys: set[str]) -> dict[str, Any]:
    """What a DCP load fills in for the ``keys`` (those its checkpoint has): a fresh tensor of
    the value's shape and dtype, the value itself otherwise (DCP replaces it)."""

    def fresh(x: Any) -> Any:
        return torch.empty_like(x) if isinstance(x, torch.Tensor) else x

    return {k: pytree.tree_map(fresh, v) for k, v in saved_hyperparams(state).items() if k in keys}


def _same_type(live: Any, loaded: Any) -> bool:
    """Whether ``loaded`` has the type structure of ``live`` (tensors: shape and dtype too)."""
    if isinstance(live, torch.Tensor):
        return (
            isinstance(loaded, torch.Tensor)
            and loaded.shape == live.shape
            and loaded.dtype == live.dtype
        )
    if type(loaded) is not type(live):
        return False
    if isinstance(live, (tuple, list)):
        return len(live) == len(loaded) and all(map(_same_type, live, loaded))
    if isinstance(live, dict):
        return live.keys() == loaded.keys() and all(_same_type(live[k], loaded[k]) for k in live)
    return live is None or isinstance(live, (bool, int, float, complex, str))


def typed_like(api: str, state: ShardedState, loaded: Mapping[str, Any]) -> dict[str, Any]:
    """``loaded`` (key -> value read from a checkpoint), each value checked to have the type of
    the state's own (a tuple of two floats for betas, a 0-d float32 tensor, ...).

    Raises:
        ValueError: e.g. ``load_checkpoint: expected the hyperparameter lr of type float, got
            str``.
    """
    live = saved_hyperparams(state)
    for key, value in loaded.items():
        if key not in live or not _same_type(live[key], value):
            want = type(live.get(key)).__name__
            raise ValueError(
                f"{api}: expected the hyperparameter {key} of type {want} as in the state, got "
                f"{type(value).__name__}"
            )
    return dict(loaded)


def checked_hyperparams(
    api: str, state: ShardedState, saved: Any, *, every: bool
) -> HyperparamWrites:
    """The writes that set ``saved`` (key -> value) into ``state``, each value checked first.

    With ``every``, ``saved`` must have exactly the keys of ``state``'s hyperparameters; else it
    may leave some out (they keep their values).

    Raises:
        ValueError: other keys, or a value ``set_hyperparams`` refuses, e.g.
            ``load_sharded_state_dict: set_hyperparams: adam: expected 0 <= lr, got -1.0``.
    """
    entries = _entries(state)
    if not isinstance(saved, Mapping) or not set(saved) <= set(entries):
        got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
        raise ValueError(f"{api}: expected hyperparameters among {sorted(entries)}, got {got}")
    if every and set(saved) != set(entries):
        raise ValueError(f"{api}: expected hyperparameters {sorted(entries)}, got {sorted(saved)}")
    changes: dict[int, tuple[Any, dict[str, Any]]] = {}
    for key, value in saved.items():
        injected, name = entries[key]
        changes.setdefault(id(injected), (injected, {}))[1][name] = value
    writes: HyperparamWrites = []
    for injected, values in changes.values():
        try:
            checked = set_hyperparams(injected, **values)
        except ValueError as exc:
            raise ValueError(f"{api}: {exc}") from None
        writes.append((injected.hyperparams, dict(checked.hyperparams)))
    return writes


def write_hyperparams(writes: HyperparamWrites) -> None:
    """Sets the checked values of :func:`checked_hyperparams` into the live dicts."""
    for live, values in writes:
        live.update(values)
