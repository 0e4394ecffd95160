"""How a transformation reads its inputs: the kind that decides how it can be sharded.

[Note: kinds]
A transformation's update of one element may read:
- only that element's own gradient, parameter and state (``Kind.ELEMENTWISE``: Adam, SGD, Lion):
  any cut of the tensors is fine, each rank steps its slices;
- reductions over each whole tensor (``Kind.PER_TENSOR``: the trust ratios of LAMB and LARS,
  NovoGrad's per-tensor second moment): a slice is fine if those reductions are taken over the
  whole tensor, which the reduction blocks of ``_reduce.py`` do wherever they run;
- reductions over every parameter (``Kind.WHOLE_TREE``: ``clip_by_global_norm``, a step skipped
  when any gradient is not finite): likewise, over the whole tree;
- the tensor in its shape (``Kind.SHAPED``: Muon's orthogonalization, Adafactor's row and column
  means, adaptive gradient clipping's per-row norms, gradient centralization): only whole
  tensors in their shapes will do, so a plan that cuts one is refused.
Kinds are flags: a chain of a whole-tree clip and a per-tensor trust ratio is both. The kind is
recorded by the identity of ``tx.update`` (a NamedTuple carries no attributes), with a name for
messages, by :func:`with_kind`; combinators derive theirs from their members (their union), and a
transformation whose kind nobody declared has none (``kind_of`` returns None): ``shard`` then
probes it (``probe_kind``) and refuses it unless the probe finds it elementwise.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

__all__ = [
    "Kind",
    "Declared",
    "declared",
    "inherit_kind",
    "kind_of",
    "undeclared_name",
    "with_kind",
]


class Kind(enum.Flag):
    """How a transformation reads its inputs (see [Note: kinds] in ``_kinds.py``).

    Example:
        >>> Kind.WHOLE_TREE in (Kind.PER_TENSOR | Kind.WHOLE_TREE), bool(Kind.ELEMENTWISE)
        (True, False)
    """

    ELEMENTWISE = 0
    PER_TENSOR = 1
    WHOLE_TREE = 2
    SHAPED = 4


class Declared(NamedTuple):
    """A declared kind and the name messages give the transformation that has it (for a
    combinator: the name of the member that made it so)."""

    kind: Kind
    name: str


_KINDS: weakref.WeakKeyDictionary[Callable[..., Any], Declared] = weakref.WeakKeyDictionary()
# The older mark of [Note: whole tensors] (_base.py), kept in step with Kind.SHAPED.
WHOLE_TENSORS: weakref.WeakKeyDictionary[Callable[..., Any], str] = weakref.WeakKeyDictionary()
# a combinator left undeclared -> its first undeclared member
_UNDECLARED: weakref.WeakKeyDictionary[Callable[..., Any], Any] = weakref.WeakKeyDictionary()


def undeclared_name(tx: Any) -> str:
    """The name of the transformation inside ``tx`` that left it undeclared: its own, or that
    of the first undeclared member of a combinator, by its function's qualified name (the
    function that made it, for a closure: ``my_trust_ratio`` for ``my_trust_ratio.<locals>``).

    Example:
        >>> from shardopt.core import adam, chain
        >>> from shardopt.core.blocks import stateless, undeclared_name
        >>> def my_rule():
        ...     return stateless(lambda updates, params: updates)
        >>> undeclared_name(chain(my_rule(), adam(1e-3)))
        'my_rule'
    """
    while tx.update in _UNDECLARED:
        tx = _UNDECLARED[tx.update]
    qualname = getattr(tx.update, "__qualname__", None) or repr(tx.update)
    return qualname.split(".<locals>")[0]


def with_kind(tx: Any, kind: Kind, name: str) -> Any:
    """Declares how ``tx`` reads its inputs and returns ``tx`` (a ``Transformation``).

    Example:
        >>> from shardopt.core import identity
        >>> from shardopt.core.blocks import Kind, kind_of, with_kind
        >>> kind_of(with_kind(identity(), Kind.PER_TENSOR, "mine"))
        <Kind.PER_TENSOR: 1>
    """
    if not isinstance(kind, Kind):
        raise TypeError(f"with_kind: expected a shardopt.core.blocks.Kind, got {kind!r}")
    _KINDS[tx.update] = Declared(kind, name)
    if Kind.SHAPED in kind:  # the older mark, which update_pieces_ and the plans read
        WHOLE_TENSORS[tx.update] = name
    return tx


def declared(tx: Any) -> Declared | None:
    """The declared kind of ``tx`` with its name, or None where nothing was declared."""
    found = _KINDS.get(tx.update)
    if found is not None:
        return found
    name = WHOLE_TENSORS.get(tx.update)  # marked by with_whole_tensors only
    return None if name is None else Declared(Kind.SHAPED, name)


def kind_of(tx: Any) -> Kind | None:
    """How ``tx`` reads its inputs, or None where that was not declared (see [Note: kinds]).

    Example:
        >>> from shardopt.core import chain, clip, clip_by_global_norm, muon
        >>> from shardopt.core.blocks import kind_of
        >>> kind_of(clip(1.0)), kind_of(muon())
        (<Kind.ELEMENTWISE: 0>, <Kind.SHAPED: 4>)
        >>> kind_of(chain(clip_by_global_norm(1.0), clip(1.0)))
        <Kind.WHOLE_TREE: 2>
    """
    found = declared(tx)
    return None if found is None else found.kind


def inherit_kind(tx: Any, inner: Iterable[Any]) -> Any:
    """Declares combinator ``tx`` of ``inner`` with the union of their kinds, named after the
    first member that is not elementwise; leaves it undeclared if a member is undeclared."""
    kind, name = Kind.ELEMENTWISE, "the transformation"
    for member in inner:
        found = declared(member)
        if found is None:
            _UNDECLARED[tx.update] = member  # what messages name ([Note: the kind probe])
            return tx
        if found.kind & ~kind and name == "the transformation":
            name = found.name
        kind |= found.kind
    return with_kind(tx, kind, name)
