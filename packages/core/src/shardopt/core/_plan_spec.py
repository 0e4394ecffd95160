"""The plain-data records of partition plans: tensor specs, buckets, flat groups, pieces."""

from __future__ import annotations

import functools
import math
import reprlib
import sys
from dataclasses import dataclass, field
from enum import Enum

import torch

__all__ = [
    "Bucket",
    "BufferGroup",
    "Piece",
    "Strategy",
    "TensorSpec",
    "canonical_dtype",
    "local_tensor",
    "check_int",
    "check_ints",
    "first_difference",
    "itemsize",
    "short",
]

_REPR = reprlib.Repr()
_REPR.maxtuple = _REPR.maxlist = 8
_REPR.maxother = 80  # records such as Bucket(start=..., shards=(...)) whole


class Strategy(str, Enum):
    """How :func:`plan_partition` spreads parameters over ranks (see [Note: plan layout])."""

    GREEDY = "greedy"
    FLAT = "flat"
    MIXED = "mixed"


def short(value: object) -> str:
    """A repr of ``value`` cut to a few elements, for error messages."""
    return _REPR.repr(value)


def check_int(api: str, name: str, value: object, minimum: int) -> int:
    """``value`` if it is an int >= ``minimum``, else an error naming ``api`` and ``name``."""
    if type(value) is not int:
        raise TypeError(f"{api}: expected {name} to be an int >= {minimum}, got {short(value)}")
    if value < minimum:
        raise ValueError(f"{api}: expected {name} >= {minimum}, got {value}")
    return value


def check_ints(api: str, name: str, value: object, minimum: int) -> tuple[int, ...]:
    """``value`` as a tuple of ints >= ``minimum`` (from a tuple or a list), or a clear error."""
    if not isinstance(value, (tuple, list)) or not all(type(v) is int for v in value):
        raise TypeError(f"{api}: expected {name} to be a tuple of ints, got {short(value)}")
    if value and min(value) < minimum:
        raise ValueError(
            f"{api}: expected every element of {name} >= {minimum}, got {short(value)}"
        )
    return tuple(value)


def first_difference(want: object, got: object) -> str:
    """': expected X, got Y', at the first differing index for sequences of equal length."""
    if isinstance(want, tuple) and isinstance(got, tuple) and len(want) == len(got):
        i = next(i for i, (w, g) in enumerate(zip(want, got)) if w != g)
        return f" at index {i}: expected {short(want[i])}, got {short(got[i])}"
    return f": expected {short(want)}, got {short(got)}"


@functools.cache
def canonical_dtype(name: str) -> str | None:
    """The canonical torch dtype name of ``name`` ('float' -> 'float32'), or None if unknown."""
    dtype = getattr(torch, name, None) if name.isidentifier() else None
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else None


@functools.cache
def _canonical_device(name: str) -> str | None:
    try:
        return str(torch.device(name))
    except (RuntimeError, ValueError):
        return None


@functools.cache
def itemsize(dtype: str) -> int:
    """Bytes per element of the canonical dtype name ``dtype``."""
    return getattr(torch, dtype).itemsize


def _check_dtype_device(api: str, obj: object, dtype: object, device: object) -> None:
    """Validates ``dtype`` and ``device`` and stores their canonical names on ``obj``."""
    canon = canonical_dtype(dtype) if isinstance(dtype, str) else None
    if canon is None:
        raise ValueError(
            f"{api}: expected dtype to be a torch dtype name like 'float32', got {dtype!r}"
        )
    dev = _canonical_device(device) if isinstance(device, str) else None
    if dev is None:
        raise ValueError(f"{api}: expected device to be a torch device like 'cpu', got {device!r}")
    object.__setattr__(obj, "dtype", canon)
    object.__setattr__(obj, "device", dev)


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """What a plan needs to know of one parameter: shape, dtype, device and param group.

    ``dtype`` and ``device`` are stored canonically ('float' becomes 'float32', 'cuda:0' stays).

    Example:
        >>> spec = TensorSpec((4, 3), "float", "cpu")
        >>> spec.dtype, spec.numel, spec.nbytes
        ('float32', 12, 48)
    """

    shape: tuple[int, ...]
    dtype: str
    device: str
    param_group: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", check_ints("TensorSpec", "shape", self.shape, 0))
        _check_dtype_device("TensorSpec", self, self.dtype, self.device)
        check_int("TensorSpec", "param_group", self.param_group, 0)

    @property
    def numel(self) -> int:
        """The number of elements."""
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        """The number of bytes of the elements."""
        return self.numel * itemsize(self.dtype)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype)

    @classmethod
    def from_tensor(cls, t: torch.Tensor, param_group: int = 0) -> TensorSpec:
        """The spec of tensor ``t`` (real or on the ``meta`` device).

        Example:
            >>> TensorSpec.from_tensor(torch.empty(2, 5, device="meta", dtype=torch.bfloat16))
            TensorSpec(shape=(2, 5), dtype='bfloat16', device='meta', param_group=0)
        """
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"TensorSpec.from_tensor: expected a torch.Tensor, got {short(t)}")
        t = local_tensor(t)
        return cls(tuple(t.shape), str(t.dtype).removeprefix("torch."), str(t.device), param_group)


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # DTensor subclasses torch.Tensor: never these


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local tensor of a DTensor (its storage, not a copy), else
    ``t`` itself. A DTensor parameter (tensor parallelism) is planned and sharded by it.

    Example:
        >>> t = torch.ones(2)
        >>> local_tensor(t) is t
        True
    """
    if type(t) in _PLAIN:  # the hot path (every gradient, every step): no DTensor
        return t
    # None made before its module is imported; torch < 2.5 has it in torch.distributed._tensor.
    for name in ("torch.distributed.tensor", "torch.distributed._tensor"):
        dtensor = getattr(sys.modules.get(name), "DTensor", None)
        if dtensor is not None and isinstance(t, dtensor):
            local: torch.Tensor = t._local_tensor
            return local
    return t


@dataclass(frozen=True, slots=True)
class Piece:
    """Elements ``[start, stop)`` of flattened tensor ``tensor``, owned by one rank.

    They lie at ``offset`` in that rank's shard of ``plan.groups[group]``.

    Example:
        >>> Piece(tensor=0, start=2, stop=5, group=0, offset=0).numel
        3
    """

    tensor: int
    start: int
    stop: int
    group: int
    offset: int

    def __post_init__(self) -> None:
        for name in ("tensor", "start", "group", "offset"):
            check_int("Piece", name, getattr(self, name), 0)
        check_int("Piece", "stop", self.stop, self.start + 1)

    @property
    def numel(self) -> int:
        """The number of elements, ``stop - start``."""
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class Bucket:
    """Elements ``[start, start + numel)`` of a group's flat buffer: one collective.

    Rank ``r`` owns ``shards[r]`` elements of it, right after the shards of ranks ``< r``
    (see [Note: plan layout]). Flat plans have equal shards, greedy plans each owner's tensors.

    Example:
        >>> b = Bucket(start=32, shards=(8, 8, 8, 8))
        >>> b.numel, b.shard_start(2), b.uniform
        (32, 48, True)
    """

    start: int
    shards: tuple[int, ...]

    def __post_init__(self) -> None:
        check_int("Bucket", "start", self.start, 0)
        object.__setattr__(self, "shards", check_ints("Bucket", "shards", self.shards, 0))
        if not self.shards:
            raise ValueError("Bucket: expected one shard size per rank, got none")

    @property
    def numel(self) -> int:
        """The elements of the bucket: every rank's shard, padding included."""
        return sum(self.shards)

    @property
    def stop(self) -> int:
        """The element after the bucket's last."""
        return self.start + self.numel

    @property
    def uniform(self) -> bool:
        """Whether every rank's shard has the same size (one all-gather or reduce-scatter)."""
        return len(set(self.shards)) == 1

    def shard_start(self, rank: int) -> int:
        """Where ``rank``'s shard starts in the group's flat buffer."""
        return self.start + sum(self.shards[:rank])


@dataclass(frozen=True, slots=True)
class BufferGroup:
    """One flat buffer: the tensors of one (dtype, device), cut into buckets.

    Tensor ``tensors[k]`` lies at element ``offsets[k]`` (offsets do not decrease), wholly inside
    one bucket. Rank ``r`` owns shard ``r`` of every bucket; its shards end to end are its part
    of the group (``shard_numels[r]`` elements), laid out as its optimizer state is.

    Example:
        >>> g = BufferGroup("float32", "cpu", (0, 1), (0, 12), (Bucket(0, (16, 16)),), 2)
        >>> g.numel, g.shard_numels
        (32, (16, 16))
    """

    dtype: str
    device: str
    tensors: tuple[int, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    world_size: int
    _shard_numels: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check_dtype_device("BufferGroup", self, self.dtype, self.device)
        object.__setattr__(self, "tensors", check_ints("BufferGroup", "tensors", self.tensors, 0))
        object.__setattr__(self, "offsets", check_ints("BufferGroup", "offsets", self.offsets, 0))
        if len(self.tensors) != len(self.offsets):
            raise ValueError(
                f"BufferGroup: expected one offset per tensor, got {len(self.offsets)} offsets "
                f"for {len(self.tensors)} tensors"
            )
        if len(set(self.tensors)) != len(self.tensors):
            raise ValueError(f"BufferGroup: expected distinct tensors, got {short(self.tensors)}")
        check_int("BufferGroup", "world_size", self.world_size, 1)
        buckets = self.buckets
        if not isinstance(buckets, (tuple, list)) or not all(
            isinstance(b, Bucket) for b in buckets
        ):
            raise TypeError("BufferGroup: expected buckets to be a tuple of Bucket")
        object.__setattr__(self, "buckets", tuple(buckets))
        end = 0
        for i, b in enumerate(self.buckets):
            if b.start != end or len(b.shards) != self.world_size:
                raise ValueError(
                    f"BufferGroup: expected buckets[{i}] to start at {end} with "
                    f"{self.world_size} shards, got start {b.start} and {len(b.shards)} shards"
                )
            end = b.stop
        per_rank = zip(*(b.shards for b in self.buckets)) if self.buckets else ()
        numels = tuple(map(sum, per_rank)) or (0,) * self.world_size
        object.__setattr__(self, "_shard_numels", numels)  # read per rank: once, not W^2 times

    @property
    def numel(self) -> int:
        """The length of the whole flat buffer, padding included."""
        return self.buckets[-1].stop if self.buckets else 0

    @property
    def shard_numels(self) -> tuple[int, ...]:
        """Per rank, the elements of its shards of every bucket together."""
        return self._shard_numels
