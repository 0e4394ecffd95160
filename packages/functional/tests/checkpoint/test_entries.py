"""Any optimizer's state entries gathered to one rank by consolidation's windowed gathers."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardopt.functional.checkpoint import gather_entries
from shardopt.testing import World


def entries_of(rank: int, sizes: tuple[int, ...]) -> dict[int, dict[str, Any]]:
    """Rank ``rank``'s entries: ``sizes[rank]`` of them, of several dtypes, shapes and plain
    values (the same on every call)."""
    out = {}
    for i in range(sizes[rank]):
        index = 100 * rank + i
        out[index] = {
            "step": torch.tensor(float(index)),
            "exp_avg": torch.arange(7.0 * (i + 1) * (rank + 1)).reshape(-1, 7) + rank,
            "mask": torch.arange(5) % 2 == rank % 2,
            "half": torch.full((3,), float(rank), dtype=torch.bfloat16),
            "count": index,
            "nothing": None,
        }
    return out


@pytest.mark.parametrize(
    ("n", "sizes", "to"),
    [(2, (1, 2), 1), (3, (0, 40, 3), 0), (3, (2, 1, 5), 2)],
    ids=["W2", "W3-an-empty-rank-and-a-large-one", "W3-target-last"],
)
@pytest.mark.world("n", backend="gloo", timeout=120)
def test_every_rank_s_entries_arrive_whole_on_the_target_with_their_dtypes_and_values(
    world: World, n: int, sizes: tuple[int, ...], to: int
) -> None:
    mine = entries_of(world.rank, sizes)
    got = gather_entries(mine, to=to)
    if world.rank != to:
        assert got is None
        return
    assert got is not None
    expected = {k: v for r in range(n) for k, v in entries_of(r, sizes).items()}
    assert sorted(got) == sorted(expected)
    for index, entry in expected.items():
        assert list(got[index]) == list(entry)
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                assert got[index][key].dtype == value.dtype, (index, key)
                assert torch.equal(got[index][key], value), (index, key)
                assert got[index][key].device.type == "cpu"
            else:
                assert got[index][key] == value, (index, key)
    for index, entry in mine.items():  # the target's own entries are copies
        assert got[index]["exp_avg"].data_ptr() != entry["exp_avg"].data_ptr()
