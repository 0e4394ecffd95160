"""Building blocks for writing transformations (and sharded optimizers) on shardopt.core.

A training loop needs none of these; a new optimizer or an engine on top of core does: pytree
helpers, ``leafwise`` (one rule per leaf, with counts), ``init_count``, schedules' ``resolve``,
piece rules (the fast path over flat buffers, see [Note: piece fast path]) and the mark of what
cannot run on flat slices ([Note: whole tensors]), the validated hyperparameters that the fused
optimizers run from (every optimizer keeps its own in a frozen ``<Name>Hyperparams``), and the
torch compatibility record of every optimizer ([Note: torch compatibility records]).

Writing a transformation that shards exactly: declare how it reads its inputs with
``with_kind`` (``Kind.ELEMENTWISE``, ``PER_TENSOR``, ``WHOLE_TREE``, ``SHAPED``: see
[Note: kinds]), and take every reduction over a whole tensor or over the tree through the
reduction blocks (``tensor_norm``, ``tree_sum_sq``, ...: see [Note: reductions across shards]),
called unconditionally. An undeclared transformation is probed by ``shard`` (``probe_kind``).
"""

from shardopt.core._adagrad import AdagradHyperparams
from shardopt.core._adam import AdamHyperparams
from shardopt.core._base import init_count, needs_whole_tensors, stateless, with_whole_tensors
from shardopt.core._combinators import PartitionRule, partition_rule, whole_tensor_mask
from shardopt.core._kinds import (
    Declared,
    Kind,
    declared,
    inherit_kind,
    kind_of,
    undeclared_name,
    with_kind,
)
from shardopt.core._moments import bias_correction, update_moment, update_moment_per_elem_norm
from shardopt.core._pieces import (
    PiecePreparer,
    PieceRule,
    PreparedPieces,
    piece_rule,
    prepare_pieces,
    update_whole_,
    with_piece_rule,
)
from shardopt.core._plan_spec import local_tensor
from shardopt.core._probe import probe_kind
from shardopt.core._reduce import (
    Reducer,
    Scope,
    current_scope,
    in_scope,
    safe_norm,
    sub_scope,
    tensor_max_abs,
    tensor_norm,
    tensor_norms,
    tensor_sum,
    tensor_sum_sq,
    tree_max_abs,
    tree_nonfinite_count,
    tree_norm,
    tree_sum_sq,
    whole_reference,
)
from shardopt.core._renamed import renamed_getattr
from shardopt.core._schedules import resolve
from shardopt.core._sgd import SGDHyperparams
from shardopt.core._torch_compat import TORCH_COMPAT, TorchCompat, torch_compat
from shardopt.core._tree import (
    PyTree,
    leafwise,
    tree_leaves,
    tree_map,
    tree_structure,
    zeros_like_tree,
)

__all__ = [
    "bias_correction",
    "update_moment",
    "update_moment_per_elem_norm",
    "Declared",
    "Kind",
    "declared",
    "Reducer",
    "Scope",
    "current_scope",
    "in_scope",
    "inherit_kind",
    "kind_of",
    "probe_kind",
    "safe_norm",
    "stateless",
    "sub_scope",
    "tensor_max_abs",
    "tensor_norm",
    "tensor_norms",
    "tensor_sum",
    "tensor_sum_sq",
    "tree_max_abs",
    "tree_nonfinite_count",
    "tree_norm",
    "tree_sum_sq",
    "undeclared_name",
    "whole_reference",
    "with_kind",
    "TORCH_COMPAT",
    "AdagradHyperparams",
    "AdamHyperparams",
    "PiecePreparer",
    "PieceRule",
    "PreparedPieces",
    "PartitionRule",
    "PyTree",
    "SGDHyperparams",
    "TorchCompat",
    "piece_rule",
    "prepare_pieces",
    "init_count",
    "leafwise",
    "local_tensor",
    "needs_whole_tensors",
    "partition_rule",
    "whole_tensor_mask",
    "resolve",
    "torch_compat",
    "tree_leaves",
    "tree_map",
    "tree_structure",
    "update_whole_",
    "with_piece_rule",
    "with_whole_tensors",
    "zeros_like_tree",
]

# Old names (see [Note: renamed core names] in _renamed.py):
__getattr__ = renamed_getattr(
    __name__,
    {"FlatRule": "PieceRule", "flat_rule": "piece_rule", "with_flat_rule": "with_piece_rule"},
    globals(),
)
