"""The Transformation type, chain, and apply_updates."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, Protocol

import torch

from shardopt.core._kinds import WHOLE_TENSORS, Kind, declared, inherit_kind, with_kind
from shardopt.core._tree import PyTree, tree_map

__all__ = [
    "WHOLE_TENSORS",
    "EmptyState",
    "Transformation",
    "apply_updates",
    "chain",
    "identity",
    "inherit_whole_tensors",
    "init_count",
    "needs_whole_tensors",
    "with_whole_tensors",
]


class InitFn(Protocol):
    def __call__(self, params: PyTree) -> Any: ...


class UpdateFn(Protocol):
    def __call__(
        self, updates: PyTree, state: Any, params: PyTree | None = None
    ) -> tuple[PyTree, Any]: ...


class Transformation(NamedTuple):
    """A gradient transformation: two pure functions.

    ``state = init(params)`` builds the state; ``updates, state = update(grads, state, params)``
    maps gradients (or the updates of an earlier transformation) to updates. Neither function
    modifies its inputs. Updates are added to the parameters by :func:`apply_updates`.

    Gradient leaves may be ``None``: the parameter had no gradient this step, its update is
    ``None`` and its state is left as it was (as ``torch.optim`` skips it).
    """

    init: InitFn
    update: UpdateFn


class EmptyState(NamedTuple):
    """The state of a stateless transformation."""


def stateless(apply: Callable[[PyTree, PyTree | None], PyTree]) -> Transformation:
    """A transformation without state whose ``update`` returns ``apply(updates, params)``.

    The shared body of the stateless transformations (identity, scale, clipping, weight decay).

    Example:
        >>> import torch
        >>> tx = stateless(lambda updates, params: [2 * u for u in updates])
        >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))
        ([tensor([2.])], EmptyState())
    """

    def init(params: PyTree) -> EmptyState:
        del params
        return EmptyState()

    def update(
        updates: PyTree, state: EmptyState, params: PyTree | None = None
    ) -> tuple[PyTree, EmptyState]:
        return apply(updates, params), state

    # named after the function that made ``apply``, for messages (``undeclared_name``)
    update.__qualname__ = getattr(apply, "__qualname__", update.__qualname__)
    return Transformation(init, update)


def identity() -> Transformation:
    """A transformation that passes updates through unchanged.

    Example:
        >>> import torch
        >>> tx = identity()
        >>> tx.update([torch.ones(1)], tx.init([torch.zeros(1)]))[0]
        [tensor([1.])]
    """
    return with_kind(stateless(lambda updates, params: updates), Kind.ELEMENTWISE, "identity")


# [Note: whole tensors]
# Some transformations are not elementwise: Muon orthogonalizes each whole matrix, Adafactor
# factors each matrix's second moment into row and column means. Run on a 1-D slice of a flat
# buffer they would compute something else without an error, so they are marked (by the identity
# of ``tx.update``, as piece rules are, with a name for messages), ``chain``, ``masked`` and
# ``partition`` (and ``multi_steps``, ``inject_hyperparams``) carry the mark of any inner
# transformation, and ``update_pieces_`` refuses them.
# WHOLE_TENSORS lives in _kinds.py, beside the kinds it is kept in step with.


def with_whole_tensors(tx: Transformation, name: str = "the transformation") -> Transformation:
    """Marks ``tx`` as needing each parameter whole (not a flat slice) and returns ``tx``.

    Example:
        >>> from shardopt.core import identity
        >>> needs_whole_tensors(with_whole_tensors(identity(), "mine"))
        True
    """
    WHOLE_TENSORS[tx.update] = name
    found = declared(tx)
    if found is None or Kind.SHAPED not in found.kind:
        with_kind(tx, (found.kind if found else Kind.ELEMENTWISE) | Kind.SHAPED, name)
    return tx


def needs_whole_tensors(tx: Transformation) -> bool:
    """Whether ``tx``, or a transformation it is built from, needs each parameter whole.

    Example:
        >>> from shardopt.core import adafactor, masked, muon, sgd
        >>> from shardopt.core.blocks import needs_whole_tensors
        >>> needs_whole_tensors(muon()), needs_whole_tensors(masked(adafactor(), [True]))
        (True, True)
        >>> needs_whole_tensors(sgd(0.1))
        False
    """
    return tx.update in WHOLE_TENSORS


def inherit_whole_tensors(tx: Transformation, inner: Iterable[Transformation]) -> Transformation:
    """Marks ``tx``, a combinator of ``inner``, if one of ``inner`` needs whole tensors."""
    members = tuple(inner)
    name = next((WHOLE_TENSORS[t.update] for t in members if t.update in WHOLE_TENSORS), None)
    return inherit_kind(tx if name is None else with_whole_tensors(tx, name), members)


def chain(*transformations: Transformation) -> Transformation:
    """Applies transformations one after the other; the state is the tuple of their states.

    The chain needs whole tensors if one of them does (see [Note: whole tensors]).

    Example:
        >>> import torch
        >>> from shardopt.core import scale
        >>> tx = chain(scale(2.0), scale(-0.5))
        >>> tx.update([torch.ones(2)], tx.init([torch.zeros(2)]))[0]
        [tensor([-1., -1.])]
    """
    txs = tuple(transformations)

    def init(params: PyTree) -> tuple[Any, ...]:
        return tuple(tx.init(params) for tx in txs)

    def update(
        updates: PyTree, state: tuple[Any, ...], params: PyTree | None = None
    ) -> tuple[PyTree, tuple[Any, ...]]:
        if len(state) != len(txs):
            raise ValueError(f"chain: expected a state of {len(txs)} parts, got {len(state)}")
        new_state = []
        for tx, s in zip(txs, state):
            updates, s = tx.update(updates, s, params)
            new_state.append(s)
        return updates, tuple(new_state)

    return inherit_whole_tensors(Transformation(init, update), txs)


def apply_updates(params: PyTree, updates: PyTree) -> PyTree:
    """Returns ``params + updates`` leaf by leaf (a new tree; ``None`` updates leave a leaf as is).

    Example:
        >>> import torch
        >>> apply_updates({"w": torch.ones(2)}, {"w": torch.full((2,), -0.5)})
        {'w': tensor([0.5000, 0.5000])}
    """

    def add(p: torch.Tensor | None, u: torch.Tensor | None) -> torch.Tensor | None:
        if p is None or u is None:
            return p
        return p + u.to(p.dtype)

    return tree_map(add, params, updates)


def init_count(params: PyTree) -> PyTree:
    """A per-parameter step count: a float32 0-d tensor on each parameter's device, zero.

    [Note: per-parameter step counts]
    ``torch.optim`` keeps ``state["step"]`` per parameter and does not advance it for a parameter
    without a gradient. Keeping one count per leaf (not one per tree, as optax does) is what makes
    skipped parameters, bias corrections and state dicts agree with torch exactly. Counts are
    float32 tensors, like torch's, so they can be traced by ``torch.func``.
    """
    return tree_map(
        lambda p: None if p is None else torch.zeros((), dtype=torch.float32, device=p.device),
        params,
    )
