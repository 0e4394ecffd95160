"""Saving under training frameworks: HF Trainer's callback and accelerate's save_state hook."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from shardopt.optim.zero import ZeroRedundancyOptimizer

__all__ = ["ConsolidateOnSave"]

# [Note: saving under a framework]
# HF Trainer and accelerate save the optimizer with ``torch.save(optimizer.state_dict())``: Trainer
# from the saving ranks alone, accelerate's ``save_state`` from every rank, keeping the main
# process's. A sharded state must first be gathered with every rank taking part, which neither
# framework does for an optimizer it does not know. ConsolidateOnSave is that step, in each
# framework's own extension point: a Trainer callback (the step or epoch end where Trainer has
# decided to save, and each evaluation under save_strategy="best", which decides after it) and an
# accelerate save_state pre-hook. It calls ``consolidate_for_saving`` with whether this rank saves,
# so a saving rank's ``state_dict()`` is the global state and the others' is a placeholder that
# raises when used ([Note: state dicts without consolidation]). Wrapping the optimizer needs
# nothing: ``state_dict()`` of a never-stepped optimizer answers on every rank. Neither framework
# is imported here: the callback is duck-typed (Trainer calls ``on_<event>`` methods, any other
# event is a no-op) and accelerate's state is looked up only when its hook runs.


def _sharded(optimizer: Any) -> ZeroRedundancyOptimizer | None:
    """The ZeroRedundancyOptimizer inside ``optimizer`` and its wrappers (accelerate's
    ``AcceleratedOptimizer`` keeps it as ``.optimizer``), or None."""
    for _ in range(8):
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            return optimizer
        optimizer = getattr(optimizer, "optimizer", None)
    return None


def _ignore(*args: Any, **kwargs: Any) -> None:
    del args, kwargs


class ConsolidateOnSave:
    """Gathers a ZeroRedundancyOptimizer's state where a framework saves it, before it does.

    See [Note: saving under a framework]. One instance serves either framework:

    - HF Trainer: ``Trainer(..., optimizers=(opt, scheduler), callbacks=[ConsolidateOnSave()])``.
      The optimizer comes from the Trainer; checkpoints every ``save_steps`` (or epoch, or new
      best) hold the global state, and ``resume_from_checkpoint`` loads it.
    - accelerate: ``accelerator.register_save_state_pre_hook(ConsolidateOnSave(opt))``; then
      ``accelerator.save_state(dir)`` saves the global state and ``load_state(dir)`` loads it.

    Optimizers without a sharded state (plain ``torch.optim``) are left alone.

    Args:
        optimizer: the optimizer accelerate saves (needed for accelerate only; a wrapper of a
            ZeroRedundancyOptimizer is fine).
    """

    def __init__(self, optimizer: Any = None) -> None:
        self.optimizer = optimizer

    # -- HF Trainer: TrainerCallback's events --------------------------------------------------

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Trainer has decided whether to save at this step: gathers if it will."""
        if control.should_save:
            self._consolidate(kwargs.get("optimizer"), bool(args.should_save))

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Trainer has decided whether to save at this epoch's end: gathers if it will."""
        self.on_step_end(args, state, control, **kwargs)

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Under ``save_strategy="best"`` Trainer decides after evaluating: gathers each time."""
        if str(getattr(args.save_strategy, "value", args.save_strategy)) == "best":
            self._consolidate(kwargs.get("optimizer"), bool(args.should_save))

    def __getattr__(self, name: str) -> Callable[..., None]:
        if name.startswith("on_"):  # Trainer's other events (the set grows between releases)
            return _ignore
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- accelerate: a save_state pre-hook ------------------------------------------------------

    def __call__(self, models: Any, weights: Any, output_dir: Any) -> None:
        """``Accelerator.save_state``'s pre-hook: gathers on the ranks that will save."""
        del models, weights, output_dir
        from accelerate.state import PartialState  # only ever called by accelerate

        if self.optimizer is None:
            raise ValueError(
                "ConsolidateOnSave: expected the optimizer for accelerate's save_state hook, got "
                "None; register ConsolidateOnSave(optimizer)"
            )
        # Each node's main process: accelerate saves from there under save_on_each_node, which
        # this hook cannot see; otherwise only the first node's gather is used.
        self._consolidate(self.optimizer, PartialState().is_local_main_process)

    @staticmethod
    def _consolidate(optimizer: Any, saving: bool) -> None:
        sharded = _sharded(optimizer)
        if sharded is not None:
            sharded.consolidate_for_saving(saving)
