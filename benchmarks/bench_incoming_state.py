"""What checking incoming state costs (issue 46): loads of 8M elements of Adam state (4M float32
parameters: ``exp_avg`` and ``exp_avg_sq``) with the checks of [Note: incoming state] and
without them, interleaved round by round in one process (W=1, gloo, CPU, one thread).

- ``load_torch_state_dict``: the API against ``write_torch_state_dict(..., domain=False)``, the
  same load with the form checks only (no pass over the data);
- ``ZeroRedundancyOptimizer.load_state_dict`` (greedy and flat): the API against its body
  without the checks (the entries matched by position, the hyperparameters copied, the backend's
  load), as before issue 46; also after ``torch.load`` of the dict from a file (greedy);
- ``load_checkpoint`` of a ``save_checkpoint`` directory, against the same load with its check of
  the values read switched off (the form checks against the metadata stay).

Printed per load: the median time of each variant and the median and range of the per-round
ratio checked/unchecked, alternating which goes first.

    python benchmarks/bench_incoming_state.py --rounds 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import adam, plan_partition
from shardopt.functional import load_checkpoint, load_torch_state_dict, save_checkpoint, shard
from shardopt.functional.checkpoint import _dcp, write_torch_state_dict
from shardopt.optim import ZeroRedundancyOptimizer
from shardopt.optim.zero._partition import copy_hyperparameters
from shardopt.optim.zero._state_dicts import saved_entries, wide_entries

SHAPES = [(1024, 1024)] * 4  # 4M parameters: 8M elements of exp_avg and exp_avg_sq


def _torch_dict() -> dict[str, Any]:
    params = [torch.nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    return opt.state_dict()


def _unchecked_zero(opt: ZeroRedundancyOptimizer, sd: dict[str, Any]) -> None:
    """ZeroRedundancyOptimizer.load_state_dict's body before issue 46."""
    entries = saved_entries(sd, opt.param_groups)
    opt._saved.changed(loaded_state=bool(sd["state"]))
    copy_hyperparameters(sd["param_groups"], opt.param_groups)
    opt._backend.load(sd["param_groups"], entries, wide_entries(sd))
    copy_hyperparameters(opt.param_groups, opt.optim.param_groups)


def _variants(sd: dict[str, Any]) -> dict[str, tuple[Callable[[], None], Callable[[], None]]]:
    params = [torch.zeros(s) for s in SHAPES]
    state = shard(adam(1e-3), plan_partition(params, 1)).init(params)
    out = {
        "load_torch_state_dict": (
            lambda: load_torch_state_dict(state, sd),
            lambda: write_torch_state_dict("bench", state, sd, domain=False),
        )
    }
    for partition in ("greedy", "flat"):
        zero = ZeroRedundancyOptimizer(
            [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES],
            torch.optim.Adam,
            lr=1e-3,
            partition=partition,
        )
        out[f"zero {partition}"] = (
            lambda z=zero: z.load_state_dict(sd),
            lambda z=zero: _unchecked_zero(z, sd),
        )
    root = tempfile.mkdtemp()
    file = os.path.join(root, "optim.pt")
    torch.save(sd, file)
    zero = ZeroRedundancyOptimizer(
        [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES], torch.optim.Adam, lr=1e-3
    )
    out["torch.load + zero greedy"] = (
        lambda: zero.load_state_dict(torch.load(file, weights_only=True)),
        lambda: _unchecked_zero(zero, torch.load(file, weights_only=True)),
    )
    load_torch_state_dict(state, sd)
    save_checkpoint(state, os.path.join(root, "ckpt"))
    out["load_checkpoint"] = (
        lambda: load_checkpoint(state, os.path.join(root, "ckpt")),
        lambda: _without_domain(lambda: load_checkpoint(state, os.path.join(root, "ckpt"))),
    )
    return out


def _without_domain(load: Callable[[], None]) -> None:
    """``load`` with load_checkpoint's check of the values read switched off."""
    saved = _dcp._domain_refusal
    _dcp._domain_refusal = lambda *args: None  # type: ignore[assignment]
    try:
        load()
    finally:
        _dcp._domain_refusal = saved


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(1)
    store = os.path.join(tempfile.mkdtemp(), "store")
    dist.init_process_group("gloo", store=dist.FileStore(store, 1), rank=0, world_size=1)
    sd = _torch_dict()
    for name, (checked, unchecked) in _variants(sd).items():
        checked(), unchecked()  # warm: the probe's record, the caches
        times: dict[str, list[float]] = {"checked": [], "unchecked": []}
        for r in range(args.rounds):
            pair = [("checked", checked), ("unchecked", unchecked)]
            for label, fn in pair if r % 2 == 0 else pair[::-1]:
                times[label].append(_timed(fn))
        ratios = [c / u for c, u in zip(times["checked"], times["unchecked"])]
        print(
            f"{name}: checked {statistics.median(times['checked']) * 1e3:.1f} ms, unchecked "
            f"{statistics.median(times['unchecked']) * 1e3:.1f} ms, ratio median "
            f"{statistics.median(ratios):.3f} (range {min(ratios):.3f}-{max(ratios):.3f})"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
