"""The shardopt files a stage-2 gradient crosses, from its hook to the updated parameter.

One process (gloo, W=1), a 2-layer MLP under ``shard(adam, ..., stage=2)`` with
``register_grad_hooks``, one warm-up step; then a profiler records the shardopt frames on the
stack when the next ``backward`` launches a gradient's reduction (``reduce_scatter_bucket``) and
when the next ``step`` calls the kernel that reads the reduced shard and writes the parameter
(torch's fused Adam or a ``_foreach_`` op). Printed: the union of those stacks' files and
functions, outermost first: the gradient's path from its hook, and from ``step``, to the
updated parameter; and the calls back up (a call into a file that the path had already left).

    python scripts/gradient_path.py
"""

from __future__ import annotations

import itertools
import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from shardopt.core import adam, plan_partition
from shardopt.functional import register_grad_hooks, shard

# Where the gradient's data is handled: its reduction is launched (a Python function), and the
# update's kernel reads the reduced shard and writes the parameter (a torch builtin).
REDUCTION = "reduce_scatter_bucket"
KERNELS = ("_fused_adam", "_foreach_")


def short(path: str) -> str:
    return path.split("/src/", 1)[-1]


@contextmanager
def stacks() -> Iterator[list[list[tuple[str, str]]]]:
    """The shardopt frames on the stack (outermost first) at each reduction launch and each
    entry into the update's rule."""
    out: list[list[tuple[str, str]]] = []

    def tracer(frame: Any, event: str, arg: Any) -> None:
        reduction = event == "call" and frame.f_code.co_name == REDUCTION
        kernel = event == "c_call" and getattr(arg, "__name__", "").startswith(KERNELS)
        if not (reduction or kernel):
            return
        stack = []
        f = frame
        while f is not None:
            if "/shardopt/" in f.f_code.co_filename:
                stack.append((short(f.f_code.co_filename), f.f_code.co_name))
            f = f.f_back
        out.append(stack[::-1])

    sys.setprofile(tracer)
    try:
        yield out
    finally:
        sys.setprofile(None)


def calls_back_up(stack: list[tuple[str, str]]) -> list[str]:
    """The calls of ``stack`` (outermost first) that return into a file the path already left:
    a lower file calling up into the caller's (a callback, or a wrapper)."""
    left: set[str] = set()
    out = []
    for (path, _), (nxt, name) in itertools.pairwise(stack):
        if nxt != path:
            left.add(path)
            if nxt in left:
                out.append(f"{path} -> {nxt}:{name}")
    return out


def main() -> None:
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    params = list(model.parameters())
    sharded = shard(adam(1e-3), plan_partition(params, 1), stage=2)
    state = sharded.init(params)
    register_grad_hooks(params, state)
    for _ in range(2):  # the second pass is measured (the first allocates)
        loss = model(torch.randn(4, 8)).square().sum()
        with stacks() as seen:
            loss.backward()
            state = sharded.step(params, None, state)
    files: list[str] = []
    frames: list[tuple[str, str]] = []
    for stack in seen:
        for path, name in stack:
            if path not in files:
                files.append(path)
            if (path, name) not in frames:
                frames.append((path, name))
    back_up = sorted({call for stack in seen for call in calls_back_up(stack)})
    print(f"files ({len(files)}): {' -> '.join(files)}")
    print(f"calls back up ({len(back_up)}): {', '.join(back_up) or 'none'}")
    print(f"functions ({len(frames)}): {' -> '.join(f'{p}:{n}' for p, n in frames)}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
