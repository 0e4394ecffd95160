"""The join hook of ZeroRedundancyOptimizer: shadowing its step on ranks out of inputs."""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.join import JoinHook

__all__ = ["ZeroJoinHook"]

# [Note: joining with uneven inputs]
# Inside ``Join([ddp_model, zero])`` a rank that has run out of inputs keeps answering the
# collectives of the ranks still training: DDP's hook shadows the gradient all-reduce, and ours
# shadows the optimizer step, because every step ends in a parameter sync that all ranks take
# part in. As torch's, our main hook runs the step on the joined rank with whatever gradients
# its parameters hold (a hook placed before ours in the Join list may set them): the joined
# rank updates the parameters it owns and sends them, so every rank leaves the loop with the
# same parameters. Unlike torch's, the shadow step does not notify the join context (torch's
# step does, and a ZeroRedundancyOptimizer first in the Join list would then enter an
# all-reduce that the training ranks never match). With ``comm_dtype`` the step reduces the
# ranks' local gradients itself, so a joined rank steps with zero gradients (None for a frozen
# parameter): its share of the average, as under DDP's join.


class ZeroJoinHook(JoinHook):
    """Runs the optimizer's step (and its parameter sync) once per iteration of a joined rank."""

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        """Steps and syncs without notifying the join context (see [Note: joining with uneven
        inputs])."""
        self.zero._shadow_step()
