"""Hyperparameters in the optimizer state: ``inject_hyperparams`` and ``set_hyperparams``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch.utils import _pytree as pytree

from shardopt.core._base import Transformation, inherit_whole_tensors
from shardopt.core._pieces import PreparedPieces, prepare_pieces, update_pieces_, with_piece_rule
from shardopt.core._tree import PyTree

__all__ = ["InjectHyperparamsState", "InjectedHyperparams", "inject_hyperparams", "set_hyperparams"]

Factory = Callable[..., Transformation]

# [Note: hyperparameters in the state]
# An optimizer is Transformation(init, update), two pure functions; a hyperparameter that changes
# at run time (a learning rate under a scheduler) lives in the state, not in the closures:
# ``inject_hyperparams(factory, **hyperparams)`` keeps ``hyperparams`` in its state beside the
# state of ``factory(**hyperparams)``, and each ``update`` builds ``factory(**state.hyperparams)``
# afresh (closures, a few microseconds) and runs it, through its piece rule on flat buffers (which
# keeps the transformation of the last values it saw, compared as ``set_hyperparams`` compares
# them: the sharding engine updates bucket after bucket with the same values). So a
# new value is a new state, ``set_hyperparams(state, lr=...)``, and nothing else is rebuilt: the
# sharding engine keeps its plan, buffers and collectives, and the inner state objects (the
# moments, the counts) are shared by the old and the new state.
#
# Values keep their Python type. torch.optim computes with a float lr in double precision on the
# host (``lr / bias_correction`` as Python floats, ``add_(u, alpha=-lr)``) and with a tensor lr in
# tensor arithmetic in its dtype: the two round differently. A float stays a float and a 0-d
# tensor stays that tensor (the same object), so the injected optimizer is bitwise equal to
# torch.optim under the same scheduler wherever the plain factory is. Only a list becomes a
# tuple: a list of tensors is what the sharding engine takes for a per-parameter field.
#
# What cannot change is the *structure* of the inner state: the state was built by
# ``factory(**old).init``, and the new values must give a transformation that reads the same
# tree. SGD's momentum from 0 (a momentum buffer appears), Adam's amsgrad (``nu_max``),
# RMSprop's centered (``grad_avg``), a weight decay from 0 where it adds a transformation to the
# chain: ``set_hyperparams`` compares ``tree_structure`` of ``factory(**old).init(probe)`` and
# ``factory(**new).init(probe)`` for a one-element probe (when a value changes) and refuses a
# difference; set those at construction. New values are validated by the factory itself.
#
# The values dict is an ``InjectedHyperparams``: a dict that also knows its factory (so that
# ``set_hyperparams`` can validate with the state alone), registered as a pytree node whose
# children are the values (under the dict's keys) and whose context holds the factory. Tree
# functions see and rebuild it like a dict (``torch.func``, ``tree_map``), the factory included.
# It also remembers the probe's tree structure once computed: every change ``set_hyperparams``
# takes keeps it, so the next change probes the new values only (a rebuilt dict forgets it).


class InjectedHyperparams(dict[str, Any]):
    """The hyperparameters of an :func:`inject_hyperparams` state: name -> value, and the
    ``factory`` they are for (see [Note: hyperparameters in the state])."""

    __slots__ = ("factory", "structure")

    def __init__(self, factory: Factory, values: Mapping[str, Any], structure: Any = None) -> None:
        super().__init__(values)
        self.factory = factory
        self.structure = structure  # of factory(**values).init(probe), once known

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.factory, dict(self)))


def _flatten(h: InjectedHyperparams) -> tuple[list[Any], Any]:
    keys = tuple(h)
    return [h[k] for k in keys], (h.factory, keys)


def _flatten_with_keys(h: InjectedHyperparams) -> tuple[list[tuple[Any, Any]], Any]:
    values, context = _flatten(h)
    return [(pytree.MappingKey(k), v) for k, v in zip(context[1], values)], context


def _unflatten(values: Iterable[Any], context: Any) -> InjectedHyperparams:
    factory, keys = context
    return InjectedHyperparams(factory, dict(zip(keys, values)))


pytree.register_pytree_node(
    InjectedHyperparams,
    _flatten,
    _unflatten,
    serialized_type_name="shardopt.core.InjectedHyperparams",
    flatten_with_keys_fn=_flatten_with_keys,
)


class InjectHyperparamsState(NamedTuple):
    """The state of :func:`inject_hyperparams`: the hyperparameters (name -> value, each of the
    type it was given) and ``inner``, the state of ``factory(**hyperparams)``."""

    hyperparams: dict[str, Any]
    inner: Any


def _name(factory: Factory) -> str:
    return getattr(factory, "__name__", repr(factory))


def _stored(values: Mapping[str, Any]) -> dict[str, Any]:
    """The values as the state keeps them: as given, a list as a tuple."""
    return {k: tuple(v) if type(v) is list else v for k, v in values.items()}


def inject_hyperparams(factory: Factory, **hyperparams: Any) -> Transformation:
    """``factory(**hyperparams)`` whose hyperparameters live in its state, to be changed between
    steps by :func:`set_hyperparams` (see [Note: hyperparameters in the state]).

    Each ``update`` runs ``factory(**state.hyperparams)``; on flat buffers its piece rule
    (:func:`~shardopt.core.update_pieces_`) runs in place. Every argument given is a hyperparameter
    of the state; the factory's other arguments keep their defaults. It needs whole tensors if
    ``factory(**hyperparams)`` does (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> from shardopt.core import apply_updates, sgd
        >>> tx = inject_hyperparams(sgd, lr=0.5)
        >>> params = [torch.ones(2)]
        >>> state = tx.init(params)
        >>> state = set_hyperparams(state, lr=0.25)
        >>> updates, state = tx.update([torch.ones(2)], state, params)
        >>> apply_updates(params, updates), state.hyperparams
        ([tensor([0.7500, 0.7500])], {'lr': 0.25})

    Raises:
        ValueError: for values the factory rejects (its own message), e.g.
            ``sgd: expected 0 <= lr, got -1.0``.
    """
    values = _stored(hyperparams)
    built = factory(**values)  # the factory's validation, at construction

    def init(params: PyTree) -> InjectHyperparamsState:
        return InjectHyperparamsState(InjectedHyperparams(factory, values), built.init(params))

    def update(
        updates: PyTree, state: InjectHyperparamsState, params: PyTree | None = None
    ) -> tuple[PyTree, InjectHyperparamsState]:
        updates, inner = factory(**state.hyperparams).update(updates, state.inner, params)
        return updates, InjectHyperparamsState(state.hyperparams, inner)

    last: list[Any] = [values, built]  # the values of the last flat update, their transformation

    def current(state: Any) -> Transformation:
        if not _same_values(last[0], state.hyperparams):
            last[:] = [dict(state.hyperparams), factory(**state.hyperparams)]
        return last[1]

    def rule(params: list[torch.Tensor], grads: list[torch.Tensor | None], state: Any) -> None:
        update_pieces_(current(state), params, grads, state.inner)

    def prepare(params: list[torch.Tensor], state: Any, base: Any = None) -> Any:
        return _prepared(current, params, state, base)

    tx = with_piece_rule(Transformation(init, update), rule, prepare)
    return inherit_whole_tensors(tx, [built])  # [Note: whole tensors]


def _prepared(
    current: Callable[[Any], Transformation], params: list[torch.Tensor], state: Any, base: Any
) -> PreparedPieces | None:
    """The preparer of an inject_hyperparams transformation: its current transformation's,
    prepared again (reusing the walk) when the values change ([Note: prepared pieces])."""
    inner = state.inner
    tx = current(state)
    prepared = prepare_pieces(tx, params, inner, base)
    if prepared is None:
        return None
    held: list[Any] = [tx, prepared]

    def update(grads: list[torch.Tensor], state: Any) -> bool:
        tx = current(state)
        if tx is not held[0]:
            again = prepare_pieces(tx, params, inner, getattr(held[1], "base", None))
            if again is None:
                return False
            held[:] = [tx, again]
        return bool(held[1](grads, state.inner))

    update.base = getattr(prepared, "base", None)  # type: ignore[attr-defined]
    return update


def _same(a: Any, b: Any) -> bool:
    """Equal values: tensors by identity (their values are not read), tuples element by element."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return bool(a == b)


def _same_values(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_same(x, b[k]) for k, x in a.items())


def _probe(values: Mapping[str, Any]) -> list[torch.Tensor]:
    """A one-element parameter, on the device of the first tensor among ``values`` (or the CPU)."""
    tensors = [x for x in pytree.tree_leaves(dict(values)) if isinstance(x, torch.Tensor)]
    return [torch.zeros(1, device=tensors[0].device if tensors else None)]


def _described(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in changes.items())


def set_hyperparams(state: InjectHyperparamsState, **changes: Any) -> InjectHyperparamsState:
    """A new :func:`inject_hyperparams` state with ``changes`` applied (pure: ``state`` is kept,
    the new state shares its inner state objects). See [Note: hyperparameters in the state].

    Example:
        >>> import torch
        >>> from shardopt.core import adam
        >>> state = inject_hyperparams(adam, lr=0.1).init([torch.zeros(2)])
        >>> new = set_hyperparams(state, lr=0.05)
        >>> new.hyperparams["lr"], state.hyperparams["lr"], new.inner is state.inner
        (0.05, 0.1, True)

    Raises:
        ValueError: ``state`` is not an :func:`inject_hyperparams` state; a name that is not
            one of its hyperparameters, e.g. ``set_hyperparams: expected hyperparameters of
            adam among ['lr'], got lrr=0.1``; a value the factory rejects (its message,
            prefixed), e.g. ``set_hyperparams: adam: expected 0 <= lr, got -1.0``; a change
            of the inner state's structure, e.g. ``set_hyperparams: expected changes that keep
            the structure of the state of sgd (set them at construction), got momentum=0.9``.
    """
    old = state.hyperparams if isinstance(state, InjectHyperparamsState) else None
    if not isinstance(old, InjectedHyperparams):
        raise ValueError(
            f"set_hyperparams: expected the state of inject_hyperparams, got {type(state).__name__}"
        )
    factory = old.factory
    unknown = {k: v for k, v in changes.items() if k not in old}
    if unknown:
        raise ValueError(
            f"set_hyperparams: expected hyperparameters of {_name(factory)} among {sorted(old)}, "
            f"got {_described(unknown)}"
        )
    new = {**old, **_stored(changes)}
    try:
        tx = factory(**new)
    except ValueError as exc:
        raise ValueError(f"set_hyperparams: {exc}") from None
    changed = {k: v for k, v in changes.items() if not _same(new[k], old[k])}
    structure = old.structure
    if changed:
        probe = _probe(new)
        if structure is None:
            structure = pytree.tree_structure(factory(**old).init(probe))
        if pytree.tree_structure(tx.init(probe)) != structure:
            raise ValueError(
                "set_hyperparams: expected changes that keep the structure of the state of "
                f"{_name(factory)} (set them at construction), got {_described(changed)}"
            )
    return InjectHyperparamsState(InjectedHyperparams(factory, new, structure), state.inner)
