"""Master weights of a sharded state: where each group's float32 master lives, chosen once."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, overload

import torch

from shardopt.functional.engine._buckets import BucketKey

if TYPE_CHECKING:
    from shardopt.functional.engine._param_buffers import ParamBuffers

__all__ = ["Masters", "build_masters", "join_remainder", "split_remainder"]

# [Note: master weights]
# A plan group whose dtype is less precise than ``master_dtype`` (bfloat16 or float16 under
# float32) is updated in float32: the update runs on float32 views, and each bucket's result is
# written into the rank's shard of the parameter buffer, which the all-gather then sends. One
# ``Masters`` object per sharded state, built at init, decides where each group's float32
# master lives (a ``GroupMaster`` per group); the update, the checkpoints and the byte counts
# ask it, never the options:
#
# - ``StoredMaster``: a compact shard in the master dtype ([Note: buffer storage]), 4 bytes per
#   owned element in float32; the update runs on views of it, ``write_back`` rounds it into the
#   parameters.
# - ``RemainderMaster`` (``master_remainders=True``, bfloat16 groups only): the rank's own
#   shard of the bfloat16 parameter buffer plus an int16 compact shard of remainders, 2 bytes
#   per owned element; see [Note: master remainders].
#
# ``Masters`` is a sequence of the stored tensors (the float32 master, the int16 remainder, or
# None, per group): what the rank holds. ``full(g)`` is group ``g``'s float32 master in every
# case (the stored tensor itself, or a reconstruction), ``load(g, src)`` sets it from float32,
# ``reset(g)`` from the current parameters.
#
# [Note: master remainders]
# Encoding. A float32 master x, read as its 32 bits (int32), is kept as hi, a bfloat16 (the
# parameter), and lo, an int16 (the remainder): hi = the top 16 bits of (x + 0x8000), lo = the
# low 16 bits of x. Adding 0x8000 before truncating rounds the magnitude to nearest, ties away
# from zero (the bits of a float are sign and magnitude), the rule of Megatron-LM's
# ``store_param_remainders``. Join: x = (hi << 16) + lo, lo sign-extended, in int32
# two's-complement arithmetic. Both are a few vectorized integer ops on dtype views
# (``x.view(torch.int32)``, ``hi.view(torch.int16)``), on any device (Speed, below).
#
# Exactness. Write x = H * 2^16 + L with H the signed top half and 0 <= L < 2^16. If L < 2^15,
# hi = H and lo = L, so the join gives H * 2^16 + L = x. If L >= 2^15, adding 0x8000 carries
# into the top half, hi = H + 1 and lo = L - 2^16 (sign-extended), so the join gives
# (H + 1) * 2^16 + L - 2^16 = x. The arithmetic is modulo 2^32, so this holds for every bit
# pattern: negatives, +-0, subnormals, +-inf, every nan. (The hi of a nan need not be a nan:
# a payload only in the low 16 bits, 0x7F800001 to 0x7F807FFF and their negatives, gives an
# infinite hi, and 0x7FFF8000 and up, or 0xFFFF8000 and up, carry past the top into a zero hi;
# the nans arithmetic makes, 0x7FC00000 and 0xFFC00000, keep a nan hi. A nan master is lost
# anyway.)
# The split of a join gives back (hi, lo) (the pair above is the only one with lo in int16
# range), so an untouched element is written back unchanged. The update reads only the
# reconstructed float32 masters and the gradients, never the bfloat16 parameters, so with the
# same gradients the reconstructed masters equal bitwise those of the float32-master path, step
# after step.
#
# The tie caveat. torch's float32 -> bfloat16 conversion (the float32 path's ``write_back``)
# rounds ties to even; this rounds them away from zero. So the bfloat16 parameters of the two
# paths differ, by one unit in the last place, only where a master's low 16 bits are exactly
# 0x8000 (and its bit 16 is 0: the tie goes down under round-to-even), and at the nans above.
# No 16-bit remainder can be exact under round-to-even: the float32 values that round to an
# even H are (H - 1) * 2^16 + 0x8000 through H * 2^16 + 0x8000, both ties included, 2^16 + 1 of
# them for 2^16 remainders; the two ties share the parameter H and the low bits 0x8000.
#
# Memory. A bfloat16 group keeps 2 bytes per owned element instead of 4. The update needs a
# float32 temporary: one bucket's shard at a time where it runs bucket by bucket (the sliceable
# case of [Note: update and gather pipeline]), a scratch kept between steps (like the gradient
# staging, bounded by the bucket size: allocating it each step cost more than the join itself,
# in page faults, on the CPU); the whole shard where it runs in one call
# (whole-tensor transformations such as Muon, a state that cannot be sliced, deferred gathers),
# each bucket's part freed as it is written back. ``full`` (checkpoints) and init make a
# float32 copy of the group's shard for as long as they need it.
#
# Writing the parameters (``model.load_state_dict``) moves the remainder masters with them
# (the master is the parameter plus its remainder), where float32 masters stay as they were.
#
# Speed. The join and the split run window by window (``_windows``), each window a few
# contiguous int32 ops: on the CPU a window's int32 temporary (1 MiB) stays in cache, so each
# 16-bit half is read or written once from memory; elsewhere a window bounds the temporary. Join:
# x = sext(lo) + 65536 * sext(hi), which is (hi - borrow) << 16 joined to lo's bits. Split:
# lo = the low 16 bits of x, hi = the low 16 bits of (x + 0x8000) >> 16. The arithmetic wraps
# modulo 2^32, as torch's integer kernels do (only nan patterns reach the wrap). Windowed
# contiguous int32 ops take about half the time of strided int16 ops on the interleaved halves
# (measured: docs/performance.md; benchmarks/bench_master_remainders.py times the step).


_CPU_WINDOW = 1 << 18  # elements of one pass on the CPU: an int32 window fits in L2
_WINDOW = 1 << 24  # elsewhere: one pass per 16M elements, a 64 MiB temporary at most


def _windows(n: int, device: torch.device) -> Iterator[tuple[slice, torch.Tensor]]:
    """The windows over ``n`` elements, each with an int32 temporary of its length (one
    buffer, reused)."""
    size = max(1, min(n, _CPU_WINDOW if device.type == "cpu" else _WINDOW))
    temp = torch.empty(size, dtype=torch.int32, device=device)
    for a in range(0, n, size):
        b = min(a + size, n)
        yield slice(a, b), temp[: b - a]


def split_remainder(
    x: torch.Tensor, hi: torch.Tensor | None = None, lo: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 ``x`` as (its bfloat16 rounded ties away from zero, its int16 remainder), written
    into ``hi`` and ``lo`` where given. See [Note: master remainders].

    Example:
        >>> hi, lo = split_remainder(torch.tensor([1.0 + 2**-8, -3.0]))  # a tie, rounded up
        >>> hi.tolist(), lo.tolist(), join_remainder(hi, lo).tolist()
        ([1.0078125, -3.0], [-32768, 0], [1.00390625, -3.0])
    """
    hi = torch.empty_like(x, dtype=torch.bfloat16) if hi is None else hi
    lo = torch.empty_like(x, dtype=torch.int16) if lo is None else lo
    bits, top = x.view(torch.int32), hi.view(torch.int16)
    with torch.no_grad():
        for w, t in _windows(x.numel(), x.device):
            lo[w].copy_(bits[w])  # int32 -> int16 keeps the low 16 bits
            top[w].copy_(torch.add(bits[w], 0x8000, out=t).bitwise_right_shift_(16))
    return hi, lo


def join_remainder(
    hi: torch.Tensor, lo: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The float32 whose split is (``hi``, ``lo``), written into ``out`` where given.

    Example:
        >>> x = torch.tensor([3.0e38, -1e-40, float("inf")])
        >>> torch.equal(join_remainder(*split_remainder(x)).view(torch.int32), x.view(torch.int32))
        True
    """
    out = torch.empty_like(lo, dtype=torch.float32) if out is None else out
    bits, top = out.view(torch.int32), hi.view(torch.int16)
    with torch.no_grad():
        for w, t in _windows(lo.numel(), lo.device):
            bits[w].copy_(lo[w]).add_(t.copy_(top[w]), alpha=65536)
    return out


class GroupMaster(Protocol):
    """Where one plan group's float32 master lives (see [Note: master weights])."""

    stored: torch.Tensor
    dtype: torch.dtype

    def open(self, key: BucketKey) -> tuple[torch.Tensor, int]: ...
    def write_back(self, key: BucketKey) -> None: ...
    def full(self) -> torch.Tensor: ...
    def load(self, src: torch.Tensor) -> None: ...
    def reset(self) -> None: ...


def _part(param_buffers: ParamBuffers, compact: torch.Tensor, key: BucketKey) -> torch.Tensor:
    """Bucket ``key``'s part of ``compact``, a compact shard of its group."""
    off = param_buffers.shard_offsets[key]
    return compact[off : off + param_buffers.bucket(key).shards[param_buffers.rank]]


class StoredMaster:
    """A compact shard of the group's masters in their dtype (float32: 4 bytes per owned
    element)."""

    def __init__(self, param_buffers: ParamBuffers, g: int, dtype: torch.dtype) -> None:
        self.param_buffers, self.g, self.dtype = param_buffers, g, dtype
        self.stored = param_buffers.copy_shard_out(g).to(dtype)

    def open(self, key: BucketKey) -> tuple[torch.Tensor, int]:
        """The float32 tensor holding bucket ``key``'s masters, and its first compact offset."""
        return self.stored, 0

    def write_back(self, key: BucketKey) -> None:
        """Rounds bucket ``key``'s masters into its shard of the parameter buffer."""
        with torch.no_grad():
            self.param_buffers.bucket_shard(key).copy_(_part(self.param_buffers, self.stored, key))

    def full(self) -> torch.Tensor:
        return self.stored

    def load(self, src: torch.Tensor) -> None:
        if src is not self.stored:
            with torch.no_grad():
                self.stored.copy_(src)

    def reset(self) -> None:
        with torch.no_grad():
            self.stored.copy_(self.param_buffers.copy_shard_out(self.g))


class RemainderMaster:
    """The group's bfloat16 parameter shard plus an int16 compact shard of remainders (2 bytes
    per owned element); see [Note: master remainders]."""

    dtype = torch.float32

    def __init__(self, param_buffers: ParamBuffers, g: int) -> None:
        self.param_buffers, self.g = param_buffers, g
        numel = sum(b.shards[param_buffers.rank] for b in param_buffers.plan.groups[g].buckets)
        device = param_buffers.buffers[g].device
        self.stored = torch.zeros(numel, dtype=torch.int16, device=device)  # masters = params
        self._open: dict[BucketKey, torch.Tensor] = {}
        self._scratch: torch.Tensor | None = None  # one bucket's float32, kept between steps

    def open(self, key: BucketKey) -> tuple[torch.Tensor, int]:
        """Bucket ``key``'s masters reconstructed into a float32 temporary (held until
        ``write_back(key)``; the kept scratch when no other bucket is open), and its first
        compact offset."""
        hi, lo = self.param_buffers.bucket_shard(key), _part(self.param_buffers, self.stored, key)
        out = None
        if not self._open:
            if self._scratch is None:
                largest = max(
                    b.shards[self.param_buffers.rank]
                    for b in self.param_buffers.plan.groups[self.g].buckets
                )
                self._scratch = torch.empty(largest, dtype=torch.float32, device=lo.device)
            out = self._scratch[: lo.numel()]
        self._open[key] = join_remainder(hi, lo, out)
        return self._open[key], self.param_buffers.shard_offsets[key]

    def write_back(self, key: BucketKey) -> None:
        """Splits bucket ``key``'s temporary into its parameter shard and its remainders."""
        temp = self._open.pop(key, None)
        if temp is not None:
            rem = _part(self.param_buffers, self.stored, key)
            split_remainder(temp, self.param_buffers.bucket_shard(key), rem)

    def full(self) -> torch.Tensor:
        return join_remainder(self.param_buffers.copy_shard_out(self.g), self.stored)

    def load(self, src: torch.Tensor) -> None:
        """The masters from float32 ``src``: the remainders, and the parameter shard (its
        bfloat16 halves), so that the join gives ``src`` exactly."""
        for key in (k for k in self.param_buffers.keys if k[0] == self.g):
            rem = _part(self.param_buffers, self.stored, key)
            split_remainder(
                _part(self.param_buffers, src, key), self.param_buffers.bucket_shard(key), rem
            )

    def reset(self) -> None:
        self.stored.zero_()  # a bfloat16 parameter is its own float32 master


class Masters(Sequence["torch.Tensor | None"]):
    """Each plan group's master weights (None: the group is updated in its own dtype): a
    sequence of the stored tensors, and the float32 views the update runs on (see
    [Note: master weights])."""

    def __init__(self, param_buffers: ParamBuffers, groups: Sequence[GroupMaster | None]) -> None:
        self.param_buffers, self.groups = param_buffers, tuple(groups)

    @overload
    def __getitem__(self, g: int) -> torch.Tensor | None: ...
    @overload
    def __getitem__(self, g: slice) -> Sequence[torch.Tensor | None]: ...
    def __getitem__(self, g: int | slice) -> torch.Tensor | Sequence[torch.Tensor | None] | None:
        return self.stored[g]

    def __len__(self) -> int:
        return len(self.groups)

    def __iter__(self) -> Iterator[torch.Tensor | None]:
        return iter(self.stored)

    @property
    def stored(self) -> tuple[torch.Tensor | None, ...]:
        """What the rank holds per group: float32 masters, int16 remainders, or None."""
        return tuple(None if m is None else m.stored for m in self.groups)

    def dtype(self, g: int) -> torch.dtype | None:
        """The dtype group ``g`` is updated in where it has masters, else None."""
        master = self.groups[g]
        return None if master is None else master.dtype

    def views_for_update(self, params: list[torch.Tensor], keys: Iterable[BucketKey]) -> None:
        """Points ``params`` (one per piece) of the pieces of buckets ``keys`` with masters at
        float32 views of them; ``write_back(key)`` after each bucket's update."""
        for key in keys:
            master, (lo, hi) = self.groups[key[0]], self.param_buffers.piece_ranges[key]
            if master is None or lo == hi:
                continue
            src, base = master.open(key)
            for i in range(lo, hi):
                p = self.param_buffers.pieces[i]
                params[i] = src[p.offset - base : p.offset - base + p.numel]

    def write_back(self, key: BucketKey) -> None:
        """Bucket ``key``'s updated masters into the parameter buffer (before its gather)."""
        if (master := self.groups[key[0]]) is not None:
            master.write_back(key)

    def full(self, g: int) -> torch.Tensor | None:
        """Group ``g``'s float32 compact master shard: the stored tensor itself (writes go to
        the masters) or a reconstruction (give it to ``load``), or None."""
        master = self.groups[g]
        return None if master is None else master.full()

    def fulls(self) -> tuple[torch.Tensor | None, ...]:
        """``full(g)`` of every group."""
        return tuple(self.full(g) for g in range(len(self)))

    def load(self, g: int, src: torch.Tensor) -> None:
        """Sets group ``g``'s masters from float32 compact shard ``src`` (a no-op for the stored
        tensor itself)."""
        if (master := self.groups[g]) is not None:
            master.load(src)

    def load_all(self, fulls: Sequence[torch.Tensor | None]) -> None:
        """``load(g, fulls[g])`` of every group with masters, e.g. after filling ``fulls()``."""
        for g, src in enumerate(fulls):
            if src is not None:
                self.load(g, src)

    def reset(self) -> None:
        """Every group's masters from the current parameters."""
        for master in self.groups:
            if master is not None:
                master.reset()


def build_masters(
    param_buffers: ParamBuffers, dtypes: Sequence[torch.dtype | None], remainders: bool
) -> Masters:
    """The masters of ``param_buffers``' groups: ``dtypes[g]`` (None: none), as 16-bit remainders of
    the bfloat16 groups where ``remainders`` (float32 masters only; [Note: master remainders]).
    """
    groups: list[GroupMaster | None] = []
    for g, (buf, m) in enumerate(zip(param_buffers.buffers, dtypes)):
        if m is None:
            groups.append(None)
        elif remainders and m is torch.float32 and buf.dtype is torch.bfloat16:
            groups.append(RemainderMaster(param_buffers, g))
        else:
            groups.append(StoredMaster(param_buffers, g, m))
    return Masters(param_buffers, groups)
