"""The arithmetic of the GPU check: medians, ratios, bytes moved, relative errors, schedules."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

__all__ = [
    "ADAMW_TENSORS_READ",
    "ADAMW_TENSORS_WRITTEN",
    "adamw_bytes",
    "bandwidth_fraction",
    "copy_bytes",
    "fits_in_memory",
    "interleaved_orders",
    "median",
    "ratio",
    "relative_error",
]

# [Note: bytes of a fused AdamW step]
# One flat fused AdamW step reads the parameters, the gradients and both moments (4 tensors)
# and writes the parameters and both moments (3 tensors): 7 * numel * element size bytes.
# The step count is one scalar and is not counted. A device-to-device copy of n bytes reads n
# and writes n: 2n. The fraction of the copy's bandwidth is the ratio of the two rates, so a
# fused update bound by memory traffic scores near 1.
ADAMW_TENSORS_READ = 4
ADAMW_TENSORS_WRITTEN = 3


def adamw_bytes(numel: int, element_size: int = 4) -> int:
    """Bytes one fused AdamW step reads and writes over ``numel`` parameters.

    Example:
        >>> adamw_bytes(10)
        280
    """
    return (ADAMW_TENSORS_READ + ADAMW_TENSORS_WRITTEN) * numel * element_size


def copy_bytes(nbytes: int) -> int:
    """Bytes read plus written by a copy of ``nbytes`` bytes.

    Example:
        >>> copy_bytes(1024)
        2048
    """
    return 2 * nbytes


def median(values: Sequence[float]) -> float:
    """The median of ``values``; NaN for none.

    Example:
        >>> median([3.0, 1.0, 2.0]), median([])
        (2.0, nan)
    """
    return float(statistics.median(values)) if values else math.nan


def ratio(numerator: float, denominator: float) -> float:
    """``numerator / denominator``; NaN where the denominator is not a positive number.

    Example:
        >>> ratio(3.0, 4.0), ratio(1.0, 0.0)
        (0.75, nan)
    """
    if not (denominator > 0) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def bandwidth_fraction(moved: int, seconds: float, copy_moved: int, copy_seconds: float) -> float:
    """The rate of ``moved`` bytes in ``seconds`` as a fraction of the copy's rate.

    Example:
        >>> bandwidth_fraction(280, 1.0, 200, 0.5)
        0.7
    """
    return ratio(ratio(moved, seconds), ratio(copy_moved, copy_seconds))


def fits_in_memory(needed: int, free: int, headroom: float = 0.9) -> bool:
    """Whether ``needed`` bytes fit in ``headroom`` of ``free`` bytes.

    Example:
        >>> fits_in_memory(80, 100), fits_in_memory(95, 100)
        (True, False)
    """
    return needed <= headroom * free


def interleaved_orders(names: Sequence[str], rounds: int) -> list[list[str]]:
    """The order of ``names`` in each round, rotated by one every round, so that no variant is
    always first (caches, clocks and other load hit all alike).

    Example:
        >>> interleaved_orders(["a", "b", "c"], 4)
        [['a', 'b', 'c'], ['b', 'c', 'a'], ['c', 'a', 'b'], ['a', 'b', 'c']]
    """
    n = len(names)
    return [[names[(r + i) % n] for i in range(n)] for r in range(rounds)] if n else []


def relative_error(max_abs_diff: float, max_abs_ref: float) -> float:
    """``max |a - b|`` relative to the reference's largest magnitude (the repo's convention:
    relative to each tensor's largest value), the absolute difference where that is zero.

    Example:
        >>> relative_error(1e-6, 2.0), relative_error(0.5, 0.0)
        (5e-07, 0.5)
    """
    return max_abs_diff / max_abs_ref if max_abs_ref > 0 else max_abs_diff
