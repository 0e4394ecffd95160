"""Model averagers: when, and within which group, post-local SGD averages the parameters."""

from __future__ import annotations

import abc
import numbers
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

from shardopt.functional import averaging_due
from shardopt.functional.engine import (
    ProcessGroup,
    check_schedule,
    resolve_group,
)
from shardopt.optim._averaging import ParamsOrGroups, average_parameters

__all__ = ["HierarchicalModelAverager", "ModelAverager", "PeriodicModelAverager"]

_PERIOD_ONE = (
    "{api}: a period of 1 averages the parameters at every step, which costs at least as much "
    "communication as DistributedDataParallel's gradient all-reduce; use DDP alone instead"
)


class ModelAverager(abc.ABC):
    """Base class of model averagers: a process group and a step counter.

    Args:
        process_group: the group across which parameters are averaged; ``None`` for the default
            group (``torch.distributed.group.WORLD``).

    Attributes:
        step: the number of calls to :meth:`average_parameters` so far (saved by
            ``PostLocalSGDOptimizer.state_dict``).
    """

    def __init__(self, process_group: ProcessGroup | None = None) -> None:
        self.process_group = resolve_group(type(self).__name__, process_group)
        self.step = 0

    @abc.abstractmethod
    def average_parameters(self, params: ParamsOrGroups) -> None:
        """Averages ``params`` (tensors or param groups) if this step is due; advances ``step``."""


class PeriodicModelAverager(ModelAverager):
    """Averages the parameters across the group every ``period`` steps after ``warmup_steps``.

    Same API and behaviour as torch's ``PeriodicModelAverager``: call :meth:`average_parameters`
    after each optimizer step; it averages the parameters that have a gradient at steps
    ``warmup_steps``, ``warmup_steps + period``, ... (see [Note: local SGD schedule]) with
    :func:`~shardopt.optim._averaging.average_parameters`. A ``period`` of 1 warns: DDP alone is
    cheaper then.

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> averager = PeriodicModelAverager(period=4, warmup_steps=2)
        >>> model = torch.nn.Linear(2, 1)
        >>> for _ in range(3):
        ...     model(torch.ones(2)).sum().backward()
        ...     averager.average_parameters(model.parameters())
        >>> averager.step
        3
        >>> dist.destroy_process_group()

    Raises:
        ValueError: if ``period < 1`` or ``warmup_steps < 0``.
    """

    def __init__(
        self,
        period: int,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        api = type(self).__name__
        check_schedule(api, period, warmup_steps)
        if period == 1:
            warnings.warn(_PERIOD_ONE.format(api=api), UserWarning, stacklevel=2)
        super().__init__(process_group)
        self.period = int(period)
        self.warmup_steps = int(warmup_steps)

    def average_parameters(self, params: ParamsOrGroups) -> None:
        """Averages the parameters with a gradient if this step is due; advances ``step``."""
        if averaging_due(self.step, period=self.period, warmup_steps=self.warmup_steps):
            average_parameters(params, self.process_group, only_with_grad=True)
        self.step += 1

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(period={self.period}, warmup_steps={self.warmup_steps}, "
            f"step={self.step})"
        )


@dataclass(frozen=True, slots=True)
class AveragingHierarchy:
    """A validated ``{period: group_size}`` hierarchy: increasing positive periods and sizes.

    [Note: averaging hierarchy]
    Level ``i`` averages within groups of ``group_sizes[i]`` consecutive ranks every
    ``periods[i]`` steps. At a step divisible by several periods only the level of the largest
    one averages: its groups contain the smaller ones. Periods must increase (torch finds the
    largest period by their order), each size must divide the size of the whole group (it is cut
    into equal groups of consecutive ranks) and the last level is the whole group.
    """

    periods: tuple[int, ...]
    group_sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        api = "HierarchicalModelAverager"
        pairs = dict(zip(self.periods, self.group_sizes))
        if not self.periods:
            raise ValueError(f"{api}: expected a non-empty period_group_size_dict, got {pairs}")
        for name, values in (("periods", self.periods), ("group sizes", self.group_sizes)):
            for v in values:
                if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                    raise TypeError(f"{api}: expected integer {name}, got {v!r} in {pairs}")
                if v < 1:
                    raise ValueError(f"{api}: expected {name} >= 1, got {v} in {pairs}")
        if any(a >= b for a, b in zip(self.periods, self.periods[1:])):
            raise ValueError(
                f"{api}: expected the periods of period_group_size_dict in increasing order, "
                f"got {list(self.periods)}"
            )

    @classmethod
    def from_mapping(cls, mapping: Mapping[int, int] | None) -> AveragingHierarchy:
        if mapping is not None and not isinstance(mapping, Mapping):
            raise TypeError(
                "HierarchicalModelAverager: expected period_group_size_dict to be a mapping "
                f"{{period: group_size}}, got {type(mapping).__name__}"
            )
        items = list((mapping or {}).items())
        return cls(tuple(p for p, _ in items), tuple(s for _, s in items))

    def check_group_size(self, size: int) -> None:
        """Raises unless every group size divides ``size`` and the last one equals it."""
        api = "HierarchicalModelAverager"
        for period, group_size in zip(self.periods, self.group_sizes):
            if size % group_size:
                raise ValueError(
                    f"{api}: expected group sizes that divide the size of the process group "
                    f"({size}), got {group_size} for period {period}"
                )
        if self.group_sizes[-1] != size:
            raise ValueError(
                f"{api}: expected the last group size to equal the size of the process group "
                f"({size}), got {self.group_sizes[-1]}"
            )


class HierarchicalModelAverager(ModelAverager):
    """Averages within groups of increasing size at increasing periods (hierarchical SGD).

    Same API and behaviour as torch's ``HierarchicalModelAverager``: ``period_group_size_dict``
    maps each period to a group size, e.g. ``{4: 8, 16: 16}`` averages within each group of 8
    consecutive ranks every 4 steps and across all 16 every 16 steps. From ``warmup_steps`` on, a
    step (counted from 0) divisible by a period averages within that level's groups, the level of
    the largest such period only (see [Note: averaging hierarchy]). The constructor creates the
    subgroups, a collective: every rank of the world constructs the averager.

    Example:
        >>> import torch, torch.distributed as dist
        >>> dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        >>> averager = HierarchicalModelAverager({2: 1, 4: 1}, warmup_steps=1)
        >>> list(averager.period_process_group_dict)
        [2, 4]
        >>> dist.destroy_process_group()

    Raises:
        ValueError: for an empty dict, periods or sizes below 1, periods out of increasing order,
            a size that does not divide the group size, a last size other than the group size, or
            ``warmup_steps < 0``.
    """

    def __init__(
        self,
        period_group_size_dict: Mapping[int, int] | None = None,
        warmup_steps: int = 0,
        process_group: ProcessGroup | None = None,
    ) -> None:
        api = type(self).__name__
        hierarchy = AveragingHierarchy.from_mapping(period_group_size_dict)
        check_schedule(api, hierarchy.periods[0], warmup_steps)
        super().__init__(process_group)
        hierarchy.check_group_size(dist.get_world_size(self.process_group))
        if hierarchy.periods[-1] == 1:
            warnings.warn(_PERIOD_ONE.format(api=api), UserWarning, stacklevel=2)
        self.warmup_steps = int(warmup_steps)
        self._periods = list(hierarchy.periods)
        self.period_process_group_dict: OrderedDict[int, ProcessGroup] = OrderedDict(
            (period, self._new_level_group(size))
            for period, size in zip(hierarchy.periods, hierarchy.group_sizes)
        )

    def _new_level_group(self, size: int) -> ProcessGroup:
        ranks = dist.get_process_group_ranks(self.process_group)
        if size == len(ranks):
            return self.process_group
        groups = [ranks[i : i + size] for i in range(0, len(ranks), size)]
        mine, _ = dist.new_subgroups_by_enumeration(groups)
        return mine

    def _find_process_group(self) -> ProcessGroup | None:
        """The group of the largest period dividing ``step``, or ``None``."""
        for period in reversed(self._periods):
            if self.step % period == 0:
                return self.period_process_group_dict[period]
        return None

    def average_parameters(self, params: ParamsOrGroups) -> None:
        """Averages the parameters with a gradient within the group due at this step, if any."""
        if self.step >= self.warmup_steps:
            group = self._find_process_group()
            if group is not None:
                average_parameters(params, group, only_with_grad=True)
        self.step += 1

    def __repr__(self) -> str:
        sizes = {p: dist.get_world_size(g) for p, g in self.period_process_group_dict.items()}
        return (
            f"{type(self).__name__}(period_group_size_dict={sizes}, "
            f"warmup_steps={self.warmup_steps}, step={self.step})"
        )
