"""Sharded state dicts (each rank's buffers plus the plan) and the boxes of DCP pieces."""

from __future__ import annotations

import itertools
import math
import os
from typing import Any

import pytest
import torch

from shardopt.core import adam, plan_partition, sgd
from shardopt.functional import load_sharded_state_dict, shard, sharded_state_dict
from shardopt.functional.checkpoint._dcp_pieces import LocalBoxes, boxes

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
SHAPES: list[tuple[tuple[int, ...], torch.dtype]] = [
    ((7, 5), F32),
    ((5,), BF16),
    ((3, 4, 2), F64),
    ((13,), BF16),
    ((6, 6), F32),
]


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 4), (2, 1, 3, 2)])
def test_boxes_tile_every_run_of_elements_exactly_with_contiguous_boxes(shape):
    numel = math.prod(shape)
    index = torch.arange(numel).view(shape)
    for start, stop in itertools.combinations(range(numel + 1), 2):
        found = boxes(shape, start, stop)
        assert 1 <= len(found) <= max(1, 2 * len(shape) - 1), (start, stop, found)
        covered = []
        for offsets, sizes, flat in found:
            region = index[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))].reshape(-1)
            assert torch.equal(region, torch.arange(flat, flat + region.numel()))
            covered += region.tolist()
        assert covered == list(range(start, stop)), (start, stop, found)


def test_a_local_boxes_tensor_refuses_every_operation_but_checkpointing():
    flat = torch.arange(12.0)
    pieces = LocalBoxes(
        (3, 4),
        [((o[0], o[1]), flat[f : f + math.prod(s)].view(s)) for o, s, f in boxes((3, 4), 2, 11)],
    )
    assert pieces.shape == (3, 4)
    assert "boxes=3" in repr(pieces)
    assert [tuple(c.offsets) for c in pieces.__create_chunk_list__()] == [(0, 2), (1, 0), (2, 0)]
    with pytest.raises(RuntimeError, match="LocalBoxes: a checkpoint-only tensor"):
        pieces + 1


def make_params(shapes: list[Any] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(s, generator=gen, dtype=F64).to(d) for s, d in shapes]


def local_grads(step: int, rank: int) -> list[torch.Tensor | None]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    out: list[torch.Tensor | None] = []
    for i, (shape, dtype) in enumerate(SHAPES):
        g = torch.randint(-64, 65, shape, generator=gen).to(dtype) / 64
        out.append(None if i == 3 and step % 3 == 1 else g)
    return out


def resume_from_files(
    rank: int, world: int, root: str, strategy: str, stage: int, bucket: int | None
) -> list[bool]:
    """Adam with float32 master weights for the bfloat16 tensors: 3 steps, torch.save of each
    rank's sharded state dict, then a fresh state (from the same parameters) loaded from the
    file and the original both take 3 more steps. Same plan, same ranks: bitwise equal."""
    params = make_params()
    plan = plan_partition(params, world, strategy=strategy, bucket_numel=bucket)
    sharded = shard(adam(1e-2), plan, stage=stage, master_dtype=F32)
    state = sharded.init(params)
    for step in range(3):
        state = sharded.step(params, local_grads(step, rank), state)
    path = os.path.join(root, f"rank{rank}.pt")
    torch.save(sharded_state_dict(state), path)
    resumed_params = [p.clone() for p in params]
    resumed = shard(adam(1e-2), plan, stage=stage, master_dtype=F32)
    resumed_state = resumed.init(resumed_params)
    load_sharded_state_dict(resumed_state, torch.load(path, weights_only=True))
    for step in range(3, 6):
        state = sharded.step(params, local_grads(step, rank), state)
        resumed_state = resumed.step(resumed_params, local_grads(step, rank), resumed_state)
    same_params = all(torch.equal(a, b) for a, b in zip(params, resumed_params))
    pairs = [
        (a, b)
        for f, g in zip(state.fields, resumed_state.fields)
        for a, b in zip(f.buffers, g.buffers)
    ]
    pairs += [(a, b) for a, b in zip(state.master, resumed_state.master) if a is not None]
    return [same_params, all(torch.equal(a, b) for a, b in pairs), len(pairs) > 4]


@pytest.mark.parametrize(("strategy", "stage", "bucket"), [("flat", 2, 16), ("greedy", 1, None)])
def test_a_sharded_state_dict_saved_per_rank_resumes_bitwise(
    run_world, tmp_path, strategy, stage, bucket
):
    for rank, (same_params, same_state, has_master) in enumerate(
        run_world(resume_from_files, 2, str(tmp_path), strategy, stage, bucket)
    ):
        assert same_params, f"rank {rank}: the parameters differ"
        assert same_state, f"rank {rank}: the optimizer state differs"
        assert has_master, f"rank {rank}: no master weights"


def sharded_load_errors(rank: int, world: int) -> list[str]:
    """Loads that must fail, each with the API, the rule and the value in the message."""
    params = make_params()
    plan = plan_partition(params, world)
    sharded = shard(adam(1e-2), plan)
    state = sharded.step(params, local_grads(0, rank), sharded.init(params))
    sd = sharded_state_dict(state)
    greedy = shard(adam(1e-2), plan_partition(params, world, strategy="greedy"))
    plain = shard(sgd(0.1, momentum=0.9), plan)
    wrong_dtype = {**sd, "fields": {**sd["fields"], "[0].mu": {**sd["fields"]["[0].mu"]}}}
    wrong_dtype["fields"]["[0].mu"]["buffers"] = [
        b.double() for b in sd["fields"]["[0].mu"]["buffers"]
    ]
    attempts = {
        "not a dict": (state, [sd]),
        "other plan": (greedy.init(make_params()), sd),
        "other rank": (state, {**sd, "rank": (rank + 1) % world}),
        "other optimizer": (plain.init(make_params()), sd),
        "wrong dtype": (state, wrong_dtype),
        "no master": (state, {**sd, "master": []}),
    }
    messages = []
    for what, (target, data) in attempts.items():
        try:
            load_sharded_state_dict(target, data)
        except ValueError as exc:
            messages.append(f"{what}: {exc}")
        else:
            messages.append(f"{what}: no error")
    return messages


def test_load_sharded_state_dict_names_the_mismatch(run_world):
    expected = [
        "expected a dict of format 'shardopt.sharded_state_dict/1', got 'list'",
        "expected the state dict of the same plan",
        "expected the state dict of rank 1, got rank 0",
        "expected fields ['[0].count', '[0].momentum']",
        "expected fields['[0].mu'][0] of shape (48,) and torch.float32, got (48,) and "
        "torch.float64",
        "expected master to be a list of 3, got []",
    ]
    messages = run_world(sharded_load_errors, 2)[1]
    for message, fragment in zip(messages, expected):
        assert f"load_sharded_state_dict: {fragment}" in message.split(": ", 1)[1], message
