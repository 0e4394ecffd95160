"""The checkpoint formats of a sharded state: sharded state dicts, torch.optim's consolidated
form, and torch.distributed.checkpoint (DCP) with shardopt's safe publishing and loading.

``shardopt.functional`` exports what a training loop calls (``save_checkpoint``,
``load_checkpoint``, ``consolidate_state_dict``, ...); this package's face adds what an
optimizer built on the engine needs to name and move a state's entries (``shardopt.optim``'s
drop-in uses nothing else): the torch names of a state's fields, whether a piece holds state,
a piece's value, the gathering of entries to one rank, and the checks of incoming state
([Note: incoming state]).
"""

from shardopt.functional.checkpoint._checkpoint_keys import field_keys, has_state, piece_value
from shardopt.functional.checkpoint._entries import gather_entries, to_cpu
from shardopt.functional.checkpoint._errors import CheckpointError
from shardopt.functional.checkpoint._incoming import (
    NONNEGATIVE_KEYS,
    EntrySpec,
    Expected,
    check_entries,
    hyperparam_problem,
    torch_form_specs,
)
from shardopt.functional.checkpoint._torch_format import write_torch_state_dict

__all__ = [
    "NONNEGATIVE_KEYS",
    "CheckpointError",
    "EntrySpec",
    "Expected",
    "check_entries",
    "hyperparam_problem",
    "torch_form_specs",
    "write_torch_state_dict",
    "field_keys",
    "gather_entries",
    "has_state",
    "piece_value",
    "to_cpu",
]
