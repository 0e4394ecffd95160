"""Partition plans: which rank owns which elements of which parameter, as plain data."""

from __future__ import annotations

import hashlib
import itertools
import json
from bisect import bisect_right
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardopt.core._plan_input import collect_specs
from shardopt.core._plan_io import plan_fields, plan_to_dict
from shardopt.core._plan_layout import assign_owners, layout_flat, layout_greedy, layout_mixed
from shardopt.core._plan_spec import (
    Bucket,
    BufferGroup,
    Piece,
    Strategy,
    TensorSpec,
    check_int,
    check_ints,
    first_difference,
    itemsize,
    short,
)

__all__ = [
    "DEFAULT_BUCKET_NUMEL",
    "Bucket",
    "BufferGroup",
    "Piece",
    "Plan",
    "Strategy",
    "TensorSpec",
    "plan_partition",
]

_STRATEGIES = tuple(s.value for s in Strategy)

# [Note: default alignment]
# FLAT aligns every shard to 16 elements (64 bytes of float32, 32 of bfloat16), so each rank's
# slice of the flat buffer starts where vectorised kernels and NCCL like it. GREEDY mirrors torch's
# ZeroRedundancyOptimizer, which pads nothing, so it defaults to 1.
DEFAULT_ALIGN = {Strategy.FLAT: 16, Strategy.GREEDY: 1, Strategy.MIXED: 1}

# [Note: plan validation]
# A Plan can come from anywhere (``from_dict`` of a file, another rank, a hand-written test), so
# ``__post_init__`` checks it completely: field types and ranges first (GREEDY: one owner per
# tensor, a rank; MIXED: a rank or -1 for a cut tensor), then that ``groups`` are exactly the layout
# of [Note: plan layout]. Any owners make a valid plan: torch's rule by element counts is
# ``plan_partition``'s default, a ``cost`` gives others (Muon's flops order tensors otherwise than
# their sizes), and a plan read back keeps the owners it was written with. The layout being a pure
# function of (tensors, world_size, align, owners), the simplest complete check is to rebuild it and
# compare; the first difference is reported. Every property the sharded layer relies on follows:
# each element of each tensor is owned by exactly one rank, flat slices are equal and aligned,
# offsets are consistent.

# [Note: default bucket size]
# ``bucket_numel`` counts the elements of one bucket, all ranks together: one collective's whole
# buffer. 1 << 24 is 64 MiB of float32 (32 MiB of bfloat16) per call: past the sizes where
# NCCL's all-gathers and reduce-scatters reach most of their bandwidth (DDP's buckets are 25 MiB),
# small enough that the gradient staging of a bucket stays bounded at any world size, and large
# enough that a small model is one bucket: one call per step, as cheap as it gets on gloo.
DEFAULT_BUCKET_NUMEL = 1 << 24


@dataclass(frozen=True, slots=True)
class Plan:
    """A partition of parameters over ``world_size`` ranks, as plain, validated data.

    Built by :func:`plan_partition`; see [Note: plan layout] for the layout rules and
    [Note: plan validation] for the checks every Plan passes.

    Example:
        >>> plan = plan_partition([((4, 3), "float32"), ((5,), "bfloat16")], 2)
        >>> [(g.dtype, g.shard_numels) for g in plan.groups], plan.numel_per_rank()
        ([('float32', (16, 16)), ('bfloat16', (16, 16))], (17, 0))
    """

    strategy: Strategy
    world_size: int
    align: int
    tensors: tuple[TensorSpec, ...]
    groups: tuple[BufferGroup, ...]
    owners: tuple[int, ...] | None
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    # (group, bucket, offset in the group's buffer) of each tensor; derived, so not compared
    # nor serialised.
    _where: tuple[tuple[int, int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._check_fields()
        self._check_layout()
        where: list[tuple[int, int, int]] = [(0, 0, 0)] * len(self.tensors)
        for g, group in enumerate(self.groups):
            stops = [b.stop for b in group.buckets]
            for t, offset in zip(group.tensors, group.offsets):
                b = bisect_right(stops, offset)
                # an empty tensor on a bucket boundary belongs to the bucket that ends there
                if b == len(stops) or (self.tensors[t].numel == 0 and b and stops[b - 1] == offset):
                    b -= 1
                where[t] = (g, b, offset)
        object.__setattr__(self, "_where", tuple(where))

    def _check_fields(self) -> None:
        if not isinstance(self.strategy, (str, Strategy)) or self.strategy not in _STRATEGIES:
            raise ValueError(f"Plan: expected strategy in {_STRATEGIES}, got {self.strategy!r}")
        object.__setattr__(self, "strategy", Strategy(self.strategy))
        check_int("Plan", "world_size", self.world_size, 1)
        check_int("Plan", "align", self.align, 1)
        if self.bucket_numel is not None:
            check_int("Plan", "bucket_numel", self.bucket_numel, 1)
        for name, kind in (("tensors", TensorSpec), ("groups", BufferGroup)):
            value = getattr(self, name)
            if not isinstance(value, (tuple, list)) or not all(isinstance(v, kind) for v in value):
                raise TypeError(f"Plan: expected {name} to be a tuple of {kind.__name__}")
            object.__setattr__(self, name, tuple(value))
        if not self.tensors:
            raise ValueError("Plan: expected at least one tensor, got none")
        param_groups = [t.param_group for t in self.tensors]
        for i in range(1, len(param_groups)):
            if param_groups[i] < param_groups[i - 1]:
                raise ValueError(
                    "Plan: expected tensors in param-group order (param_group non-decreasing), "
                    f"got param_group {param_groups[i]} after {param_groups[i - 1]} at tensors[{i}]"
                )

    def _check_layout(self) -> None:
        numels = [t.numel for t in self.tensors]
        if self.strategy is Strategy.FLAT:
            if self.owners is not None:
                raise ValueError(
                    f"Plan: expected owners=None for strategy 'flat', got {short(self.owners)}"
                )
            expected = layout_flat(
                self.tensors, numels, self.world_size, self.align, self.bucket_numel
            )
        else:
            mixed = self.strategy is Strategy.MIXED
            owners = check_ints("Plan", "owners", self.owners, -1 if mixed else 0)
            object.__setattr__(self, "owners", owners)
            if len(owners) != len(self.tensors) or max(owners) >= self.world_size:
                raise ValueError(
                    f"Plan: expected one owner < world_size={self.world_size} per tensor, "
                    f"got {short(owners)} for {len(self.tensors)} tensors"
                )
            if mixed and self.align != 1:
                raise ValueError(f"Plan: expected align=1 for strategy 'mixed', got {self.align}")
            expected = (
                layout_mixed(self.tensors, numels, owners, self.world_size, self.bucket_numel)
                if mixed
                else layout_greedy(
                    self.tensors, numels, owners, self.world_size, self.align, self.bucket_numel
                )
            )
        if len(self.groups) != len(expected):
            raise ValueError(
                f"Plan: expected {len(expected)} groups (one per (dtype, device), in order of "
                f"first appearance), got {len(self.groups)}"
            )
        for g, (got, want) in enumerate(zip(self.groups, expected)):
            for name in ("dtype", "device", "tensors", "offsets", "buckets", "world_size"):
                if getattr(got, name) != getattr(want, name):
                    raise ValueError(
                        f"Plan: groups[{g}].{name} breaks the {self.strategy.value} layout rule"
                        f"{first_difference(getattr(want, name), getattr(got, name))}"
                    )

    def __repr__(self) -> str:
        return (
            f"Plan(strategy={self.strategy.value!r}, world_size={self.world_size}, "
            f"align={self.align}, bucket_numel={self.bucket_numel}, "
            f"tensors=<{len(self.tensors)}>, groups=<{len(self.groups)}>)"
        )

    def pieces(self, rank: int) -> tuple[Piece, ...]:
        """What ``rank`` owns: pieces ordered by (group, offset in the rank's shard).

        A piece is the part of one tensor in one of the rank's bucket shards.

        Example:
            >>> plan = plan_partition([((3, 2), "float32"), ((4,), "float32")], 2, align=1)
            >>> [(p.tensor, p.start, p.stop, p.offset) for p in plan.pieces(1)]
            [(0, 5, 6, 0), (1, 0, 4, 1)]
        """
        check_int("Plan.pieces", "rank", rank, 0)
        if rank >= self.world_size:
            raise ValueError(
                f"Plan.pieces: expected rank < world_size={self.world_size}, got {rank}"
            )
        out = []
        for g, group in enumerate(self.groups):
            base = 0  # where this bucket's shard starts in the rank's shard of the group
            for bucket in group.buckets:
                lo = bucket.shard_start(rank)
                hi = lo + bucket.shards[rank]
                k = max(bisect_right(group.offsets, lo) - 1, 0)
                while lo < hi and k < len(group.offsets) and group.offsets[k] < hi:
                    t, begin = group.tensors[k], group.offsets[k]
                    start, stop = max(begin, lo), min(begin + self.tensors[t].numel, hi)
                    if start < stop:
                        out.append(Piece(t, start - begin, stop - begin, g, base + start - lo))
                    k += 1
                base += bucket.shards[rank]
        return tuple(out)

    def is_whole(self, tensor: int) -> bool:
        """Whether one rank owns ``tensors[tensor]`` whole (greedy; mixed, where it has an owner).

        Example:
            >>> specs = [((2, 3), "float32"), ((4,), "float32")]
            >>> matrix = lambda t: len(t.shape) == 2
            >>> plan = plan_partition(specs, 2, strategy="mixed", whole=matrix)
            >>> plan.is_whole(0), plan.is_whole(1), plan.owners
            (True, False, (0, -1))
        """
        return self.owners is not None and self.owners[tensor] >= 0

    def locate(self, tensor: int) -> tuple[int, int, int]:
        """(group, bucket, offset in the group's flat buffer) of ``tensors[tensor]``.

        Example:
            >>> plan = plan_partition([((3,), "float32"), ((4,), "float32")], 2, bucket_numel=4)
            >>> plan.locate(0), plan.locate(1)
            ((0, 0, 0), (0, 1, 32))
        """
        check_int("Plan.locate", "tensor", tensor, 0)
        if tensor >= len(self.tensors):
            raise ValueError(f"Plan.locate: expected tensor < {len(self.tensors)}, got {tensor}")
        return self._where[tensor]

    def tensor_pieces(self, tensor: int) -> tuple[tuple[int, Piece], ...]:
        """The (rank, piece) pairs that cover ``tensors[tensor]``, in element order.

        Example:
            >>> plan = plan_partition([((3, 2), "float32"), ((4,), "float32")], 2, align=1)
            >>> [(r, p.start, p.stop) for r, p in plan.tensor_pieces(0)]
            [(0, 0, 5), (1, 5, 6)]
        """
        check_int("Plan.tensor_pieces", "tensor", tensor, 0)
        if tensor >= len(self.tensors):
            raise ValueError(
                f"Plan.tensor_pieces: expected tensor < {len(self.tensors)}, got {tensor}"
            )
        g, b, begin = self._where[tensor]
        group = self.groups[g]
        bucket = group.buckets[b]
        end = begin + self.tensors[tensor].numel
        if end == begin:
            return ()
        if self.owners is None:  # flat: the ranks it touches follow from the shard size
            n = bucket.shards[0]
            ranks: Iterable[int] = range(
                (begin - bucket.start) // n, (end - 1 - bucket.start) // n + 1
            )
        elif self.owners[tensor] >= 0:  # greedy or mixed: the owner's shard holds it whole
            ranks = (self.owners[tensor],)
        else:  # cut by a mixed plan: the shards it overlaps
            stops = list(itertools.accumulate(bucket.shards, initial=bucket.start))
            ranks = [r for r in range(self.world_size) if stops[r] < end and begin < stops[r + 1]]
        out = []
        for rank in ranks:
            lo = bucket.shard_start(rank)
            start, stop = max(begin, lo), min(end, lo + bucket.shards[rank])
            base = sum(x.shards[rank] for x in group.buckets[:b])
            out.append((rank, Piece(tensor, start - begin, stop - begin, g, base + start - lo)))
        return tuple(out)

    def _owned(self, weighted: bool) -> tuple[int, ...]:
        totals = [0] * self.world_size
        for t, spec in enumerate(self.tensors):
            weight = itemsize(spec.dtype) if weighted else 1
            for rank, piece in self.tensor_pieces(t):
                totals[rank] += piece.numel * weight
        return tuple(totals)

    def numel_per_rank(self) -> tuple[int, ...]:
        """The elements each rank owns, padding excluded.

        Example:
            >>> plan_partition([((3, 2), "float32"), ((4,), "float32")], 2).numel_per_rank()
            (10, 0)
        """
        return self._owned(weighted=False)

    def bytes_per_rank(self) -> tuple[int, ...]:
        """The bytes each rank owns, padding excluded.

        Example:
            >>> plan_partition([((3, 2), "float32"), ((4,), "float32")], 2).bytes_per_rank()
            (40, 0)
        """
        return self._owned(weighted=True)

    def imbalance(self) -> float:
        """max / mean of :meth:`bytes_per_rank` (1.0 is perfect; 1.0 if there are no bytes).

        Example:
            >>> plan_partition([((3, 2), "float32"), ((4,), "float32")], 2, align=1).imbalance()
            1.0
        """
        owned = self.bytes_per_rank()
        total = sum(owned)
        return max(owned) * self.world_size / total if total else 1.0

    def to_dict(self) -> dict[str, Any]:
        """The plan as plain JSON-compatible data; :meth:`from_dict` inverts it exactly.

        Example:
            >>> plan = plan_partition([((3, 2), "float32")], 2)
            >>> Plan.from_dict(plan.to_dict()) == plan
            True
        """
        return plan_to_dict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Plan:
        """The plan that :meth:`to_dict` returned ``data`` for, validated.

        Example:
            >>> data = plan_partition([((3, 2), "float32")], 2).to_dict()
            >>> Plan.from_dict(data).groups[0].buckets
            (Bucket(start=0, shards=(16, 16)),)
        """
        return cls(**plan_fields(data))

    def to_json(self) -> str:
        """:meth:`to_dict` as compact JSON with sorted keys (the same plan gives the same text).

        Example:
            >>> plan_partition([((2,), "float32")], 1).to_json()[:20]
            '{"align":16,"bucket_'
        """
        return json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """The plan that :meth:`to_json` returned ``text`` for, validated.

        Example:
            >>> plan = plan_partition([((3, 2), "float32")], 2, strategy="greedy")
            >>> Plan.from_json(plan.to_json()).owners
            (0,)
        """
        return cls(**plan_fields(json.loads(text)))

    def fingerprint(self) -> int:
        """A 63-bit hash of :meth:`to_json` with devices by type, equal in every process.

        For cross-rank checks: rank r legitimately holds its parameters on ``cuda:r``, so device
        indices are dropped (``cuda:1`` hashes as ``cuda``); :meth:`to_dict` keeps them.

        Example:
            >>> a = plan_partition([((3, 2), "float32", "cuda:0")], 2)
            >>> a.fingerprint() == plan_partition([((3, 2), "float32", "cuda:1")], 2).fingerprint()
            True
            >>> a.fingerprint() == plan_partition([((3, 2), "float32", "cpu")], 2).fingerprint()
            False
        """
        data = self.to_dict()
        for record in (*data["tensors"], *data["groups"]):
            record["device"] = record["device"].split(":")[0]
        text = json.dumps(data, sort_keys=True, separators=(",", ":"))
        digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1


def plan_partition(
    tensors: Iterable[Any],
    world_size: int,
    *,
    strategy: Strategy | str = "flat",
    align: int | None = None,
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL,
    cost: Callable[[TensorSpec], float] | None = None,
    whole: Callable[[TensorSpec], bool] | None = None,
) -> Plan:
    """Plans which rank owns which elements of ``tensors``, for ``world_size`` ranks.

    Args:
        tensors: tensors (real or ``meta``), :class:`TensorSpec` s or ``(shape, dtype[, device])``
            pairs (device ``"cpu"`` by default); or param groups of those, as sequences or dicts
            with ``"params"`` like torch.optim's. TensorSpecs in a flat sequence keep their
            ``param_group`` (so ``plan_partition(plan.tensors, w)`` re-plans a plan).
        world_size: the number of ranks, >= 1.
        strategy: ``"flat"`` (equal contiguous slices, tensors may straddle ranks),
            ``"greedy"`` (whole tensors, torch ZeroRedundancyOptimizer's assignment) or
            ``"mixed"`` (the tensors ``whole`` picks whole, the others cut); see
            [Note: plan layout].
        align: shard alignment in elements; 16 for flat and 1 for greedy by default
            (see [Note: default alignment]).
        bucket_numel: the elements of one bucket, all ranks together (see [Note: plan layout]
            and [Note: default bucket size]); None: one bucket per group.
        cost: greedy and mixed: balance ``cost(spec)`` of the whole tensors instead of
            torch's element counts, e.g. ``lambda t: newton_schulz_flops(t.shape)`` for Muon,
            whose ranks own whole matrices (see [Note: balancing a cost]).
        whole: mixed only, and required there: which tensors one rank owns whole (the
            matrices Muon updates, say ``lambda t: len(t.shape) == 2 and t.shape[0] < 50000``).

    Returns:
        A frozen, validated :class:`Plan`.

    Example:
        >>> plan = plan_partition([((4, 3), "float32"), ((5,), "float32")], 2, align=1)
        >>> plan.groups[0].shard_numels, [(p.tensor, p.start, p.stop) for p in plan.pieces(1)]
        ((9, 9), [(0, 9, 12), (1, 0, 5)])
        >>> plan_partition([((4, 3), "float32"), ((5,), "float32")], 2, strategy="greedy").owners
        (0, 1)
    """
    api = "plan_partition"
    check_int(api, "world_size", world_size, 1)
    if not isinstance(strategy, (str, Strategy)) or strategy not in _STRATEGIES:
        raise ValueError(f"{api}: expected strategy in {_STRATEGIES}, got {strategy!r}")
    strategy = Strategy(strategy)
    align = check_int(api, "align", DEFAULT_ALIGN[strategy] if align is None else align, 1)
    if bucket_numel is not None:
        check_int(api, "bucket_numel", bucket_numel, 1)
    specs = collect_specs(api, tensors)
    numels = [t.numel for t in specs]
    if cost is not None and strategy is Strategy.FLAT:
        raise ValueError(f"{api}: expected cost only with strategy 'greedy' or 'mixed', got 'flat'")
    if (whole is not None) != (strategy is Strategy.MIXED):
        raise ValueError(
            f"{api}: expected whole with strategy 'mixed' (and only there), got "
            f"whole={whole!r} with strategy {strategy.value!r}"
        )
    if strategy is Strategy.FLAT:
        groups = layout_flat(specs, numels, world_size, align, bucket_numel)
        return Plan(strategy, world_size, align, specs, groups, None, bucket_numel)
    owned = [bool(whole(t)) for t in specs] if whole is not None else [True] * len(specs)
    owners = assign_owners(api, specs, owned, world_size, cost)
    if strategy is Strategy.MIXED:
        groups = layout_mixed(specs, numels, owners, world_size, bucket_numel)
    else:
        groups = layout_greedy(specs, numels, owners, world_size, align, bucket_numel)
    return Plan(strategy, world_size, align, specs, groups, owners, bucket_numel)
