"""torch's own baselines for the CLI, imported quietly: ZeroRedundancyOptimizer."""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["zero_redundancy_optimizer"]


def zero_redundancy_optimizer() -> type[Any]:
    """``torch.distributed.optim.ZeroRedundancyOptimizer``, imported on first use.

    Importing torch.distributed.optim warns that ``torch.jit.script`` and ``torch.jit.interface``
    are deprecated (torch scripts its own functional optimizers); those warnings are torch's, so
    they are silenced here for runs with warnings as errors.

    Example:
        >>> zero_redundancy_optimizer().__name__
        'ZeroRedundancyOptimizer'
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r".*torch\.jit\.", DeprecationWarning)
        from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer
