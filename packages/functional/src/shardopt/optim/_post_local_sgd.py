"""PostLocalSGDOptimizer: a local optimizer step, then a model averager's periodic average."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from shardopt.optim.zero._incoming import check_optimizer_load
from shardopt.optim.zero._optimizer import ZeroRedundancyOptimizer

__all__ = ["PostLocalSGDOptimizer"]

# [Note: a wrapper, not an optimizer]
# ``PostLocalSGDOptimizer`` subclasses ``torch.optim.Optimizer`` so that code checking for an
# optimizer (LR schedulers, ``isinstance``) accepts it, but it does not run the base constructor:
# it owns neither parameters nor state. ``param_groups`` is the wrapped optimizer's list itself
# (an LR scheduler that edits a group's ``lr`` edits the wrapped optimizer's), ``state`` and
# ``defaults`` are read through, and every method delegates. The averager is duck-typed (a
# ``step`` attribute and ``average_parameters(params)``), so torch's averagers work here and ours
# work in torch's wrapper.


class PostLocalSGDOptimizer(torch.optim.Optimizer):
    """Runs ``optim`` at every step, then lets ``averager`` average the parameters.

    Post-local SGD (https://arxiv.org/abs/1808.07217) with the API and behaviour of
    ``torch.distributed.optim.PostLocalSGDOptimizer``: :meth:`step` runs the local optimizer and
    then ``averager.average_parameters(self.param_groups)``, which averages the parameters across
    the averager's group once its warm-up is over, every ``period`` steps.
    :meth:`state_dict` adds the averager's ``step`` so a reload does not warm up again. Use it
    with DDP's ``post_localSGD_hook`` (with ``start_localSGD_iter`` equal to the averager's
    ``warmup_steps``) or alone. See [Note: a wrapper, not an optimizer].

    Example:
        >>> import torch, torch.distributed as dist
        >>> from shardopt.optim._averagers import PeriodicModelAverager
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> model = torch.nn.Linear(2, 1)
        >>> opt = PostLocalSGDOptimizer(
        ...     torch.optim.SGD(model.parameters(), lr=0.1),
        ...     PeriodicModelAverager(period=4, warmup_steps=10),
        ... )
        >>> for _ in range(3):
        ...     opt.zero_grad()
        ...     model(torch.ones(2)).sum().backward()
        ...     opt.step()
        >>> opt.state_dict()["step"]
        3
        >>> dist.destroy_process_group()

    Raises:
        TypeError: if ``optim`` has no ``param_groups``/``step`` or ``averager`` no
            ``average_parameters``/``step``.
    """

    def __init__(self, optim: torch.optim.Optimizer, averager: Any) -> None:
        for name in ("param_groups", "step", "state_dict", "load_state_dict"):
            if not hasattr(optim, name):
                raise TypeError(
                    "PostLocalSGDOptimizer: expected a torch.optim.Optimizer as optim (with "
                    f"{name}), got {type(optim).__name__}"
                )
        if not (
            callable(getattr(averager, "average_parameters", None)) and hasattr(averager, "step")
        ):
            raise TypeError(
                "PostLocalSGDOptimizer: expected a model averager (with average_parameters and "
                f"step), got {type(averager).__name__}"
            )
        self.optim = optim
        self.averager = averager
        self.param_groups = optim.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's state."""
        return self.optim.state

    @property
    def defaults(self) -> Any:  # type: ignore[override]
        """The wrapped optimizer's defaults."""
        return self.optim.defaults

    def __repr__(self) -> str:
        return repr(self.optim)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Runs the wrapped optimizer's step, then the averager; returns the closure's loss."""
        loss = self.optim.step() if closure is None else self.optim.step(closure)
        self.averager.average_parameters(self.param_groups)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Resets the gradients of the wrapped optimizer's parameters."""
        self.optim.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a param group to the wrapped optimizer (and so to the averaged parameters)."""
        self.optim.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's state dict with the averager's step under ``"step"``."""
        state_dict = self.optim.state_dict()
        state_dict["step"] = self.averager.step
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any], *, allow_nonfinite: bool = False) -> None:
        """Loads the wrapped optimizer's state and restores the averager's step.

        A state dict without ``"step"`` (one saved by the wrapped optimizer itself, say) sets the
        averager's step to 0, with a warning: its warm-up then starts over. Everything is checked
        before anything is loaded ([Note: incoming state]): the averager's step (an int >= 0)
        and, for a torch.optim local optimizer, every entry against what its class makes (a
        ZeroRedundancyOptimizer checks its own, on every rank together); a local optimizer's
        check is local, alike on every rank given the same dict. ``allow_nonfinite=True`` loads
        NaN and inf values (a diverged run, reloaded on purpose).

        Raises:
            ValueError: an entry, a hyperparameter or the step is refused; nothing was loaded.
        """
        api = "PostLocalSGDOptimizer.load_state_dict"
        step = state_dict.get("step", 0) if isinstance(state_dict, dict) else 0
        if type(step) is not int or step < 0:
            raise ValueError(
                f"{api}: expected 'step' an int >= 0, got {step!r}; nothing was loaded"
            )
        if isinstance(self.optim, ZeroRedundancyOptimizer):
            self.optim.load_state_dict(state_dict, allow_nonfinite=allow_nonfinite)
        else:
            check_optimizer_load(api, self.optim, state_dict, allow_nonfinite=allow_nonfinite)
            self.optim.load_state_dict(state_dict)
        if "step" in state_dict:
            self.averager.step = state_dict["step"]
        else:
            warnings.warn(  # torch's text, word for word: its tests match on it
                "Loaded state dict does not contain a step counter for an averager. "
                "Setting step counter to 0.",
                UserWarning,
                stacklevel=2,
            )
            self.averager.step = 0
