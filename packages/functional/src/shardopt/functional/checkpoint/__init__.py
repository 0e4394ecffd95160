"""The checkpoint formats of a sharded state: sharded state dicts, torch.optim's consolidated
form, and torch.distributed.checkpoint (DCP) with shardopt's safe publishing and loading.

``shardopt.functional`` exports what a training loop calls (``save_checkpoint``,
``load_checkpoint``, ``consolidate_state_dict``, ...); this package's face adds what an
optimizer built on the engine needs to name and move a state's entries (``shardopt.optim``'s
drop-in uses nothing else): the torch names of a state's fields, whether a piece holds state,
a piece's value, and the gathering of entries to one rank.
"""

from shardopt.functional.checkpoint._checkpoint_keys import field_keys, has_state, piece_value
from shardopt.functional.checkpoint._entries import gather_entries, to_cpu
from shardopt.functional.checkpoint._errors import CheckpointError

__all__ = [
    "CheckpointError",
    "field_keys",
    "gather_entries",
    "has_state",
    "piece_value",
    "to_cpu",
]
